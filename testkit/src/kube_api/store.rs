//! The fake API server's object store: objects by type, namespace and name, one
//! resourceVersion counter, the retained event log that watches resume from, and the
//! write rules (generation, finalizers, graceful pod deletion, owner references, a
//! Secret's `stringData`, `type` and `immutable`).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::{ApiError, ResourceType, rfc3339};

/// `(type index, namespace, name)`.
pub(super) type Key = (usize, String, String);

#[derive(Debug, Clone)]
pub(super) struct WatchEvent {
    pub(super) rv: u64,
    pub(super) type_index: usize,
    pub(super) namespace: String,
    pub(super) kind: &'static str,
    pub(super) object: Value,
}

#[derive(Debug)]
pub(super) struct Store {
    pub(super) types: Vec<ResourceType>,
    pub(super) rv: u64,
    pub(super) uid: u64,
    pub(super) objects: BTreeMap<Key, Value>,
    pub(super) log: VecDeque<WatchEvent>,
    /// How many events are kept for watches to resume from.
    pub(super) window: usize,
    /// Watches may resume from resourceVersions at or after this.
    pub(super) oldest: u64,
    /// Per type index, fields (paths of keys) the server drops from every object it
    /// stores, as an API server drops what its CRD's structural schema lacks.
    pub(super) pruned: BTreeMap<usize, Vec<Vec<String>>>,
}

impl Store {
    /// Drops the pruned fields of type `t` from `obj`.
    fn prune(&self, t: usize, obj: &mut Value) {
        for path in self.pruned.get(&t).into_iter().flatten() {
            let Some((last, parents)) = path.split_last() else {
                continue;
            };
            let mut at = &mut *obj;
            for p in parents {
                at = &mut at[p.as_str()];
            }
            if let Some(o) = at.as_object_mut() {
                o.remove(last);
            }
        }
    }
}

pub(super) fn now_rfc3339() -> String {
    rfc3339(std::time::SystemTime::now())
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (_, Some(p)) => {
            *target = Value::Object(serde_json::Map::new());
            merge_patch(target, &Value::Object(p.clone()));
        }
        _ => *target = patch.clone(),
    }
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (RFC 4648), as the API server writes a Secret's `data`.
pub fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(BASE64[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The bytes of standard, padded base64 (`None`: not base64).
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if !text.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    for (q, chunk) in text.chunks(4).enumerate() {
        let last = q == text.len() / 4 - 1;
        let pad = chunk.iter().rev().take_while(|c| **c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            let v = if i >= 4 - pad {
                0
            } else {
                BASE64.iter().position(|b| b == c)? as u32
            };
            n |= v << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    Some(out)
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(422, "Invalid", message)
}

/// A core `v1` Secret as the API server stores it: `stringData` merged into `data`
/// (base64) and dropped, `data` values checked to be base64, `type` defaulted to
/// `Opaque`; on an update (`old`), `type` cannot change, nor the data of an `immutable`
/// Secret.
pub(super) fn secret_rules(obj: &mut Value, old: Option<&Value>) -> Result<(), ApiError> {
    if let Some(string_data) = obj
        .as_object_mut()
        .and_then(|o| o.remove("stringData"))
        .filter(|v| !v.is_null())
    {
        let Some(entries) = string_data.as_object() else {
            return Err(invalid("stringData: must be a map of strings"));
        };
        if !obj["data"].is_object() {
            obj["data"] = json!({});
        }
        for (k, v) in entries {
            let Some(v) = v.as_str() else {
                return Err(invalid(format!("stringData[{k}]: must be a string")));
            };
            obj["data"][k] = json!(base64_encode(v.as_bytes()));
        }
    }
    if let Some(data) = obj["data"].as_object() {
        for (k, v) in data {
            if v.as_str().and_then(base64_decode).is_none() {
                return Err(invalid(format!("data[{k}]: illegal base64 data")));
            }
        }
    }
    if obj["type"].as_str().is_none_or(str::is_empty) {
        obj["type"] = match old {
            Some(o) => o["type"].clone(),
            None => json!("Opaque"),
        };
    }
    if let Some(old) = old {
        if obj["type"] != old["type"] {
            return Err(invalid("type: Invalid value: field is immutable"));
        }
        if old["immutable"] == json!(true)
            && (obj["data"] != old["data"] || obj["immutable"] != json!(true))
        {
            return Err(invalid(
                "data: Forbidden: field is immutable when `immutable` is set",
            ));
        }
    }
    Ok(())
}

pub(super) fn at_path<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

pub(super) fn set_path(v: &mut Value, path: &str, value: Value) {
    let mut cur = v;
    let keys: Vec<&str> = path.split('.').collect();
    for k in &keys[..keys.len() - 1] {
        if !cur.get(*k).is_some_and(Value::is_object) {
            cur[*k] = json!({});
        }
        cur = &mut cur[*k];
    }
    cur[keys[keys.len() - 1]] = value;
}

pub(super) fn labels_match(obj: &Value, selector: &str) -> bool {
    let labels = obj["metadata"]["labels"].as_object();
    let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    selector
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .all(|term| {
            if let Some((k, v)) = term.split_once("!=") {
                label(k.trim()) != Some(v.trim())
            } else if let Some((k, v)) = term.split_once('=') {
                label(k.trim().trim_end_matches('=')) == Some(v.trim())
            } else if let Some(k) = term.strip_prefix('!') {
                label(k.trim()).is_none()
            } else {
                label(term).is_some()
            }
        })
}

pub(super) fn fields_match(obj: &Value, selector: &str) -> bool {
    selector
        .split(',')
        .filter(|t| !t.is_empty())
        .all(|term| match term.split_once('=') {
            Some((k, v)) => {
                let v = v.trim_start_matches('=');
                at_path(obj, k).and_then(Value::as_str) == Some(v)
            }
            None => true,
        })
}

/// The parts of `obj` that count for its `generation`.
fn spec_part(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    o
}

impl Store {
    /// The object `name` of the type served as `plural`, in `namespace` (`""`:
    /// cluster-wide), if stored.
    pub(super) fn get_by_plural(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
    ) -> Option<&Value> {
        let t = self.types.iter().position(|t| t.plural == plural)?;
        self.objects
            .get(&(t, namespace.to_owned(), name.to_owned()))
    }

    /// The objects of the type served as `plural` in `namespace` (`""`: cluster-wide).
    pub(super) fn list_by_plural(&self, plural: &str, namespace: &str) -> Vec<&Value> {
        let Some(t) = self.types.iter().position(|t| t.plural == plural) else {
            return Vec::new();
        };
        self.objects
            .iter()
            .filter(|((ty, ns, _), _)| *ty == t && ns == namespace)
            .map(|(_, o)| o)
            .collect()
    }

    pub(super) fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    pub(super) fn record(
        &mut self,
        key: &Key,
        kind: &'static str,
        object: Value,
        tx: &broadcast::Sender<WatchEvent>,
    ) {
        let ev = WatchEvent {
            rv: self.rv,
            type_index: key.0,
            namespace: key.1.clone(),
            kind,
            object,
        };
        self.log.push_back(ev.clone());
        while self.log.len() > self.window {
            if let Some(old) = self.log.pop_front() {
                self.oldest = old.rv;
            }
        }
        let _ = tx.send(ev);
    }

    pub(super) fn create(
        &mut self,
        t: usize,
        ns: &str,
        mut obj: Value,
        tx: &broadcast::Sender<WatchEvent>,
    ) -> Result<Value, ApiError> {
        let ty = self.types[t].clone();
        if !obj.is_object() {
            return Err(ApiError::new(
                400,
                "BadRequest",
                "the body is not an object",
            ));
        }
        let mut name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if name.is_empty() {
            let Some(prefix) = obj["metadata"]["generateName"].as_str() else {
                return Err(ApiError::new(
                    422,
                    "Invalid",
                    "metadata.name: Required value",
                ));
            };
            name = format!("{prefix}{:05x}", self.uid + 1);
        }
        let key = (t, ns.to_owned(), name.clone());
        if ty.is_secret() {
            secret_rules(&mut obj, None)?;
        }
        if self.objects.contains_key(&key) {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", ty.plural),
            ));
        }
        self.uid += 1;
        let rv = self.bump();
        obj["apiVersion"] = json!(ty.api_version());
        obj["kind"] = json!(ty.kind);
        let m = &mut obj["metadata"];
        m["name"] = json!(name);
        if ty.namespaced {
            m["namespace"] = json!(ns);
        }
        m["uid"] = json!(format!("00000000-0000-4000-8000-{:012x}", self.uid));
        m["resourceVersion"] = json!(rv.to_string());
        m["creationTimestamp"] = json!(now_rfc3339());
        m["generation"] = json!(1);
        if let Some(mm) = m.as_object_mut() {
            mm.remove("deletionTimestamp");
        }
        if ty.status
            && let Some(o) = obj.as_object_mut()
        {
            o.remove("status");
        }
        if ty.is_claim() {
            // As the PVC protection admission plugin does.
            let finalizers = obj["metadata"]["finalizers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if !finalizers.iter().any(|f| f == PVC_PROTECTION) {
                let mut finalizers = finalizers;
                finalizers.push(json!(PVC_PROTECTION));
                obj["metadata"]["finalizers"] = json!(finalizers);
            }
        }
        self.prune(t, &mut obj);
        self.objects.insert(key.clone(), obj.clone());
        self.record(&key, "ADDED", obj.clone(), tx);
        Ok(obj)
    }

    /// The PVC protection controller: each claim of `ns` being deleted that no pod uses
    /// any more (a pod that has not ended and mounts it) loses [`PVC_PROTECTION`], and
    /// so goes (with nothing else holding it).
    fn release_unused_claims(&mut self, ns: &str, tx: &broadcast::Sender<WatchEvent>) {
        let Some(claims) = self.types.iter().position(ResourceType::is_claim) else {
            return;
        };
        let pods = self
            .types
            .iter()
            .position(|t| t.plural == "pods" && t.group.is_empty());
        let in_use: BTreeSet<String> = self
            .objects
            .iter()
            .filter(|((t, o_ns, _), p)| Some(*t) == pods && o_ns == ns && !ended(p))
            .flat_map(|(_, p)| {
                p["spec"]["volumes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v["persistentVolumeClaim"]["claimName"].as_str())
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect();
        let releasable: Vec<(Key, Value)> = self
            .objects
            .iter()
            .filter(|((t, o_ns, name), c)| {
                *t == claims
                    && o_ns == ns
                    && !c["metadata"]["deletionTimestamp"].is_null()
                    && !in_use.contains(name)
                    && c["metadata"]["finalizers"]
                        .as_array()
                        .is_some_and(|f| f.iter().any(|f| f == PVC_PROTECTION))
            })
            .map(|(k, c)| (k.clone(), c.clone()))
            .collect();
        for (key, mut claim) in releasable {
            if let Some(f) = claim["metadata"]["finalizers"].as_array_mut() {
                f.retain(|f| f != PVC_PROTECTION);
            }
            self.write(&key, claim, tx);
        }
    }

    /// Writes `new` over the object at `key` (already checked and merged), removing it if
    /// it is being deleted and has no finalizers left.
    pub(super) fn write(
        &mut self,
        key: &Key,
        mut new: Value,
        tx: &broadcast::Sender<WatchEvent>,
    ) -> Value {
        self.prune(key.0, &mut new);
        let old = self.objects.get(key).cloned().unwrap_or(Value::Null);
        if spec_part(&old) != spec_part(&new) {
            let g = old["metadata"]["generation"].as_i64().unwrap_or(1);
            new["metadata"]["generation"] = json!(g + 1);
        }
        let rv = self.bump();
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        let has_finalizers = |o: &Value| {
            o["metadata"]["finalizers"]
                .as_array()
                .is_some_and(|f| !f.is_empty())
        };
        // The last finalizer of an object being deleted went: it goes (a pod still in
        // its grace period waits for its kubelet's final delete).
        let graceful_pod = new["metadata"]["deletionGracePeriodSeconds"]
            .as_i64()
            .is_some_and(|g| g > 0);
        if !new["metadata"]["deletionTimestamp"].is_null()
            && has_finalizers(&old)
            && !has_finalizers(&new)
            && !graceful_pod
        {
            return self.remove(key, new, tx);
        }
        self.objects.insert(key.clone(), new.clone());
        self.record(key, "MODIFIED", new.clone(), tx);
        if self.types[key.0].plural == "pods" && ended(&new) && !ended(&old) {
            self.release_unused_claims(&key.1, tx);
        }
        new
    }

    pub(super) fn remove(
        &mut self,
        key: &Key,
        obj: Value,
        tx: &broadcast::Sender<WatchEvent>,
    ) -> Value {
        self.objects.remove(key);
        self.record(key, "DELETED", obj.clone(), tx);
        if self.types[key.0].plural == "pods" {
            self.release_unused_claims(&key.1, tx);
        }
        // Background propagation: the dependents go too.
        if let Some(uid) = obj["metadata"]["uid"].as_str() {
            let dependents: Vec<Key> = self
                .objects
                .iter()
                .filter(|(_, o)| {
                    o["metadata"]["ownerReferences"]
                        .as_array()
                        .is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid))
                })
                .map(|(k, _)| k.clone())
                .collect();
            for d in dependents {
                let _ = self.delete(&d, None, tx);
            }
        }
        obj
    }

    pub(super) fn delete(
        &mut self,
        key: &Key,
        grace: Option<i64>,
        tx: &broadcast::Sender<WatchEvent>,
    ) -> Result<Value, ApiError> {
        let Some(obj) = self.objects.get(key).cloned() else {
            return Err(not_found(&self.types[key.0], &key.2));
        };
        let is_pod = self.types[key.0].plural == "pods" && self.types[key.0].group.is_empty();
        let grace = if is_pod {
            grace
                .or_else(|| obj["spec"]["terminationGracePeriodSeconds"].as_i64())
                .unwrap_or(30)
        } else {
            0
        };
        let has_finalizers = obj["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if !has_finalizers && grace == 0 {
            self.bump();
            return Ok(self.remove(key, obj, tx));
        }
        if !obj["metadata"]["deletionTimestamp"].is_null() {
            return Ok(obj);
        }
        let mut new = obj;
        new["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
        if is_pod {
            new["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
        }
        let rv = self.bump();
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.objects.insert(key.clone(), new.clone());
        self.record(key, "MODIFIED", new.clone(), tx);
        if self.types[key.0].is_claim() {
            self.release_unused_claims(&key.1, tx);
            return Ok(self.objects.get(key).cloned().unwrap_or(new));
        }
        Ok(new)
    }
}

/// The finalizer that keeps a claim a pod uses until no pod does.
pub(super) const PVC_PROTECTION: &str = "kubernetes.io/pvc-protection";

/// Whether pod `p` has ended.
fn ended(p: &Value) -> bool {
    matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
}

pub(super) fn not_found(ty: &ResourceType, name: &str) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("{} \"{name}\" not found", ty.plural),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_rfc_4648() {
        for (plain, coded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64_encode(plain.as_bytes()), coded);
            assert_eq!(base64_decode(coded).as_deref(), Some(plain.as_bytes()));
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(base64_decode(&base64_encode(&all)), Some(all));
        for bad in ["Zg", "Zg=a", "Z===", "Zg==Zg==", "not base64!", "Zm9v\n"] {
            assert_eq!(base64_decode(bad), None, "{bad:?}");
        }
    }
}
