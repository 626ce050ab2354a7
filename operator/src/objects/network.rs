//! A job's NetworkPolicy.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{JOB_LABEL, METRICS_PORT, meta};
use crate::crd::TrainingJob;

/// The label of the operator's own pods (`deploy/operator.yaml`).
pub const OPERATOR_LABEL: (&str, &str) = ("app.kubernetes.io/name", "edl-operator");

/// The NetworkPolicy of `tj`'s pods, `<job>-edl`: they accept connections only from the
/// job's own pods and from the operator's (pods labelled [`OPERATOR_LABEL`] in
/// `operator_namespace`: it asks the job's master and etcd), except on the metrics port
/// ([`METRICS_PORT`], behind the job token), which a cluster's Prometheus scrapes.
/// Outgoing traffic is not limited.
pub fn network_policy(tj: &TrainingJob, operator_namespace: &str) -> NetworkPolicy {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let own = LabelSelector {
        match_labels: Some(BTreeMap::from([(JOB_LABEL.to_owned(), job.clone())])),
        match_expressions: None,
    };
    let operator = NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                "kubernetes.io/metadata.name".to_owned(),
                operator_namespace.to_owned(),
            )])),
            match_expressions: None,
        }),
        pod_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                OPERATOR_LABEL.0.to_owned(),
                OPERATOR_LABEL.1.to_owned(),
            )])),
            match_expressions: None,
        }),
        ..NetworkPolicyPeer::default()
    };
    NetworkPolicy {
        metadata: meta(tj, format!("{job}-edl"), None),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(own.clone()),
            policy_types: Some(vec!["Ingress".to_owned()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![
                        NetworkPolicyPeer {
                            pod_selector: Some(own),
                            ..NetworkPolicyPeer::default()
                        },
                        operator,
                    ]),
                    ports: None,
                },
                NetworkPolicyIngressRule {
                    from: None,
                    ports: Some(vec![NetworkPolicyPort {
                        port: Some(IntOrString::Int(METRICS_PORT)),
                        protocol: Some("TCP".to_owned()),
                        end_port: None,
                    }]),
                },
            ]),
            egress: None,
        }),
    }
}
