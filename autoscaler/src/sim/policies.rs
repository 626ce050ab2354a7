//! The policies the simulator compares, behind one trait.

use crate::paddle::{self, PaddleConfig};
use crate::policy::{self, PolicyConfig};
use crate::sim::TraceJob;
use crate::{Snapshot, Target};

/// How a policy's scale-down takes trainers away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleDown {
    /// The trainer finishes its task and leaves (edl: SIGTERM, the task handed back).
    Drain,
    /// The pod is deleted and its task's work is lost (EDL: a Kubernetes Job's
    /// parallelism lowered; Paddle's trainers did not drain).
    Kill,
}

/// An autoscaling policy as the simulator drives it.
pub trait Policy {
    /// The name in tables and plots.
    fn name(&self) -> String;
    /// Whether it ever resizes a job (`none` does not, and is never asked).
    fn resizes(&self) -> bool;
    /// The trainers a job is submitted with (0: queued until a decision admits it).
    fn initial(&mut self, job: &TraceJob) -> u32;
    /// New trainer counts for the jobs of `snapshot`.
    fn decide(&mut self, snapshot: &Snapshot) -> Vec<Target>;
    /// How surplus trainers go.
    fn scale_down(&self) -> ScaleDown;
    /// Whether it also decides on each arrival and end of a job, not only every tick.
    fn decides_on_events(&self) -> bool {
        true
    }
}

/// No autoscaling: every job runs its fixed trainer count (EDL's baseline).
#[derive(Debug, Clone, Copy, Default)]
pub struct FixedPolicy;

impl Policy for FixedPolicy {
    fn name(&self) -> String {
        "none".to_owned()
    }
    fn resizes(&self) -> bool {
        false
    }
    fn initial(&mut self, job: &TraceJob) -> u32 {
        job.fixed
    }
    fn decide(&mut self, _: &Snapshot) -> Vec<Target> {
        Vec::new()
    }
    fn scale_down(&self) -> ScaleDown {
        ScaleDown::Kill
    }
}

/// EDL's autoscaler ([`paddle::decide`]); jobs are submitted at their minimum, as in its
/// experiment (parallelism 2, min 2).
#[derive(Debug, Clone)]
pub struct PaddlePolicy {
    /// Its settings and the defects reproduced.
    pub config: PaddleConfig,
    passes: u64,
}

impl PaddlePolicy {
    /// EDL's autoscaler with `config`.
    pub fn new(config: PaddleConfig) -> Self {
        PaddlePolicy { config, passes: 0 }
    }
}

impl Policy for PaddlePolicy {
    fn name(&self) -> String {
        let d = self.config.defects;
        if d == paddle::Defects::default() {
            "EDL".to_owned()
        } else {
            "EDL+defects".to_owned()
        }
    }
    fn resizes(&self) -> bool {
        true
    }
    fn initial(&mut self, job: &TraceJob) -> u32 {
        job.min
    }
    fn decide(&mut self, snapshot: &Snapshot) -> Vec<Target> {
        self.passes += 1;
        paddle::decide(&self.config, snapshot, self.passes)
    }
    fn scale_down(&self) -> ScaleDown {
        ScaleDown::Kill
    }
}

/// edl's policy ([`policy::decide`]); jobs are submitted at their minimum and grown.
#[derive(Debug, Clone, Default)]
pub struct EdlPolicy {
    /// Its settings.
    pub config: PolicyConfig,
}

impl Policy for EdlPolicy {
    fn name(&self) -> String {
        "edl".to_owned()
    }
    fn resizes(&self) -> bool {
        true
    }
    fn initial(&mut self, job: &TraceJob) -> u32 {
        job.min
    }
    fn decide(&mut self, snapshot: &Snapshot) -> Vec<Target> {
        policy::decide(&self.config, snapshot)
    }
    fn scale_down(&self) -> ScaleDown {
        ScaleDown::Drain
    }
}
