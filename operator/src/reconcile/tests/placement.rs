//! Where a job's pods go (`spec.placement`): every role's settings (`all`), a role's own
//! replacing them field by field, and a replicated pserver's anti-affinity added to the
//! user's affinity; a field the schema keeps as written that is not what it should be
//! makes the job invalid, named by its field.

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, NodeAffinity, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, Toleration, TopologySpreadConstraint,
};

use super::*;
use crate::crd::{Placement, RolePlacement};

fn toleration(key: &str) -> Toleration {
    Toleration {
        key: Some(key.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: Some("NoSchedule".to_owned()),
        ..Toleration::default()
    }
}

/// The pod spec of the first pod of `role` in `plan`.
fn spec_of<'p>(plan: &'p Plan, role: &str) -> &'p k8s_openapi::api::core::v1::PodSpec {
    plan.create_pods
        .iter()
        .find(|p| {
            p.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.contains(&format!("-{role}-")))
        })
        .and_then(|p| p.spec.as_ref())
        .unwrap_or_else(|| panic!("no {role} pod"))
}

#[test]
fn each_role_goes_where_its_placement_says_over_the_jobs_own() {
    let mut tj = training_job("pservers = 1\npserver_replicas = 2");
    tj.spec.priority_class_name = Some("edl-default".into());
    let cpu_pool = Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(vec![NodeSelectorRequirement {
                        key: "pool".into(),
                        operator: "In".into(),
                        values: Some(vec!["cpu".into()]),
                    }]),
                    ..NodeSelectorTerm::default()
                }],
            }),
            ..NodeAffinity::default()
        }),
        ..Affinity::default()
    };
    tj.spec.placement = RolePlacement {
        all: Some(Placement {
            tolerations: vec![toleration("dedicated")],
            image_pull_secrets: vec![LocalObjectReference {
                name: "registry".into(),
            }],
            service_account_name: Some("edl-jobs".into()),
            topology_spread_constraints: vec![
                serde_json::to_value(TopologySpreadConstraint {
                    max_skew: 1,
                    topology_key: "topology.kubernetes.io/zone".into(),
                    when_unsatisfiable: "ScheduleAnyway".into(),
                    ..TopologySpreadConstraint::default()
                })
                .expect("json"),
            ],
            ..Placement::default()
        }),
        trainer: Some(Placement {
            node_selector: BTreeMap::from([("nvidia.com/gpu.present".into(), "true".into())]),
            tolerations: vec![toleration("nvidia.com/gpu")],
            ..Placement::default()
        }),
        pserver: Some(Placement {
            affinity: Some(serde_json::to_value(&cpu_pool).expect("json")),
            ..Placement::default()
        }),
        ..RolePlacement::default()
    };
    let plan = reconcile(&observe(&tj, vec![], Ok(EtcdState::default())));

    // Trainers: their own selector and tolerations; `all`'s pull Secret, account and
    // spread (fields they do not set); the job's priority class, as every pod.
    let t = spec_of(&plan, "trainer");
    assert_eq!(
        t.node_selector
            .as_ref()
            .and_then(|s| s.get("nvidia.com/gpu.present")),
        Some(&"true".to_owned())
    );
    assert_eq!(
        t.tolerations.as_deref(),
        Some(&[toleration("nvidia.com/gpu")][..])
    );
    assert_eq!(t.priority_class_name.as_deref(), Some("edl-default"));
    assert_eq!(
        t.image_pull_secrets.as_deref(),
        Some(
            &[LocalObjectReference {
                name: "registry".into()
            }][..]
        )
    );
    assert_eq!(t.service_account_name.as_deref(), Some("edl-jobs"));
    assert_eq!(
        t.automount_service_account_token,
        Some(false),
        "no API token mounted"
    );
    assert_eq!(
        t.topology_spread_constraints.as_ref().map(Vec::len),
        Some(1)
    );

    // The master: `all`'s settings only, the job's priority class.
    let m = spec_of(&plan, "master");
    assert!(m.node_selector.is_none(), "{:?}", m.node_selector);
    assert_eq!(
        m.tolerations.as_deref(),
        Some(&[toleration("dedicated")][..])
    );
    assert_eq!(m.priority_class_name.as_deref(), Some("edl-default"));
    assert_eq!(m.service_account_name.as_deref(), Some("edl-jobs"));

    // A replicated pserver: the user's node affinity, and its own replicas kept apart.
    let p = spec_of(&plan, "pserver");
    let affinity = p.affinity.as_ref().expect("affinity");
    assert_eq!(affinity.node_affinity, cpu_pool.node_affinity, "the user's");
    let apart = affinity
        .pod_anti_affinity
        .as_ref()
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .expect("the replicas' anti-affinity");
    assert_eq!(apart.len(), 1);
    assert_eq!(apart[0].topology_key, crate::objects::NODE_TOPOLOGY);

    // Nothing set: the pods are as before (no selector, no tolerations, the job's class).
    let mut plain = training_job("");
    plain.spec.priority_class_name = Some("edl-default".into());
    let plan = reconcile(&observe(&plain, vec![], Ok(EtcdState::default())));
    let t = spec_of(&plan, "trainer");
    assert!(t.node_selector.is_none() && t.tolerations.is_none() && t.affinity.is_none());
    assert!(t.image_pull_secrets.is_none() && t.service_account_name.is_none());
    assert_eq!(t.priority_class_name.as_deref(), Some("edl-default"));
}

/// The schema keeps `affinity` and `topologySpreadConstraints` as written, so the API
/// server takes anything there: the operator's check names the field, the job fails
/// with it (an invalid spec: no pods), and the job stays readable, as does every other.
#[test]
fn a_placement_that_is_not_what_its_field_says_is_an_invalid_job() {
    let mut tj = training_job("");
    tj.spec.placement = RolePlacement {
        trainer: Some(Placement {
            affinity: Some(serde_json::json!({"nodeAffinity": "gpu please"})),
            ..Placement::default()
        }),
        ..RolePlacement::default()
    };
    let e = tj.job_spec().expect_err("an affinity that is not one");
    assert_eq!(e.field, "spec.placement.trainer.affinity", "{e}");
    let plan = reconcile(&observe(&tj, vec![], Ok(EtcdState::default())));
    assert!(plan.create_pods.is_empty(), "{:?}", plan.create_pods);
    let status = plan.status.expect("status");
    assert_eq!(status.phase, Phase::Failed);
    // The object round-trips: a list of jobs with this one in it still reads.
    let json = serde_json::to_value(&tj).expect("json");
    let back: TrainingJob = serde_json::from_value(json).expect("it still deserializes");
    assert_eq!(back.spec.placement, tj.spec.placement);

    tj.spec.placement.trainer = Some(Placement {
        topology_spread_constraints: vec![serde_json::json!({"maxSkew": "one"})],
        ..Placement::default()
    });
    let e = tj.job_spec().expect_err("a spread that is not one");
    assert_eq!(
        e.field, "spec.placement.trainer.topologySpreadConstraints",
        "{e}"
    );
}
