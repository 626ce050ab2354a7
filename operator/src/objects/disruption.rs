//! A job's PodDisruptionBudgets: what a voluntary disruption (a node drained, an
//! autoscaler taking a node back: anything that evicts) may take from a job at once.
//! A managed etcd keeps its quorum; a replicated shard keeps a replica. Pods a node
//! loses are not voluntary: budgets do not hold those back.

use std::collections::BTreeMap;

use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{JOB_LABEL, ROLE_LABEL, Role, SHARD_LABEL, meta};
use crate::crd::TrainingJob;

/// The budgets of `tj`: with a managed etcd of more than one member, `<job>-etcd`
/// (its members, a quorum available: `members / 2 + 1`); with replicated pservers, one
/// per shard, `<job>-shard-<k>` (the shard's replicas, all but one available). An
/// eviction that would go below is refused, so a drain waits for the evicted pod to
/// come back elsewhere before it takes the next. A job without either has none:
/// losing its one pserver or one etcd is a restore either way.
pub fn disruption_budgets(tj: &TrainingJob) -> Vec<PodDisruptionBudget> {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let s = &tj.spec;
    let budget = |name: String, labels: &[(&str, String)], min: u32| PodDisruptionBudget {
        metadata: meta(tj, name, None),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(i32::try_from(min).unwrap_or(i32::MAX))),
            selector: Some(LabelSelector {
                match_labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), v.clone()))
                        .collect::<BTreeMap<_, _>>(),
                ),
                match_expressions: None,
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        status: None,
    };
    let mut out = Vec::new();
    if s.etcd.managed && s.etcd.members > 1 {
        out.push(budget(
            format!("{job}-etcd"),
            &[
                (JOB_LABEL, job.clone()),
                (ROLE_LABEL, Role::Etcd.name().to_owned()),
            ],
            s.etcd.members / 2 + 1,
        ));
    }
    let c = &s.cluster;
    if c.pserver_replicas > 1 {
        for shard in 0..c.pservers {
            out.push(budget(
                format!("{job}-shard-{shard}"),
                &[
                    (JOB_LABEL, job.clone()),
                    (ROLE_LABEL, Role::Pserver.name().to_owned()),
                    (SHARD_LABEL, shard.to_string()),
                ],
                c.pserver_replicas - 1,
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budgets(tj: &TrainingJob) -> Vec<(String, i32, BTreeMap<String, String>)> {
        disruption_budgets(tj)
            .into_iter()
            .map(|b| {
                let spec = b.spec.expect("spec");
                let min = match spec.min_available {
                    Some(IntOrString::Int(n)) => n,
                    other => panic!("{other:?}"),
                };
                let labels = spec
                    .selector
                    .and_then(|s| s.match_labels)
                    .unwrap_or_default();
                (b.metadata.name.unwrap_or_default(), min, labels)
            })
            .collect()
    }

    #[test]
    fn a_quorum_of_members_and_all_but_one_replica_of_each_shard_stay() {
        let mut tj = crate::objects::test_job();
        tj.spec.etcd = crate::crd::EtcdSpec {
            endpoints: vec!["http://etcd:2379".into()],
            ..crate::crd::EtcdSpec::default()
        };
        assert!(budgets(&tj).is_empty(), "one pserver, a shared etcd: none");
        tj.spec.etcd.managed = true;
        for (members, min) in [(3, 2), (5, 3), (7, 4)] {
            tj.spec.etcd.members = members;
            let b = budgets(&tj);
            assert_eq!(b.len(), 1);
            assert_eq!((b[0].0.as_str(), b[0].1), ("mnist-etcd", min), "{members}");
            assert_eq!(b[0].2.get(ROLE_LABEL).map(String::as_str), Some("etcd"));
        }
        tj.spec.etcd.members = 1;
        assert!(budgets(&tj).is_empty(), "one member: nothing to keep");
        tj.spec.cluster.pservers = 3;
        tj.spec.cluster.pserver_replicas = 3;
        let b = budgets(&tj);
        assert_eq!(
            b.iter()
                .map(|(n, m, _)| (n.as_str(), *m))
                .collect::<Vec<_>>(),
            [
                ("mnist-shard-0", 2),
                ("mnist-shard-1", 2),
                ("mnist-shard-2", 2)
            ]
        );
        assert_eq!(b[2].2.get(SHARD_LABEL).map(String::as_str), Some("2"));
    }
}
