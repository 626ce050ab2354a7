//! Server-side apply (a PATCH of `application/apply-patch+yaml`, with `fieldManager` and
//! `force`), as the API server does it for the fields edl and Kueue apply:
//!
//! - a manager's applied configuration sets the fields it names, and the manager owns
//!   them; a field it owned by an earlier apply and names no longer is removed, unless
//!   another manager owns it too;
//! - a field another manager owns, applied with a different value, is `409 Conflict`
//!   naming the manager and the field, unless `force=true`: then it changes hands;
//! - ownership is kept in `metadata.managedFields`, one entry per manager and
//!   subresource (`operation: Apply`, `fieldsType: FieldsV1`, the fields in the nested
//!   `f:`/`k:` form the real server writes);
//! - a status apply (`/status`) sees and owns only `status`; a main one everything but
//!   `status`, `apiVersion`, `kind` and the server's metadata.
//!
//! Where it differs from a real server: a list is associative (merged item by item, each
//! item owned by its key) only when every item is an object with a string `type` (the
//! `conditions` of Kubernetes and Kueue, `listType: map` keyed by `type`); any other
//! list is atomic. Updates (PUT, merge patches) record no ownership (a real server
//! records them as `Update` entries, which can then conflict with an apply). The body
//! is read as JSON (which kube-rs sends, and which is YAML). An apply does not create an
//! object that is not there (`404`).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value, json};

use super::ApiError;

/// A field: its path in the nested form of `fieldsV1` (`f:<name>`, `k:{"type":"<t>"}`).
type Path = Vec<String>;

/// The key of the item of an associative list whose `type` is `t`.
fn item_key(t: &str) -> String {
    format!("k:{}", json!({ "type": t }))
}

/// Whether `list` is associative: every item an object with a string `type`.
fn associative(list: &[Value]) -> bool {
    !list.is_empty() && list.iter().all(|i| i["type"].is_string())
}

/// The leaf fields of `v` under `prefix`, into `out`, in the document's order.
fn leaves(v: &Value, prefix: &Path, out: &mut Vec<Path>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, child) in m {
                let mut p = prefix.clone();
                p.push(format!("f:{k}"));
                match child {
                    Value::Array(items) if associative(items) => {
                        for item in items {
                            let mut ip = p.clone();
                            ip.push(item_key(item["type"].as_str().unwrap_or_default()));
                            leaves(item, &ip, out);
                        }
                    }
                    _ => leaves(child, &p, out),
                }
            }
        }
        _ => out.push(prefix.clone()),
    }
}

/// The fields of `object` a manager applies through `subresource` (`Some("status")`, or
/// the main resource), in the document's order.
fn applied_fields(object: &Value, subresource: Option<&str>) -> Vec<Path> {
    let mut out = Vec::new();
    match subresource {
        Some(_) => leaves(&object["status"], &vec!["f:status".to_owned()], &mut out),
        None => {
            let mut scoped = object.clone();
            if let Some(m) = scoped.as_object_mut() {
                for k in ["status", "apiVersion", "kind"] {
                    m.remove(k);
                }
            }
            if let Some(meta) = scoped["metadata"].as_object_mut() {
                meta.retain(|k, _| k == "labels" || k == "annotations");
            }
            leaves(&scoped, &Vec::new(), &mut out);
        }
    }
    out
}

/// The child of `v` at path segment `seg` (a field, or an associative list's item).
fn child<'a>(v: &'a Value, seg: &str) -> Option<&'a Value> {
    if let Some(name) = seg.strip_prefix("f:") {
        return v.get(name);
    }
    let key: Value = serde_json::from_str(seg.strip_prefix("k:")?).ok()?;
    v.as_array()?.iter().find(|i| i["type"] == key["type"])
}

/// The value at `path` in `v`.
fn get<'a>(v: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(v, |at, seg| child(at, seg))
}

/// Sets the value at `path` in `v` to `value`, making the objects, lists and items on
/// the way.
fn set(v: &mut Value, path: &[String], value: Value) {
    let Some((seg, rest)) = path.split_first() else {
        *v = value;
        return;
    };
    if let Some(name) = seg.strip_prefix("f:") {
        if !v.is_object() {
            *v = Value::Object(Map::new());
        }
        let m = v.as_object_mut().expect("made an object above");
        // The next segment names an item: this field is a list.
        let next_is_item = rest.first().is_some_and(|s| s.starts_with("k:"));
        let slot = m.entry(name.to_owned()).or_insert_with(|| {
            if next_is_item {
                Value::Array(Vec::new())
            } else {
                Value::Null
            }
        });
        set(slot, rest, value);
        return;
    }
    let key: Value = seg
        .strip_prefix("k:")
        .and_then(|k| serde_json::from_str(k).ok())
        .unwrap_or(Value::Null);
    if !v.is_array() {
        *v = Value::Array(Vec::new());
    }
    let items = v.as_array_mut().expect("made a list above");
    let at = match items.iter().position(|i| i["type"] == key["type"]) {
        Some(i) => i,
        None => {
            items.push(json!({ "type": key["type"] }));
            items.len() - 1
        }
    };
    set(&mut items[at], rest, value);
}

/// Removes the field at `path` from `v`; an associative list's item left with its key
/// alone goes too, and so does an object or list left empty.
fn remove(v: &mut Value, path: &[String]) {
    let Some((seg, rest)) = path.split_first() else {
        return;
    };
    if let Some(name) = seg.strip_prefix("f:") {
        let Some(m) = v.as_object_mut() else { return };
        if rest.is_empty() {
            m.remove(name);
            return;
        }
        if let Some(c) = m.get_mut(name) {
            remove(c, rest);
            let empty = match c {
                Value::Object(o) => o.is_empty(),
                Value::Array(a) => a.is_empty(),
                _ => false,
            };
            if empty {
                m.remove(name);
            }
        }
        return;
    }
    let key: Value = seg
        .strip_prefix("k:")
        .and_then(|k| serde_json::from_str(k).ok())
        .unwrap_or(Value::Null);
    let Some(items) = v.as_array_mut() else {
        return;
    };
    if let Some(i) = items.iter().position(|i| i["type"] == key["type"]) {
        if rest.is_empty() {
            items.remove(i);
            return;
        }
        remove(&mut items[i], rest);
        let only_key = items[i]
            .as_object()
            .is_some_and(|o| o.keys().all(|k| k == "type"));
        if only_key {
            items.remove(i);
        }
    }
}

/// `fields` in the nested `fieldsV1` form (`{"f:status": {"f:conditions": {...}}}`; a
/// list item also has `".": {}`).
fn to_fields_v1(fields: &BTreeSet<Path>) -> Value {
    let mut root = Value::Object(Map::new());
    for path in fields {
        let mut at = &mut root;
        for seg in path {
            let m = at.as_object_mut().expect("only objects are made here");
            at = m.entry(seg.clone()).or_insert_with(|| json!({}));
            if seg.starts_with("k:") {
                at.as_object_mut()
                    .expect("an object")
                    .insert(".".to_owned(), json!({}));
            }
        }
    }
    root
}

/// The leaf fields of a `fieldsV1` value.
fn from_fields_v1(v: &Value, prefix: &Path, out: &mut BTreeSet<Path>) {
    let Some(m) = v.as_object() else { return };
    let children: Vec<(&String, &Value)> = m.iter().filter(|(k, _)| *k != ".").collect();
    if children.is_empty() {
        if !prefix.is_empty() {
            out.insert(prefix.clone());
        }
        return;
    }
    for (k, c) in children {
        let mut p = prefix.clone();
        p.push(k.clone());
        from_fields_v1(c, &p, out);
    }
}

/// One `managedFields` entry's owner: its manager and subresource.
type Owner = (String, String);

/// The fields each manager owns by apply, from `object`'s `metadata.managedFields`
/// (other entries are kept as they are by [`apply`]).
fn owners(object: &Value) -> BTreeMap<Owner, BTreeSet<Path>> {
    let mut out = BTreeMap::new();
    for e in object["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if e["operation"] != "Apply" {
            continue;
        }
        let owner = (
            e["manager"].as_str().unwrap_or_default().to_owned(),
            e["subresource"].as_str().unwrap_or_default().to_owned(),
        );
        let mut fields = BTreeSet::new();
        from_fields_v1(&e["fieldsV1"], &Vec::new(), &mut fields);
        out.insert(owner, fields);
    }
    out
}

/// Whether `a` and `b` overlap: one is the other or lies under it.
fn overlap(a: &Path, b: &Path) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// `current` with `applied` applied by `manager` through `subresource` (`force`: take
/// the fields another manager owns), and its `managedFields` updated; `now` is the
/// entry's time.
pub(super) fn apply(
    current: &Value,
    applied: &Value,
    manager: &str,
    force: bool,
    subresource: Option<&str>,
    now: &str,
) -> Result<Value, ApiError> {
    if manager.is_empty() {
        return Err(ApiError::new(
            400,
            "BadRequest",
            "PATCH with application/apply-patch+yaml requires a fieldManager",
        ));
    }
    let me: Owner = (
        manager.to_owned(),
        subresource.unwrap_or_default().to_owned(),
    );
    let ordered = applied_fields(applied, subresource);
    let new_fields: BTreeSet<Path> = ordered.iter().cloned().collect();
    let mut owned = owners(current);
    // Conflicts: a field another manager owns, applied with another value.
    let mut conflicts = Vec::new();
    for (owner, fields) in owned.iter_mut() {
        if *owner == me {
            continue;
        }
        let taken: Vec<Path> = fields
            .iter()
            .filter(|f| new_fields.iter().any(|n| overlap(n, f)))
            .cloned()
            .collect();
        for f in taken {
            if get(current, &f) != get(applied, &f) {
                if force {
                    fields.remove(&f);
                } else {
                    conflicts.push(format!("conflict with \"{}\": .{}", owner.0, f.join(".")));
                }
            }
        }
    }
    if !conflicts.is_empty() {
        return Err(ApiError::new(
            409,
            "Conflict",
            format!(
                "Apply failed with {} conflicts: {}",
                conflicts.len(),
                conflicts.join("; ")
            ),
        ));
    }
    let mut out = current.clone();
    // What this manager applied before and no longer does, owned by nobody else: gone.
    let before = owned.remove(&me).unwrap_or_default();
    for f in before.difference(&new_fields) {
        let shared = owned.values().any(|fs| fs.iter().any(|o| overlap(o, f)));
        if !shared {
            remove(&mut out, f);
        }
    }
    // In the applied document's order (a new list item goes at the end, as applied).
    for f in &ordered {
        set(&mut out, f, get(applied, f).cloned().unwrap_or(Value::Null));
    }
    owned.insert(me, new_fields);
    // Entries of other operations, then one per manager that owns anything by apply.
    let mut entries: Vec<Value> = current["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["operation"] != "Apply")
        .cloned()
        .collect();
    for ((manager, sub), fields) in owned {
        if fields.is_empty() {
            continue;
        }
        let mut e = json!({
            "manager": manager, "operation": "Apply",
            "apiVersion": current["apiVersion"], "time": now,
            "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(&fields),
        });
        if !sub.is_empty() {
            e["subresource"] = json!(sub);
        }
        entries.push(e);
    }
    out["metadata"]["managedFields"] = Value::Array(entries);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The types of `w`'s conditions, in order.
    fn types(w: &Value) -> Vec<&str> {
        w["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["type"].as_str())
            .collect()
    }

    fn condition(t: &str, status: &str) -> Value {
        json!({"type": t, "status": status, "reason": "R", "message": "", "lastTransitionTime": "t"})
    }

    /// Two managers apply conditions of one status: each owns its items; a manager that
    /// stops applying a field removes it (one owned also by another stays); another
    /// manager's field with another value is a conflict, taken with `force`.
    #[test]
    fn managers_own_what_they_apply() {
        let wl = json!({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": "w"}, "spec": {"x": 1}});
        let kueue = json!({"status": {"admission": {"clusterQueue": "cq"},
            "conditions": [condition("QuotaReserved", "True"), condition("Admitted", "True")]}});
        let w = apply(&wl, &kueue, "kueue-admission", false, Some("status"), "t").unwrap();
        assert_eq!(w["status"]["admission"]["clusterQueue"], "cq");
        assert_eq!(w["spec"]["x"], 1, "a status apply leaves the spec");
        let edl = json!({"status": {"conditions": [condition("PodsReady", "True")]}});
        let w = apply(&w, &edl, "edl-operator", false, Some("status"), "t").unwrap();
        assert_eq!(types(&w), ["QuotaReserved", "Admitted", "PodsReady"]);
        let entries = w["metadata"]["managedFields"].as_array().unwrap();
        assert_eq!(entries.len(), 2, "{entries:?}");
        let edl_entry = entries
            .iter()
            .find(|e| e["manager"] == "edl-operator")
            .unwrap();
        assert_eq!(edl_entry["subresource"], "status");
        assert!(
            edl_entry["fieldsV1"]["f:status"]["f:conditions"]
                .get(item_key("PodsReady"))
                .is_some(),
            "{edl_entry}"
        );
        // edl's apply of Kueue's condition with another value: a conflict naming it.
        let grab = json!({"status": {"conditions": [condition("Admitted", "False")]}});
        let e = apply(&w, &grab, "edl-operator", false, Some("status"), "t").unwrap_err();
        assert_eq!(e.code, 409);
        assert!(e.message.contains("kueue-admission"), "{}", e.message);
        // Kueue's manager applying without the admission (its eviction): gone; its
        // conditions as applied; edl's stays.
        let released = json!({"status": {"conditions": [
            condition("QuotaReserved", "False"), condition("Admitted", "False")]}});
        let w = apply(&w, &released, "kueue-admission", true, Some("status"), "t").unwrap();
        assert!(w["status"]["admission"].is_null(), "{w}");
        assert_eq!(
            get(
                &w,
                &[
                    "f:status".into(),
                    "f:conditions".into(),
                    item_key("Admitted"),
                    "f:status".into()
                ]
            )
            .unwrap(),
            "False"
        );
        assert!(
            w["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["type"] == "PodsReady")
        );
        // edl no longer applying PodsReady: gone.
        let w = apply(
            &w,
            &json!({"status": {"conditions": [condition("Finished", "True")]}}),
            "edl-operator",
            false,
            Some("status"),
            "t",
        )
        .unwrap();
        assert_eq!(types(&w), ["QuotaReserved", "Admitted", "Finished"]);
        // Without a manager: refused.
        assert_eq!(
            apply(&w, &edl, "", false, Some("status"), "t")
                .unwrap_err()
                .code,
            400
        );
    }
}
