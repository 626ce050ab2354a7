//! Fault injection (`--chaos`): choosing a victim, and measuring its recovery against
//! etcd.
//!
//! - A trainer is a victim once registered (else its "recovery" is instant).
//! - The master hit is the leader: the value of the first key under the master
//!   election prefix (as `edl status` finds it) is the leader's address, and each
//!   master writes its address to `<run dir>/logs/<name>.addr`.
//! - Recovery: see [`Check`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use edl_coord::Backend;
use edl_job::{JobKeys, JobName, PserverRecord, Record};
use edl_master::client::{MasterClient, MasterClientConfig};
use edl_proto::master::StatusResponse;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

use super::chaos::{Chaos, ChaosClock, Fault};
use super::procs::Launch;
use super::report::Recovery;
use super::supervisor::{Effect, Role, Supervisor};

/// What recovery from a fault means, checked against etcd.
#[derive(Debug)]
enum Check {
    /// The trainer's registration is gone (its tasks are back in the queue) and the job
    /// has as many trainers registered as before.
    Trainer { key: String, want: usize },
    /// The stopped trainer's registration is gone (its tasks are back in the queue).
    TrainerGone { key: String },
    /// The pserver shard is claimed again (a new claim) and the new pserver answers (it
    /// restored its checkpoint before serving).
    Pserver { key: String, old_create: i64 },
    /// A master leads again (a new leader key) and answers.
    Master { old_leader: Option<Vec<u8>> },
}

/// A fault whose recovery has not been seen yet.
#[derive(Debug)]
struct Pending {
    fault: &'static str,
    role: Role,
    process: String,
    at: Instant,
    check: Check,
}

/// The faults of a run: when they are due, and those not recovered from yet.
#[derive(Debug)]
pub(crate) struct Faults {
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    job: JobName,
    clock: ChaosClock,
    rng: rand::rngs::StdRng,
    pending: Vec<Pending>,
}

impl Faults {
    /// The faults of `chaos` (none without), the first due one interval after
    /// `started`; victims drawn with its seed.
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        job: &JobName,
        chaos: Option<&Chaos>,
        started: Instant,
    ) -> Faults {
        Faults {
            backend,
            keys: JobKeys::new(job),
            job: job.clone(),
            clock: ChaosClock::new(chaos, started),
            rng: rand::rngs::StdRng::seed_from_u64(chaos.map_or(0, |c| c.seed)),
            pending: Vec::new(),
        }
    }

    /// The fault due at `now`, if any: its victim is chosen and hit through
    /// `sup` (the effect to run is returned), and its recovery awaited.
    pub(crate) async fn inject_due(
        &mut self,
        sup: &mut Supervisor,
        launch: &Launch,
        now: Instant,
    ) -> Option<Effect> {
        let fault = self.clock.due(now)?;
        let role = match fault {
            Fault::KillTrainer | Fault::StopTrainer => Role::Trainer,
            Fault::KillPserver => Role::Pserver,
            Fault::KillMaster => Role::Master,
        };
        let mut candidates = sup.victims(role);
        if role == Role::Trainer {
            let registered = self.registered_trainer_keys().await;
            candidates.retain(|&id| {
                sup.proc(id)
                    .is_some_and(|p| registered.contains(&self.trainer_key(&p.name)))
            });
        }
        let pick = match role {
            Role::Master => {
                // The leader first (the others keep their order).
                let leader = leader(self.backend.as_ref(), &self.keys)
                    .await
                    .map(|(_, v)| String::from_utf8_lossy(&v).into_owned());
                if let Some(leader) = leader {
                    candidates.sort_by_key(|&id| {
                        let addr = sup
                            .proc(id)
                            .and_then(|p| std::fs::read_to_string(launch.addr_file(&p.name)).ok());
                        addr.is_none_or(|a| a.trim() != leader)
                    });
                }
                *candidates.first()?
            }
            _ if candidates.is_empty() => return None,
            _ => candidates[self.rng.random_range(0..candidates.len())],
        };
        let p = sup.proc(pick)?.clone();
        let check = match role {
            Role::Trainer if fault == Fault::StopTrainer => Check::TrainerGone {
                key: self.trainer_key(&p.name),
            },
            Role::Trainer => Check::Trainer {
                key: self.trainer_key(&p.name),
                want: self.registered_trainer_keys().await.len(),
            },
            Role::Pserver => {
                let key = self.keys.ps(p.slot);
                let old_create = self
                    .backend
                    .get(&key)
                    .await
                    .ok()
                    .flatten()
                    .map_or(0, |kv| kv.create_revision);
                Check::Pserver { key, old_create }
            }
            Role::Master => Check::Master {
                old_leader: leader(self.backend.as_ref(), &self.keys)
                    .await
                    .map(|(k, _)| k.into_bytes()),
            },
        };
        let stop = fault == Fault::StopTrainer;
        // Measured from the fault itself, after the queries above.
        let now = Instant::now();
        let effect = sup.inject(pick, stop, now)?;
        let fault_name = if stop { "sigstop" } else { "sigkill" };
        tracing::warn!(process = %p.name, fault = fault_name, "chaos: injected");
        self.pending.push(Pending {
            fault: fault_name,
            role,
            process: p.name,
            at: now,
            check,
        });
        Some(effect)
    }

    /// Checks the faults not recovered from yet; each recovery is recorded in `sup`.
    pub(crate) async fn check_recoveries(&mut self, sup: &mut Supervisor) {
        let mut i = 0;
        while i < self.pending.len() {
            if self.recovered(&self.pending[i].check).await {
                let p = self.pending.remove(i);
                let secs = p.at.elapsed().as_secs_f64();
                tracing::info!(process = %p.process, fault = p.fault, seconds = secs, "recovered");
                sup.recovered(Recovery {
                    fault: p.fault.into(),
                    role: p.role.name().into(),
                    process: p.process,
                    seconds: secs,
                });
            } else {
                i += 1;
            }
        }
    }

    async fn recovered(&self, check: &Check) -> bool {
        match check {
            Check::Trainer { key, want } => {
                let gone = self.backend.get(key).await.is_ok_and(|kv| kv.is_none());
                gone && self.registered_trainer_keys().await.len() >= *want
            }
            Check::TrainerGone { key } => self.backend.get(key).await.is_ok_and(|kv| kv.is_none()),
            Check::Pserver { key, old_create } => {
                let claim = self.backend.get(key).await.ok().flatten();
                match claim.filter(|kv| kv.create_revision != *old_create) {
                    Some(kv) => match PserverRecord::decode(&kv.value) {
                        Ok(r) => edl_pserver::client::probe(
                            &r.addr,
                            self.job.as_str(),
                            None,
                            Duration::from_millis(500),
                        )
                        .await
                        .is_ok(),
                        Err(_) => true,
                    },
                    None => false,
                }
            }
            Check::Master { old_leader } => {
                let now = leader(self.backend.as_ref(), &self.keys)
                    .await
                    .map(|(k, _)| k.into_bytes());
                now.is_some() && now != *old_leader && self.quick_status().await.is_some()
            }
        }
    }

    /// The faults whose recovery was not seen, as `FAULT of ROLE PROCESS`.
    pub(crate) fn unrecovered(&self) -> Vec<String> {
        self.pending
            .iter()
            .map(|p| format!("{} of {} {}", p.fault, p.role.name(), p.process))
            .collect()
    }

    fn trainer_key(&self, name: &str) -> String {
        self.keys.trainer(name)
    }

    async fn registered_trainer_keys(&self) -> Vec<String> {
        self.backend
            .range(&self.keys.trainers())
            .await
            .map(|(kvs, _)| kvs.into_iter().map(|kv| kv.key).collect())
            .unwrap_or_default()
    }

    /// One short attempt (recovery checks must not stall the supervisor).
    async fn quick_status(&self) -> Option<StatusResponse> {
        let mut cfg = MasterClientConfig::new(self.job.clone());
        cfg.retry_for = Duration::from_millis(300);
        cfg.call_timeout = Duration::from_millis(300);
        MasterClient::new(self.backend.clone(), cfg, CancellationToken::new())
            .status()
            .await
            .ok()
    }
}

/// The leading master's election key and value (its address): the oldest key under
/// the election prefix, as `edl status` reads it.
async fn leader(backend: &dyn Backend, keys: &JobKeys) -> Option<(String, Vec<u8>)> {
    let (kvs, _) = backend.range(&keys.master_election()).await.ok()?;
    kvs.into_iter()
        .min_by_key(|kv| kv.create_revision)
        .map(|kv| (kv.key, kv.value))
}
