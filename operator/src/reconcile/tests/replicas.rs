//! Replicated pserver shards: a pod per replica, kept apart from its shard's others.

use super::*;

/// The pserver pods a plan creates.
fn pserver_pods(plan: &Plan) -> Vec<&Pod> {
    plan.create_pods
        .iter()
        .filter(|p| {
            p.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.contains("-pserver-"))
        })
        .collect()
}

/// `pserver_replicas = 2` with 2 shards: four pserver pods, slot `s` holding shard
/// `s % 2` with `--replicas 2`, labelled with its shard, and kept off any node that runs
/// another replica of the same shard (required anti-affinity on the node's hostname).
#[test]
fn replicated_shards_get_a_pod_per_replica_each_kept_apart_from_its_shards_others() {
    let mut tj = training_job("pservers = 2\npserver_replicas = 2");
    tj.metadata.finalizers = None;
    let plan = reconcile(&observe(&tj, vec![], Ok(EtcdState::default())));
    let pservers = pserver_pods(&plan);
    assert_eq!(pservers.len(), 4);
    for (slot, p) in pservers.iter().enumerate() {
        let shard = (slot % 2).to_string();
        let spec = p.spec.as_ref().expect("a pod spec");
        let command = spec.containers[0].command.clone().unwrap_or_default();
        let arg = |flag: &str| {
            command
                .iter()
                .position(|a| a == flag)
                .and_then(|i| command.get(i + 1))
                .cloned()
        };
        assert_eq!(arg("--index"), Some(shard.clone()), "{command:?}");
        assert_eq!(arg("--shards").as_deref(), Some("2"));
        assert_eq!(arg("--replicas").as_deref(), Some("2"));
        let labels = p.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels.get(crate::objects::SHARD_LABEL), Some(&shard));
        let terms = spec
            .affinity
            .as_ref()
            .and_then(|a| a.pod_anti_affinity.as_ref())
            .and_then(|a| {
                a.required_during_scheduling_ignored_during_execution
                    .clone()
            })
            .expect("required anti-affinity");
        assert_eq!(terms.len(), 1);
        assert_eq!(terms[0].topology_key, crate::objects::NODE_TOPOLOGY);
        let selects = terms[0]
            .label_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone())
            .unwrap_or_default();
        // The pod's own labels match its term: it repels exactly its shard's replicas.
        assert!(
            selects.iter().all(|(k, v)| labels.get(k) == Some(v)),
            "{selects:?} against {labels:?}"
        );
        assert_eq!(selects.get(crate::objects::SHARD_LABEL), Some(&shard));
    }
    // Without replicas: no shard label, no affinity, one replica.
    let tj = training_job("pservers = 2");
    let plan = reconcile(&observe(&tj, vec![], Ok(EtcdState::default())));
    let pservers = pserver_pods(&plan);
    assert_eq!(pservers.len(), 2);
    for p in pservers {
        let spec = p.spec.as_ref().expect("a pod spec");
        assert!(spec.affinity.is_none());
        let command = spec.containers[0].command.clone().unwrap_or_default();
        assert!(
            command.windows(2).any(|w| w == ["--replicas", "1"]),
            "{command:?}"
        );
    }
}
