//! A job's NetworkPolicy: everything its pods send or take is denied but what it names.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer,
    NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{JOB_LABEL, METRICS_PORT, meta};
use crate::crd::TrainingJob;

/// The label of the operator's own pods (`deploy/operator.yaml`).
pub const OPERATOR_LABEL: (&str, &str) = ("app.kubernetes.io/name", "edl-operator");

/// The cluster DNS a job's pods may ask: pods labelled `k8s-app=kube-dns` in
/// `kube-system` (kube-dns, and CoreDNS as kubeadm, EKS, GKE and AKS deploy it).
pub const DNS: (&str, (&str, &str)) = ("kube-system", ("k8s-app", "kube-dns"));

/// The label every namespace carries with its own name.
const NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";

/// Where a job's pods may connect and who may connect to them, besides one another: the
/// cluster admin's choice, one for all jobs (the operator's configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobNetwork {
    /// The operator's own namespace: its pods (labelled [`OPERATOR_LABEL`]) reach every
    /// port of a job's pods (they ask the master and the managed etcd).
    pub operator_namespace: String,
    /// The namespaces whose pods may scrape the job's metrics port ([`METRICS_PORT`]):
    /// where the cluster's Prometheus runs. None: the operator's pods only.
    pub metrics_namespaces: Vec<String>,
    /// Namespaces the job's pods may connect to, on any port: where a shared etcd or an
    /// object store runs inside the cluster.
    pub egress_namespaces: Vec<String>,
    /// Addresses outside the cluster (CIDRs) the job's pods may connect to, on any port:
    /// a shared etcd or an object store outside it, a NodeLocal DNS cache.
    pub egress_cidrs: Vec<String>,
}

impl Default for JobNetwork {
    fn default() -> Self {
        JobNetwork {
            operator_namespace: "edl-system".to_owned(),
            metrics_namespaces: Vec::new(),
            egress_namespaces: Vec::new(),
            egress_cidrs: Vec::new(),
        }
    }
}

impl JobNetwork {
    /// `Err` naming the first entry a cluster would refuse or that means something else
    /// than it seems: a CIDR that does not parse, or one with host bits set.
    pub fn check(&self) -> Result<(), String> {
        for c in &self.egress_cidrs {
            check_cidr(c)?;
        }
        Ok(())
    }
}

/// Whether `c` is an IPv4 or IPv6 network in CIDR notation with no host bits set, as the
/// API server requires of an `ipBlock`.
fn check_cidr(c: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "egress CIDR {c:?}: {why} (give networks like 10.20.0.0/16 or 2001:db8::/32)"
        ))
    };
    let Some((addr, prefix)) = c.split_once('/') else {
        return bad("no /prefix");
    };
    let Ok(addr) = addr.parse::<std::net::IpAddr>() else {
        return bad("not an IP address");
    };
    let bits: u32 = if addr.is_ipv4() { 32 } else { 128 };
    let prefix = match prefix.parse::<u32>() {
        Ok(p) if p <= bits => p,
        _ => return bad("a prefix out of range"),
    };
    let value: u128 = match addr {
        std::net::IpAddr::V4(a) => u128::from(u32::from(a)),
        std::net::IpAddr::V6(a) => u128::from(a),
    };
    let host_bits = bits - prefix;
    let host = if host_bits == 0 {
        0
    } else {
        value & (u128::MAX >> (128 - host_bits))
    };
    if host != 0 {
        return bad("host bits set");
    }
    Ok(())
}

fn labels(pairs: &[(&str, &str)]) -> LabelSelector {
    LabelSelector {
        match_labels: Some(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
        ),
        match_expressions: None,
    }
}

/// A peer: any pod of the namespaces named.
fn namespaces(names: &[String]) -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: NAMESPACE_NAME.to_owned(),
                operator: "In".to_owned(),
                values: Some(names.to_vec()),
            }]),
        }),
        ..NetworkPolicyPeer::default()
    }
}

fn port(number: i32, protocol: &str) -> NetworkPolicyPort {
    NetworkPolicyPort {
        port: Some(IntOrString::Int(number)),
        protocol: Some(protocol.to_owned()),
        end_port: None,
    }
}

/// The NetworkPolicy of `tj`'s pods, `<job>-edl`. It isolates them both ways, so what
/// it does not name is denied:
///
/// - in: from the job's own pods, and the operator's (any port); from the pods of
///   `network.metrics_namespaces` to the metrics port ([`METRICS_PORT`]);
/// - out: to the job's own pods (any port); to the cluster DNS ([`DNS`], port 53); to the
///   pods of `network.egress_namespaces` and the addresses of `network.egress_cidrs`.
///
/// Policies add up: a tenant who may create NetworkPolicies in the job's namespace can
/// allow more (the operator never removes theirs). The Kubernetes API server is not
/// allowed: no job process talks to it.
pub fn network_policy(tj: &TrainingJob, network: &JobNetwork) -> NetworkPolicy {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let own = labels(&[(JOB_LABEL, &job)]);
    let own_pods = NetworkPolicyPeer {
        pod_selector: Some(own.clone()),
        ..NetworkPolicyPeer::default()
    };
    let operator = NetworkPolicyPeer {
        namespace_selector: Some(labels(&[(NAMESPACE_NAME, &network.operator_namespace)])),
        pod_selector: Some(labels(&[OPERATOR_LABEL])),
        ..NetworkPolicyPeer::default()
    };
    let mut ingress = vec![NetworkPolicyIngressRule {
        from: Some(vec![own_pods.clone(), operator]),
        ports: None,
    }];
    if !network.metrics_namespaces.is_empty() {
        ingress.push(NetworkPolicyIngressRule {
            from: Some(vec![namespaces(&network.metrics_namespaces)]),
            ports: Some(vec![port(METRICS_PORT, "TCP")]),
        });
    }
    let dns = NetworkPolicyPeer {
        namespace_selector: Some(labels(&[(NAMESPACE_NAME, DNS.0)])),
        pod_selector: Some(labels(&[DNS.1])),
        ..NetworkPolicyPeer::default()
    };
    let mut egress = vec![
        NetworkPolicyEgressRule {
            to: Some(vec![own_pods]),
            ports: None,
        },
        NetworkPolicyEgressRule {
            to: Some(vec![dns]),
            ports: Some(vec![port(53, "UDP"), port(53, "TCP")]),
        },
    ];
    let mut outside: Vec<NetworkPolicyPeer> = network
        .egress_cidrs
        .iter()
        .map(|cidr| NetworkPolicyPeer {
            ip_block: Some(IPBlock {
                cidr: cidr.clone(),
                except: None,
            }),
            ..NetworkPolicyPeer::default()
        })
        .collect();
    if !network.egress_namespaces.is_empty() {
        outside.insert(0, namespaces(&network.egress_namespaces));
    }
    if !outside.is_empty() {
        egress.push(NetworkPolicyEgressRule {
            to: Some(outside),
            ports: None,
        });
    }
    NetworkPolicy {
        metadata: meta(tj, format!("{job}-edl"), None),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(own),
            policy_types: Some(vec!["Ingress".to_owned(), "Egress".to_owned()]),
            ingress: Some(ingress),
            egress: Some(egress),
        }),
    }
}

#[cfg(test)]
mod tests {
    use edl_testkit::kube_api::network_policy::{End, allows};
    use serde_json::{Value, json};

    use super::*;
    use crate::objects::{CredentialsRef, MASTER_PORT, Role, Slot, pod};

    const NS: &str = crate::objects::TEST_NAMESPACE;

    /// A job pod as the operator makes it, and a stranger's with `labels`.
    fn job_pod(tj: &TrainingJob, role: Role) -> Value {
        serde_json::to_value(pod(tj, Slot { role, index: 0 }, CredentialsRef::None)).expect("json")
    }

    /// A pod's name, or its labels.
    fn who(pod: &Value) -> String {
        pod["metadata"]["name"]
            .as_str()
            .map_or_else(|| pod["metadata"]["labels"].to_string(), str::to_owned)
    }

    fn stranger(labels: Value) -> Value {
        json!({"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c"}]}})
    }

    /// Whether `from` (in its namespace) reaches `port` of `to` with the job's policy in
    /// `NS` (and no other policy anywhere).
    fn reaches(policy: &Value, from: (&str, &Value), to: (&str, &Value), port: u16) -> bool {
        let of = |ns: &str| {
            if ns == NS {
                vec![policy.clone()]
            } else {
                Vec::new()
            }
        };
        let (fl, tl) = (
            json!({NAMESPACE_NAME: from.0}),
            json!({NAMESPACE_NAME: to.0}),
        );
        allows(
            &of(from.0),
            End {
                pod: from.1,
                namespace_labels: &fl,
            },
            from.0,
            &of(to.0),
            End {
                pod: to.1,
                namespace_labels: &tl,
            },
            to.0,
            port,
        )
    }

    /// What the policy lets through, as a cluster enforcing it decides (the stand-in's
    /// evaluator): the job's pods reach one another, the DNS and the configured
    /// namespaces, and nothing else; they take connections from one another, the
    /// operator, and scrapes from the configured namespaces on the metrics port only.
    #[test]
    fn the_job_is_denied_all_but_what_it_names_both_ways() {
        let tj = crate::objects::test_job();
        let network = JobNetwork {
            metrics_namespaces: vec!["monitoring".to_owned()],
            egress_namespaces: vec!["storage".to_owned()],
            egress_cidrs: vec!["10.20.0.0/16".to_owned()],
            ..JobNetwork::default()
        };
        let policy = serde_json::to_value(network_policy(&tj, &network)).expect("json");
        let (trainer, master) = (job_pod(&tj, Role::Trainer), job_pod(&tj, Role::Master));
        let operator = stranger(json!({OPERATOR_LABEL.0: OPERATOR_LABEL.1}));
        let dns = stranger(json!({DNS.1.0: DNS.1.1}));
        let prometheus = stranger(json!({"app": "prometheus"}));
        let minio = stranger(json!({"app": "minio"}));
        let other_job = stranger(json!({JOB_LABEL: "other"}));
        let lookalike = stranger(json!({JOB_LABEL: "mnist"}));
        let master_port = u16::try_from(MASTER_PORT).expect("port");
        let metrics = u16::try_from(METRICS_PORT).expect("port");
        for (from, to, port) in [
            ((NS, &trainer), (NS, &master), master_port),
            (("edl-system", &operator), (NS, &master), master_port),
            (("monitoring", &prometheus), (NS, &trainer), metrics),
            ((NS, &trainer), (DNS.0, &dns), 53),
            ((NS, &trainer), ("storage", &minio), 9000),
            // The positive witness for the refusals below: with no policy of theirs,
            // the lookalike and the other job take anything from anyone else.
            (("monitoring", &prometheus), ("elsewhere", &lookalike), 7164),
            (("monitoring", &prometheus), (NS, &other_job), 80),
        ] {
            assert!(
                reaches(&policy, from, to, port),
                "{}/{} -> {}/{}:{port} must be allowed",
                from.0,
                who(from.1),
                to.0,
                who(to.1)
            );
        }
        for (from, to, port) in [
            // In: strangers, even in the job's namespace or labelled as the job's.
            ((NS, &other_job), (NS, &master), master_port),
            (("elsewhere", &lookalike), (NS, &master), master_port),
            // Scrapes from elsewhere, and from the metrics namespaces to other ports.
            ((NS, &other_job), (NS, &trainer), metrics),
            (("monitoring", &prometheus), (NS, &master), master_port),
            // Out: anything but the job, the DNS and what the admin named.
            ((NS, &trainer), ("elsewhere", &lookalike), 7164),
            ((NS, &trainer), (NS, &other_job), 80),
            ((NS, &trainer), (DNS.0, &dns), 80),
            ((NS, &trainer), ("monitoring", &prometheus), 9090),
        ] {
            assert!(
                !reaches(&policy, from, to, port),
                "{}/{} -> {}/{}:{port} must be refused",
                from.0,
                who(from.1),
                to.0,
                who(to.1)
            );
        }
        // Outside the cluster: the CIDR named, with UDP and TCP DNS.
        let egress = &policy["spec"]["egress"];
        assert_eq!(egress[2]["to"][1]["ipBlock"]["cidr"], "10.20.0.0/16");
        assert_eq!(egress[1]["ports"][0]["protocol"], "UDP");
        // Without metrics namespaces, the operator alone scrapes.
        let quiet =
            serde_json::to_value(network_policy(&tj, &JobNetwork::default())).expect("json");
        assert!(!reaches(
            &quiet,
            ("monitoring", &prometheus),
            (NS, &trainer),
            metrics
        ));
        assert!(reaches(
            &quiet,
            ("edl-system", &operator),
            (NS, &trainer),
            metrics
        ));
        assert!(!reaches(&quiet, (NS, &trainer), ("storage", &minio), 9000));
    }

    #[test]
    fn cidrs_are_networks_without_host_bits() {
        for ok in [
            "10.20.0.0/16",
            "192.168.1.7/32",
            "0.0.0.0/0",
            "2001:db8::/32",
            "::/0",
        ] {
            assert_eq!(check_cidr(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("10.20.0.0", "no /prefix"),
            ("10.20.1.0/16", "host bits set"),
            ("10.20.0.0/33", "out of range"),
            ("etcd.example/32", "not an IP address"),
            ("2001:db8::1/64", "host bits set"),
        ] {
            let e = check_cidr(bad).expect_err(bad);
            assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
        }
    }
}
