//! What each role's container asks the scheduler for: the job's `resources`, with every
//! request it does not give filled in, so no pod is best-effort (the first a node under
//! pressure evicts) and every pod counts what it uses in a quota or a node's capacity.

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::Role;

/// The CPU and memory a role requests when its `resources` name neither a request nor
/// a limit of them: about what it uses on the examples (docs/kubernetes.md, "Resources").
pub fn default_requests(role: Role) -> [(&'static str, &'static str); 2] {
    match role {
        Role::Master => [("cpu", "250m"), ("memory", "256Mi")],
        Role::Pserver => [("cpu", "500m"), ("memory", "512Mi")],
        Role::Trainer => [("cpu", "1"), ("memory", "1Gi")],
        Role::Etcd => [("cpu", "100m"), ("memory", "256Mi")],
    }
}

/// `given` (a role's `resources`) with its requests filled in: a resource with a limit
/// and no request requests its limit (as the API server would make it), and CPU and
/// memory with neither request [`default_requests`]. Limits are left as given.
pub fn with_requests(role: Role, given: Option<ResourceRequirements>) -> ResourceRequirements {
    let mut r = given.unwrap_or_default();
    let mut requests = r.requests.take().unwrap_or_default();
    for (name, limit) in r.limits.iter().flatten() {
        requests
            .entry(name.clone())
            .or_insert_with(|| limit.clone());
    }
    for (name, value) in default_requests(role) {
        requests
            .entry(name.to_owned())
            .or_insert_with(|| Quantity(value.to_owned()));
    }
    r.requests = Some(requests);
    r
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn list(pairs: &[(&str, &str)]) -> Option<BTreeMap<String, Quantity>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
                .collect(),
        )
    }

    #[test]
    fn requests_come_from_the_job_then_its_limits_then_the_roles_defaults() {
        let none = with_requests(Role::Trainer, None);
        assert_eq!(none.requests, list(&[("cpu", "1"), ("memory", "1Gi")]));
        assert_eq!(none.limits, None, "no limit is made up");
        let given = with_requests(
            Role::Pserver,
            Some(ResourceRequirements {
                requests: list(&[("cpu", "2")]),
                limits: list(&[("cpu", "4"), ("memory", "8Gi"), ("nvidia.com/gpu", "1")]),
                ..ResourceRequirements::default()
            }),
        );
        assert_eq!(
            given.requests,
            list(&[("cpu", "2"), ("memory", "8Gi"), ("nvidia.com/gpu", "1")]),
            "a request given stays; a limit without a request is requested"
        );
        assert_eq!(
            given.limits,
            list(&[("cpu", "4"), ("memory", "8Gi"), ("nvidia.com/gpu", "1")])
        );
        for role in [Role::Master, Role::Pserver, Role::Trainer, Role::Etcd] {
            let r = with_requests(role, None).requests.unwrap_or_default();
            assert!(
                r.contains_key("cpu") && r.contains_key("memory"),
                "{role:?}"
            );
        }
    }

    /// Every pod of a job (each role, the managed etcd's too): CPU and memory requested,
    /// a read-only root filesystem, and its scratch space an emptyDir at /tmp.
    #[test]
    fn every_job_pod_requests_cpu_and_memory_and_writes_only_to_its_volumes() {
        use crate::objects::{CredentialsRef, Slot, TMP_MOUNT, pod, test_job};
        let mut tj = test_job();
        tj.spec.etcd.managed = true;
        for role in [Role::Master, Role::Pserver, Role::Trainer, Role::Etcd] {
            let p = pod(&tj, Slot { role, index: 0 }, CredentialsRef::None);
            let spec = p.spec.expect("spec");
            let c = &spec.containers[0];
            let requests = c
                .resources
                .as_ref()
                .and_then(|r| r.requests.clone())
                .unwrap_or_default();
            for (name, value) in default_requests(role) {
                assert_eq!(
                    requests.get(name).map(|q| q.0.as_str()),
                    Some(value),
                    "{role:?} {name}"
                );
            }
            let sc = c.security_context.as_ref().expect("a security context");
            assert_eq!(sc.read_only_root_filesystem, Some(true), "{role:?}");
            let tmp = c
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| m.mount_path == TMP_MOUNT)
                .unwrap_or_else(|| panic!("{role:?}: nothing mounted at /tmp"));
            let volume = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == tmp.name)
                .expect("its volume");
            assert!(volume.empty_dir.is_some(), "{role:?}: {volume:?}");
            assert!(
                c.env
                    .iter()
                    .flatten()
                    .any(|e| e.name == "TMPDIR" && e.value.as_deref() == Some(TMP_MOUNT)),
                "{role:?}"
            );
        }
    }
}
