//! What the engine shows: the speeds policies observe, the snapshot they decide on, the
//! timeline and the result.

use rand::Rng;

use super::{Engine, PodState};
use crate::sim::{JobOutcome, Sample, SimResult};
use crate::{JobView, Observation, PodCounts, Resources, Snapshot};

impl Engine<'_> {
    /// Records each training job's current speed, as a job's metrics would show it.
    pub(super) fn observe(&mut self) {
        let active: Vec<usize> = self.active.iter().copied().collect();
        for j in active {
            let job = &self.jobs[j];
            if job.rate <= 0.0 || self.now < job.stalled_until {
                continue;
            }
            let noise = self.cfg.observation_noise;
            let factor = if noise > 0.0 {
                1.0 + self.rng.random_range(-noise..=noise)
            } else {
                1.0
            };
            let o = Observation {
                trainers: job.trainers_running,
                rate: job.rate * factor,
            };
            crate::observe::remember(&mut self.jobs[j].speed, o);
        }
    }

    /// The snapshot the policy decides on; it holds the engine's nodes (taken, not
    /// copied: a day's thousand nodes each pass) until [`Engine::restore`] takes them
    /// back.
    pub(super) fn snapshot(&mut self) -> Snapshot {
        let nodes = std::mem::take(&mut self.nodes);
        let mut unplaced = Resources::ZERO;
        for &p in &self.pending {
            unplaced += self.pods[p].req;
        }
        let jobs = self
            .active
            .iter()
            .map(|&j| {
                let spec = &self.s.jobs[j];
                let run = &self.jobs[j];
                let mut pods = PodCounts::default();
                let mut waiting = Vec::new();
                for &p in &run.pods {
                    let pod = &self.pods[p];
                    if pod.state == PodState::Pending {
                        waiting.push(pod.req);
                    }
                    if !pod.trainer {
                        continue;
                    }
                    match pod.state {
                        PodState::Gone => continue,
                        PodState::Pending => {
                            pods.pending += 1;
                            pods.unbound += 1;
                        }
                        PodState::Starting => pods.pending += 1,
                        PodState::Running | PodState::Draining => pods.running += 1,
                    }
                    pods.total += 1;
                }
                let done = if run.rate > 0.0 {
                    let from = run.updated.max(run.stalled_until);
                    run.done + run.rate * (self.now - from).max(0.0)
                } else {
                    run.done
                };
                JobView {
                    name: spec.name.clone(),
                    min: spec.min,
                    max: spec.max,
                    priority: spec.priority,
                    trainer: spec.trainer,
                    trainers: run.parallelism,
                    waiting,
                    pods,
                    submitted: spec.submit,
                    changed_at: run.changed_at,
                    speed: run.speed.clone(),
                    remaining: Some(known_left(spec.work, done, spec.epochs)),
                }
            })
            .collect();
        Snapshot {
            now: self.now,
            nodes,
            unplaced,
            jobs,
        }
    }

    /// Takes back the nodes lent to `snapshot`.
    pub(super) fn restore(&mut self, snapshot: Snapshot) {
        self.nodes = snapshot.nodes;
    }

    pub(super) fn sample(&mut self) {
        let total: Resources = self.nodes.iter().map(|n| n.allocatable).sum();
        let ratio = |used: u64, all: u64| {
            if all == 0 {
                0.0
            } else {
                used as f64 / all as f64
            }
        };
        let trainers = self
            .active
            .iter()
            .map(|&j| self.jobs[j].trainers_running)
            .sum();
        let pending_jobs = self
            .active
            .iter()
            .filter(|&&j| self.jobs[j].started.is_none())
            .count() as u32;
        let (job_trainers, cpu_running) = if self.cfg.sample_jobs {
            let running: u64 = self
                .pods
                .iter()
                .filter(|p| matches!(p.state, PodState::Running | PodState::Draining))
                .map(|p| p.req.cpu_milli)
                .sum();
            (
                self.jobs
                    .iter()
                    .map(|j| {
                        if j.finished.is_some() {
                            0
                        } else {
                            j.trainers_running
                        }
                    })
                    .collect(),
                Some(ratio(running, total.cpu_milli)),
            )
        } else {
            (Vec::new(), None)
        };
        self.samples.push(Sample {
            t: self.now - self.origin,
            cpu: ratio(self.bound.cpu_milli, total.cpu_milli),
            gpu: ratio(self.bound.gpu, total.gpu),
            trainers,
            pending_jobs,
            job_trainers,
            cpu_running,
        });
    }

    pub(super) fn result(self) -> SimResult {
        let total: Resources = self.nodes.iter().map(|n| n.allocatable).sum();
        let end = self
            .jobs
            .iter()
            .filter_map(|j| j.finished)
            .fold(self.origin, f64::max);
        let end = if self.left > 0 { self.now } else { end };
        let makespan = (end - self.origin).max(f64::EPSILON);
        let jobs = self
            .s
            .jobs
            .iter()
            .zip(&self.jobs)
            .map(|(spec, run)| JobOutcome {
                name: spec.name.clone(),
                pending: run.started.map(|t| t - spec.submit),
                completion: run.finished.map(|t| t - spec.submit),
                scale_events: run.scale_events,
            })
            .collect();
        SimResult {
            policy: self.policy.name(),
            jobs,
            makespan,
            cpu_util: self.cpu_area / (total.cpu_milli.max(1) as f64 * makespan),
            gpu_util: (total.gpu > 0).then(|| self.gpu_area / (total.gpu as f64 * makespan)),
            cpu_util_contended: self.busy_cpu_area
                / (total.cpu_milli.max(1) as f64 * self.busy_secs.max(f64::EPSILON)),
            gpu_util_contended: (total.gpu > 0).then(|| {
                self.busy_gpu_area / (total.gpu as f64 * self.busy_secs.max(f64::EPSILON))
            }),
            contended_secs: self.busy_secs,
            scale_events: self.scale_events,
            samples: self.samples,
        }
    }
}

/// The work left of a job as its progress shows it: exactly, or the work of the epochs
/// not yet completed when its progress is known by epochs.
fn known_left(work: f64, done: f64, epochs: Option<u32>) -> f64 {
    let left = (work - done).max(0.0);
    match epochs {
        Some(e) if e > 0 && work > 0.0 => {
            let e = f64::from(e);
            // The tiny slack keeps an epoch ended exactly from reading as unfinished.
            let completed = ((done / work) * e + 1e-9).floor().min(e);
            work * (e - completed) / e
        }
        _ => left,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn progress_known_by_epochs_shows_the_work_of_the_epochs_left() {
        assert_eq!(super::known_left(100.0, 37.0, None), 63.0);
        assert_eq!(super::known_left(100.0, 37.0, Some(4)), 75.0);
        assert_eq!(super::known_left(100.0, 50.0, Some(4)), 50.0);
        assert_eq!(super::known_left(100.0, 0.0, Some(4)), 100.0);
        assert_eq!(super::known_left(100.0, 100.0, Some(4)), 0.0);
    }
}
