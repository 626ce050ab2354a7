//! How the controller runs: namespace, resync, etcd admin credentials and timeouts,
//! event reporter, Kueue, and how it resolves cluster addresses.

use std::sync::Arc;
use std::time::Duration;

/// How the controller runs.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Only this namespace (default: all).
    pub namespace: Option<String>,
    /// How often a job is reconciled without a change (its progress in etcd).
    pub resync: Duration,
    /// etcd user and password for the jobs' etcd, if it needs them. Given, the user must
    /// be one that may manage users (`root`): each job on a shared etcd gets its own
    /// user and role, in the Secret `<job>-edl-credentials`.
    pub etcd_auth: Option<edl_coord::EtcdAuth>,
    /// How long one etcd request of the operator may take.
    pub etcd_timeout: Duration,
    /// The name events are reported under (`reportingInstance`).
    pub instance: String,
    /// The operator's own namespace: each job's NetworkPolicy admits the operator's pods
    /// from it.
    pub operator_namespace: String,
    /// Admit jobs that name a Kueue LocalQueue (label `kueue.x-k8s.io/queue-name`)
    /// through a Kueue Workload each: such a job runs only while Kueue admits it.
    /// Off: the label is only copied to the job's objects (Kueue's pod integration).
    pub kueue: bool,
    /// How the operator reaches an address inside the cluster (a managed etcd member's
    /// DNS name): as it is on a cluster; the stand-in's test kubelet maps pod addresses
    /// to this host's ports.
    pub resolve: Resolve,
}

/// A map of cluster addresses (in URLs) to the addresses the operator dials.
#[derive(Clone)]
pub struct Resolve(pub Arc<dyn Fn(&str) -> String + Send + Sync>);

impl Default for Resolve {
    fn default() -> Self {
        Resolve(Arc::new(str::to_owned))
    }
}

impl std::fmt::Debug for Resolve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolve")
    }
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            namespace: None,
            resync: Duration::from_secs(5),
            etcd_auth: None,
            etcd_timeout: Duration::from_secs(3),
            instance: "edl-operator".to_owned(),
            operator_namespace: "edl-system".to_owned(),
            resolve: Resolve::default(),
            kueue: false,
        }
    }
}
