//! A change of the trainer count: an event, `scale/trainers`, and the trainer counts.

use super::draft::Draft;
use super::{EtcdAction, EtcdState, PodPhase};
use crate::crd::{Phase, TrainerCounts};
use crate::objects::Role;

impl Draft<'_> {
    /// A change of the desired trainer count (`want`) is an event and is written to
    /// `scale/trainers`; the trainer counts go into the status. Returns the trainers
    /// running.
    pub(super) fn scale(&mut self, want: u32, progress: Option<&EtcdState>) -> u32 {
        let running_trainers = self
            .obs
            .pods
            .iter()
            .filter(|p| {
                p.slot.role == Role::Trainer && p.phase == PodPhase::Running && !p.terminating
            })
            .count() as u32;
        let was_started = !matches!(self.old.phase, Phase::Created);
        let before = self.old.trainers.desired;
        if before != want && was_started {
            let (reason, verb) = if want > before {
                ("ScaledUp", "up")
            } else {
                ("ScaledDown", "down")
            };
            self.plan.event(
                false,
                reason,
                format!(
                    "trainers {before} -> {want}: scaling {verb}{}",
                    if verb == "down" {
                        " (the surplus trainers drain)"
                    } else {
                        ""
                    }
                ),
            );
        }
        if let Some(p) = progress
            && p.scale != Some(want)
        {
            self.plan.etcd.push(EtcdAction::WriteScale(want));
        }
        self.status.trainers = TrainerCounts {
            running: running_trainers,
            desired: want,
            registered: self.status.trainers.registered,
        };
        running_trainers
    }
}
