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
    /// The client URLs of the shared etcd that `etcd_auth` is for: the operator sends its
    /// credentials to these only. A job on a shared etcd whose `etcd.endpoints` names any
    /// other is refused (its `EtcdReachable` condition and an Event say why) and nothing
    /// is sent there; a TrainingJob names its endpoints, so anyone who may create one
    /// could otherwise collect the credentials with a listener of their own. Unused
    /// without `etcd_auth` (the operator then logs in nowhere).
    pub etcd_endpoints: Vec<String>,
    /// TLS to the shared etcd (its CA; a client certificate if it asks for one): the
    /// operator's own connection. The jobs' pods get theirs from `etcd.tls`.
    pub etcd_tls: Option<edl_coord::EtcdTls>,
    /// How long one etcd request of the operator may take.
    pub etcd_timeout: Duration,
    /// The name events are reported under (`reportingInstance`).
    pub instance: String,
    /// What each job's NetworkPolicy lets through besides the job's own pods: the
    /// operator's (from its namespace), scrapes, and where the job's pods may connect.
    pub network: crate::objects::JobNetwork,
    /// Admit jobs that name a Kueue LocalQueue (label `kueue.x-k8s.io/queue-name`)
    /// through a Kueue Workload each: such a job runs only while Kueue admits it.
    /// Off: the label is only copied to the job's objects (Kueue's pod integration).
    pub kueue: bool,
    /// How long a node may be not Ready before the job pods bound to it are deleted at
    /// once (grace 0) and made again elsewhere, instead of waiting for the cluster
    /// (which evicts them after its own toleration, 5 minutes by default, and then
    /// leaves them terminating until the node answers or a person removes them).
    pub node_lost_after: Duration,
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
            etcd_endpoints: Vec::new(),
            etcd_tls: None,
            etcd_timeout: Duration::from_secs(3),
            instance: "edl-operator".to_owned(),
            node_lost_after: Duration::from_secs(120),
            network: crate::objects::JobNetwork::default(),
            resolve: Resolve::default(),
            kueue: false,
        }
    }
}

/// Whether `named` (a TrainingJob's `etcd.endpoints`) are all among `allowed` (the
/// operator's `etcd_endpoints`), and if not why: the error names the first unlisted
/// endpoint and says what to do. URLs compare without case and without a trailing `/`.
pub(crate) fn check_endpoints(named: &[String], allowed: &[String]) -> Result<(), String> {
    let norm = |u: &str| u.trim().trim_end_matches('/').to_ascii_lowercase();
    let allowed_norm: Vec<String> = allowed.iter().map(|a| norm(a)).collect();
    match named.iter().find(|n| !allowed_norm.contains(&norm(n))) {
        None => Ok(()),
        Some(_) if allowed.is_empty() => Err(format!(
            "etcd.endpoints {}: the operator has admin credentials for a shared etcd but \
             no --etcd-endpoints naming where they belong, so it sends them nowhere (give \
             the operator --etcd-endpoints, or EDL_ETCD_ENDPOINTS in the Secret \
             edl-etcd-admin, or use etcd.managed)",
            named.join(",")
        )),
        Some(n) => Err(format!(
            "etcd.endpoints names {n}, which is not one of the operator's --etcd-endpoints \
             ({}): the operator sends its etcd credentials only there (name those \
             endpoints, ask the cluster's admin to add this one, or use etcd.managed)",
            allowed.join(",")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::check_endpoints;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| (*x).to_owned()).collect()
    }

    #[test]
    fn only_listed_endpoints_pass() {
        let allowed = v(&["http://etcd-0.etcd:2379", "https://etcd-1.etcd:2379/"]);
        assert_eq!(
            check_endpoints(&v(&["http://etcd-0.etcd:2379"]), &allowed),
            Ok(())
        );
        assert_eq!(
            check_endpoints(
                &v(&["HTTPS://etcd-1.etcd:2379", "http://etcd-0.etcd:2379/"]),
                &allowed
            ),
            Ok(()),
            "case and a trailing slash do not matter"
        );
        let e = check_endpoints(
            &v(&["http://etcd-0.etcd:2379", "http://evil.example:2379"]),
            &allowed,
        )
        .expect_err("one unlisted endpoint refuses the job");
        assert!(
            e.contains("names http://evil.example:2379") && e.contains("--etcd-endpoints"),
            "{e}"
        );
        let e = check_endpoints(&v(&["http://etcd-0.etcd:2380"]), &allowed)
            .expect_err("another port is another endpoint");
        assert!(e.contains("etcd-0.etcd:2380"), "{e}");
        let e = check_endpoints(&v(&["http://etcd-0.etcd:2379"]), &[])
            .expect_err("no list: nothing is allowed");
        assert!(e.contains("no --etcd-endpoints"), "{e}");
    }
}
