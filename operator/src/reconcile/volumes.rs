//! The pservers' checkpoint claims, and CheckpointsDurable.

use super::draft::Draft;
use crate::objects;

impl Draft<'_> {
    /// Creates the checkpoint claims that are missing; says, by the `CheckpointsDurable`
    /// condition (and a warning Event when it turns false), whether a pserver pod that
    /// is replaced finds its checkpoints.
    pub(super) fn checkpoint_volumes(&mut self) {
        let tj = self.obs.job;
        for c in objects::claims(tj) {
            let name = c.metadata.name.clone().unwrap_or_default();
            if !self.obs.claims.contains(&name) {
                self.plan.create_claims.push(c);
            }
        }
        let (durable, reason, message) = match &tj.spec.volumes.checkpoints {
            _ if tj.spec.cluster.checkpoint_dir.is_some() => (
                true,
                "ObjectStore",
                "the pservers checkpoint to the object store of spec.cluster.checkpoint_dir"
                    .to_owned(),
            ),
            None => (
                true,
                "Claims",
                format!(
                    "each pserver pod checkpoints to a claim of its own ({}-checkpoints-<slot>)",
                    self.job
                ),
            ),
            Some(v) if v.claim_name.is_some() => (
                true,
                "Claim",
                "the pservers checkpoint to the claim in spec.volumes.checkpoints".to_owned(),
            ),
            Some(v) if v.host_path.is_some() => (
                false,
                "HostPath",
                "spec.volumes.checkpoints is a host path: a pserver pod replaced on another \
                 node restores nothing; remove it to get a claim per pserver"
                    .to_owned(),
            ),
            Some(_) => (
                false,
                "EmptyDir",
                "spec.volumes.checkpoints is an emptyDir: a replaced pserver pod restores \
                 nothing and its shard starts again from its initial values; remove it to get \
                 a claim per pserver"
                    .to_owned(),
            ),
        };
        if self.condition("CheckpointsDurable", durable, reason, message.clone()) && !durable {
            self.plan.event(true, "CheckpointsNotDurable", message);
        }
    }
}
