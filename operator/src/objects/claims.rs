//! The PersistentVolumeClaims the operator makes for a job: one per pserver pod for its
//! checkpoints, one per member of a managed etcd for its data.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{Role, Slot, etcd_member_slots, meta};
use crate::crd::{ClaimTemplate, TrainingJob};

/// The claim the operator makes for the checkpoints of pserver slot `slot` of `job`
/// (when the job names no checkpoint volume): `<job>-checkpoints-<slot>`.
pub fn checkpoint_claim_name(job: &str, slot: u32) -> String {
    format!("{job}-checkpoints-{slot}")
}

/// The checkpoint claims `tj` wants: one per pserver slot, unless the job names its
/// checkpoint volume (`volumes.checkpoints`) or checkpoints to an object store
/// (`cluster.checkpoint_dir`).
pub fn checkpoint_claims(tj: &TrainingJob) -> Vec<PersistentVolumeClaim> {
    if tj.spec.volumes.checkpoints.is_some() || tj.spec.cluster.checkpoint_dir.is_some() {
        return Vec::new();
    }
    let job = tj.metadata.name.clone().unwrap_or_default();
    let c = &tj.spec.cluster;
    (0..c.pservers * c.pserver_replicas.max(1))
        .map(|index| {
            let slot = Slot {
                role: Role::Pserver,
                index,
            };
            let name = checkpoint_claim_name(&job, index);
            claim(tj, name, slot, &tj.spec.volumes.checkpoint_claims)
        })
        .collect()
}

/// The claims of `tj`'s managed etcd, one per member (none for an etcd it does not
/// run).
pub fn etcd_claims(tj: &TrainingJob) -> Vec<PersistentVolumeClaim> {
    if !tj.spec.etcd.managed {
        return Vec::new();
    }
    let job = tj.metadata.name.clone().unwrap_or_default();
    etcd_member_slots(tj)
        .map(|slot| {
            claim(
                tj,
                etcd_claim_name(&job, slot.index),
                slot,
                &tj.spec.etcd.claims,
            )
        })
        .collect()
}

/// Every claim the operator makes for `tj`: its pservers' checkpoints and its managed
/// etcd's data.
pub fn claims(tj: &TrainingJob) -> Vec<PersistentVolumeClaim> {
    let mut out = checkpoint_claims(tj);
    out.extend(etcd_claims(tj));
    out
}

/// Claim `name` of `slot`'s pod, as `t` says (ReadWriteOnce: one pod mounts it at a
/// time, and replicas on different nodes each have their own).
fn claim(tj: &TrainingJob, name: String, slot: Slot, t: &ClaimTemplate) -> PersistentVolumeClaim {
    let mut metadata = meta(tj, name, Some(slot));
    if t.keep {
        // Not owned: the garbage collector leaves it when the job goes.
        metadata.owner_references = None;
    }
    PersistentVolumeClaim {
        metadata,
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
            storage_class_name: t.storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_owned(),
                    Quantity(t.size.clone()),
                )])),
                limits: None,
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        status: None,
    }
}

/// The claim holding the data of member `i` of `job`'s managed etcd:
/// `<job>-etcd-data-<i>`.
pub fn etcd_claim_name(job: &str, i: u32) -> String {
    format!("{job}-etcd-data-{i}")
}
