//! RBAC authorization from the stored Roles, ClusterRoles, RoleBindings and
//! ClusterRoleBindings (<https://kubernetes.io/docs/reference/access-authn-authz/rbac/>),
//! for the users a test names ([`super::FakeApi::enforce_rbac`]): a request of such a
//! user that no rule bound to it allows is `403 Forbidden`, worded as the real
//! authorizer words it. Everyone else is let through (a test's own client is an admin).
//!
//! Rules: `apiGroups`, `resources` (`resource/subresource` for a subresource) and
//! `verbs`, each matching exactly or by `*`; `resourceNames`, when given, allow only
//! requests naming one of them (so never a list, a watch or a create). A ClusterRole
//! bound by a ClusterRoleBinding applies everywhere; a Role or ClusterRole bound by a
//! RoleBinding applies in that binding's namespace only. Subjects: `User` by name, and
//! `ServiceAccount` as the user `system:serviceaccount:<namespace>:<name>`.
//!
//! Not covered: groups (`system:serviceaccounts`, `system:authenticated`), aggregated
//! ClusterRoles, `nonResourceURLs`, and the escalation checks on writing RBAC objects.

use serde_json::Value;

use super::Access;
use super::store::Store;

/// Whether a binding's `subjects` name `user`.
fn binds(binding: &Value, user: &str) -> bool {
    binding["subjects"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|s| match s["kind"].as_str() {
            Some("User") => s["name"] == user,
            Some("ServiceAccount") => {
                let (ns, name) = (
                    s["namespace"].as_str().unwrap_or_default(),
                    s["name"].as_str().unwrap_or_default(),
                );
                user == format!("system:serviceaccount:{ns}:{name}")
            }
            _ => false,
        })
}

/// Whether `rule` allows `access`.
fn allows(rule: &Value, access: &Access) -> bool {
    let has = |key: &str, want: &str| {
        rule[key]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .any(|v| v == "*" || v == want)
    };
    let resource = match &access.subresource {
        Some(sub) => format!("{}/{sub}", access.resource),
        None => access.resource.to_owned(),
    };
    let names: Vec<&str> = rule["resourceNames"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let named = names.is_empty() || access.name.as_deref().is_some_and(|n| names.contains(&n));
    has("apiGroups", access.group)
        && has("resources", &resource)
        && has("verbs", access.verb)
        && named
}

/// The rules of the role `binding` refers to (`Role` in `namespace`, or `ClusterRole`).
fn rules_of<'a>(store: &'a Store, binding: &Value, namespace: &str) -> Vec<&'a Value> {
    let (kind, name) = (
        binding["roleRef"]["kind"].as_str().unwrap_or_default(),
        binding["roleRef"]["name"].as_str().unwrap_or_default(),
    );
    let (plural, ns) = match kind {
        "ClusterRole" => ("clusterroles", ""),
        "Role" => ("roles", namespace),
        _ => return Vec::new(),
    };
    store
        .get_by_plural(plural, ns, name)
        .and_then(|r| r["rules"].as_array())
        .map(|rules| rules.iter().collect())
        .unwrap_or_default()
}

/// Whether the stored RBAC objects allow `user` the `access`.
pub(super) fn authorized(store: &Store, user: &str, access: &Access) -> bool {
    let cluster = store
        .list_by_plural("clusterrolebindings", "")
        .into_iter()
        .filter(|b| binds(b, user))
        .flat_map(|b| rules_of(store, b, ""));
    let local: Vec<&Value> = if access.namespace.is_empty() {
        Vec::new()
    } else {
        store
            .list_by_plural("rolebindings", &access.namespace)
            .into_iter()
            .filter(|b| binds(b, user))
            .flat_map(|b| rules_of(store, b, &access.namespace))
            .collect()
    };
    cluster.chain(local).any(|r| allows(r, access))
}

/// The refusal of `access` to `user`, as the real authorizer words it.
pub(super) fn forbidden_message(user: &str, access: &Access) -> String {
    let what = match &access.name {
        Some(n) => format!("{} {n:?}", access.resource),
        None => access.resource.to_owned(),
    };
    let resource = match &access.subresource {
        Some(sub) => format!("{}/{sub}", access.resource),
        None => access.resource.to_owned(),
    };
    let scope = if access.namespace.is_empty() {
        "at the cluster scope".to_owned()
    } else {
        format!("in the namespace {:?}", access.namespace)
    };
    format!(
        "{what} is forbidden: User {user:?} cannot {} resource {resource:?} in API group {:?} {scope}",
        access.verb, access.group
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn access(verb: &'static str, resource: &'static str, name: Option<&str>, ns: &str) -> Access {
        Access {
            verb,
            group: "",
            resource,
            subresource: None,
            name: name.map(str::to_owned),
            user: None,
            namespace: ns.to_owned(),
        }
    }

    #[test]
    fn rules_match_verbs_resources_names_and_subjects() {
        let rule = json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]});
        assert!(allows(&rule, &access("list", "secrets", None, "ml")));
        assert!(!allows(&rule, &access("create", "secrets", None, "ml")));
        assert!(!allows(&rule, &access("list", "pods", None, "ml")));
        let named = json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
                           "resourceNames": ["a"]});
        assert!(allows(&named, &access("get", "secrets", Some("a"), "ml")));
        assert!(!allows(&named, &access("get", "secrets", Some("b"), "ml")));
        let mut evict = access("create", "pods", Some("p"), "ml");
        evict.subresource = Some("eviction".to_owned());
        let sub = json!({"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["*"]});
        assert!(allows(&sub, &evict));
        assert!(!allows(&rule, &evict));
        let binding =
            json!({"subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "sys"}]});
        assert!(binds(&binding, "system:serviceaccount:sys:op"));
        assert!(!binds(&binding, "system:serviceaccount:other:op"));
        assert_eq!(
            forbidden_message("u", &access("list", "secrets", None, "ml")),
            "secrets is forbidden: User \"u\" cannot list resource \"secrets\" in API group \"\" in the namespace \"ml\""
        );
    }
}
