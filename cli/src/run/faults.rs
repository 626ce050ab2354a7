//! Fault injection (`--chaos`): choosing a victim; and measuring recoveries against
//! etcd, from injected faults and from crashes alike.
//!
//! - A trainer is a victim once registered (else its "recovery" is instant).
//! - The master hit is the leader: the value of the first key under the master
//!   election prefix (as `edl status` finds it) is the leader's address, and each
//!   master writes its address to `<run dir>/logs/<name>.addr`.
//! - Recovery, until the role serves again: see [`Check`]. An injected fault's is
//!   measured from the fault, a crash's (one that the supervisor restarts) from the
//!   moment its exit is seen; both are pending until seen, then recorded in the
//!   supervisor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use edl_coord::{Backend, Election};
use edl_job::{JobKeys, JobName, PserverRecord, Record};
use edl_master::queue::{Task, TaskState};
use edl_master_client::MasterClient;
use edl_proto::master::StatusResponse;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

use super::access::Access;
use super::chaos::{Action, Chaos, ChaosClock, Fault};
use super::procs::Launch;
use super::report::Recovery;
use super::supervisor::{Crash, Effect, Role, Supervisor, trainer_slot};

/// How soon a fault that found no victim is tried again.
const VICTIM_RETRY: Duration = Duration::from_secs(1);

/// How soon a stop or a notice of a trainer is tried again when no trainer held a task
/// (between passes, evaluating): soon, since tasks come and go quickly.
const HOLDER_RETRY: Duration = Duration::from_millis(200);

/// What recovery from a fault means, checked against etcd.
#[derive(Debug)]
enum Check {
    /// The trainer's registration is gone (its tasks are back in the queue) and a later
    /// trainer of its slot (its replacement, or one after it) is registered, or the slot
    /// is no longer wanted (a scale-down drained the replacement).
    Trainer {
        key: String,
        slot: u32,
        generation: u32,
    },
    /// The stopped trainer's registration is gone (its tasks are back in the queue).
    TrainerGone { key: String },
    /// The pserver shard is claimed again (a new claim) and the new pserver answers (it
    /// restored its checkpoint before serving).
    Pserver { key: String, old_create: i64 },
    /// A master leads (a leader key other than the one of the master hit, when that
    /// master led) and answers.
    Master { old_leader: Option<Vec<u8>> },
    /// A replicated shard's group changed since the fault and is whole again (its
    /// primary and `replicas - 1` in-sync backups, nobody joining), and its primary
    /// answers: a backup was promoted or a lost replica replaced, with nothing restored.
    Replicated {
        shard: u32,
        old_change: u64,
        replicas: u32,
    },
}

/// A fault or crash whose recovery has not been seen yet.
#[derive(Debug)]
struct Pending {
    /// `sigkill`, `sigstop`, `notice` or `crash`.
    fault: &'static str,
    role: Role,
    process: String,
    at: Instant,
    check: Check,
    /// A trainer's: the tasks it held at the fault (id and pass), when none of them
    /// was leased to it any more, and when they were all leased to another trainer or
    /// done (seconds after `at`).
    held: Vec<(String, u32)>,
    back: Option<f64>,
    again: Option<f64>,
    /// When the role served again (seconds after `at`).
    served: Option<f64>,
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
    /// How the recovery checks reach masters and pservers.
    access: Access,
}

impl Faults {
    /// The faults of `chaos` (none without), the first due one interval after
    /// `started`; victims drawn with its seed.
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        job: &JobName,
        chaos: Option<&Chaos>,
        started: Instant,
        access: Access,
    ) -> Faults {
        Faults {
            backend,
            access,
            keys: JobKeys::new(job),
            job: job.clone(),
            clock: ChaosClock::new(chaos, started),
            rng: rand::rngs::StdRng::seed_from_u64(chaos.map_or(0, |c| c.seed)),
            pending: Vec::new(),
        }
    }

    /// The fault due at `now`, if any: its victim is chosen and hit through
    /// `sup` (the effect to run is returned), and its recovery awaited. A fault that
    /// finds no victim is tried again a second later.
    pub(crate) async fn inject_due(
        &mut self,
        sup: &mut Supervisor,
        launch: &Launch,
        now: Instant,
    ) -> Option<Effect> {
        let fault = self.clock.due(now)?;
        match self.inject(fault, sup, launch).await {
            Ok(effect) => Some(effect),
            Err(retry) => {
                // No victim now (none registered, none holding a task, or etcd cannot
                // say): the fault waits.
                self.clock.defer(fault, now + retry);
                None
            }
        }
    }

    /// Hits a victim of `fault`: the effect to run, or when to try again.
    async fn inject(
        &mut self,
        fault: Fault,
        sup: &mut Supervisor,
        launch: &Launch,
    ) -> Result<Effect, Duration> {
        let Fault { action, role } = fault;
        if role == Role::Pserver
            && launch.replicas() > 1
            && self.pending.iter().any(|p| p.role == Role::Pserver)
        {
            // Replicas survive one loss at a time: a pserver is hit only once the last
            // one hit (or crashed) is back in sync, every group whole. A second loss
            // before that may be of a shard's last replica, which is a restore by
            // design (docs/replication.md), not a fault this chaos tests.
            return Err(VICTIM_RETRY);
        }
        let mut candidates = sup.victims(role);
        if role == Role::Trainer {
            let registered = self.registered_trainer_keys().await;
            candidates.retain(|&id| {
                sup.proc(id)
                    .is_some_and(|p| registered.contains(&self.trainer_key(&p.name)))
            });
            if matches!(action, Action::Stop | Action::Notice) && !candidates.is_empty() {
                // A stop tests the task timeout, a notice the hand-back: the victim is a
                // trainer holding a task (one stopped between tasks holds none, and only
                // its lease can tell; one given a notice between tasks has nothing to
                // hand back). None holds one now (between passes, evaluating): soon.
                let mut holding = Vec::new();
                for &id in &candidates {
                    if let Some(p) = sup.proc(id)
                        && !self.tasks_held(role, &p.name).await.is_empty()
                    {
                        holding.push(id);
                    }
                }
                if holding.is_empty() {
                    return Err(HOLDER_RETRY);
                }
                candidates = holding;
            }
        }
        let pick = match role {
            Role::Master => {
                // The leader first (the others keep their order).
                let leader = leader(&self.backend, &self.keys)
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
                *candidates.first().ok_or(VICTIM_RETRY)?
            }
            _ if candidates.is_empty() => return Err(VICTIM_RETRY),
            _ => candidates[self.rng.random_range(0..candidates.len())],
        };
        let p = sup.proc(pick).ok_or(VICTIM_RETRY)?.clone();
        let stop = action == Action::Stop;
        let check = self.check(role, p.slot, &p.name, stop, launch).await;
        let held = self.tasks_held(role, &p.name).await;
        // Measured from the fault itself, after the queries above.
        let now = Instant::now();
        let effect = sup.inject(pick, action, now).ok_or(VICTIM_RETRY)?;
        let fault_name = action.signal();
        tracing::warn!(process = %p.name, fault = fault_name, "chaos: injected");
        self.pending.push(Pending {
            fault: fault_name,
            role,
            process: p.name,
            at: now,
            check,
            held,
            back: None,
            again: None,
            served: None,
        });
        Ok(effect)
    }

    /// A crash that the supervisor restarts, seen at `at`: its recovery is awaited (the
    /// process is gone, so the check is taken from etcd as it is now).
    pub(crate) async fn crashed(&mut self, crash: Crash, launch: &Launch, at: Instant) {
        let check = self
            .check(crash.role, crash.slot, &crash.process, false, launch)
            .await;
        let held = self.tasks_held(crash.role, &crash.process).await;
        self.pending.push(Pending {
            fault: "crash",
            role: crash.role,
            process: crash.process,
            at,
            check,
            held,
            back: None,
            again: None,
            served: None,
        });
    }

    /// What recovery from a fault of process `name` of `role` in `slot` means, taken
    /// before the fault (or, for a crash, once its exit is seen): `stop` for a SIGSTOP.
    async fn check(&self, role: Role, slot: u32, name: &str, stop: bool, launch: &Launch) -> Check {
        let key = self.trainer_key(name);
        match (role, trainer_slot(name)) {
            (Role::Trainer, Some((slot, generation))) if !stop => Check::Trainer {
                key,
                slot,
                generation,
            },
            (Role::Trainer, _) => Check::TrainerGone { key },
            (Role::Pserver, _) if launch.replicas() > 1 => {
                let shard = launch.shard_of(slot);
                Check::Replicated {
                    shard,
                    old_change: self.group(shard).await.map_or(0, |g| g.change),
                    replicas: launch.replicas(),
                }
            }
            (Role::Pserver, _) => {
                let key = self.keys.ps(slot);
                let old_create = self
                    .backend
                    .get(&key)
                    .await
                    .ok()
                    .flatten()
                    .map_or(0, |kv| kv.create_revision);
                Check::Pserver { key, old_create }
            }
            (Role::Master, _) => {
                let addr = std::fs::read_to_string(launch.addr_file(name)).ok();
                let led = leader(&self.backend, &self.keys)
                    .await
                    .filter(|(_, v)| addr.is_some_and(|a| a.trim().as_bytes() == v.as_slice()));
                Check::Master {
                    old_leader: led.map(|(k, _)| k.into_bytes()),
                }
            }
        }
    }

    /// Checks the faults and crashes not recovered from yet; each recovery is recorded
    /// in `sup` once its role serves again and a trainer's tasks are leased again.
    pub(crate) async fn check_recoveries(&mut self, sup: &mut Supervisor) {
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            let served = match p.served {
                Some(s) => Some(s),
                None => self
                    .recovered(&p.check, sup)
                    .await
                    .then(|| p.at.elapsed().as_secs_f64()),
            };
            let (back, again) = match (p.back, p.again) {
                (_, Some(a)) => (p.back.or(Some(a)), Some(a)),
                _ if p.held.is_empty() => (None, None),
                (back, None) => {
                    let (gone, elsewhere) = self.leased_again(&p.held, &p.process).await;
                    let now = || Some(p.at.elapsed().as_secs_f64());
                    (
                        back.or_else(|| gone.then(now).flatten()),
                        elsewhere.then(now).flatten(),
                    )
                }
            };
            let p = &mut self.pending[i];
            (p.served, p.back, p.again) = (served, back, again);
            if served.is_some() && (p.held.is_empty() || again.is_some()) {
                let p = self.pending.remove(i);
                record(sup, p);
            } else {
                i += 1;
            }
        }
    }

    /// At the run's end: the faults whose role serves again but whose tasks were not
    /// leased again (the job ended first) are recorded without that time.
    pub(crate) fn settle(&mut self, sup: &mut Supervisor) {
        let (done, left): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| p.served.is_some());
        self.pending = left;
        for p in done {
            record(sup, p);
        }
    }

    /// The tasks a trainer holds now (id and pass), from the queue's records in etcd;
    /// none for other roles.
    async fn tasks_held(&self, role: Role, name: &str) -> Vec<(String, u32)> {
        if role != Role::Trainer {
            return Vec::new();
        }
        let Ok((kvs, _)) = self.backend.range(&self.keys.tasks()).await else {
            return Vec::new();
        };
        kvs.iter()
            .filter_map(|kv| serde_json::from_slice::<Task>(&kv.value).ok())
            .filter(|t| matches!(&t.state, TaskState::Pending { trainer, .. } if trainer == name))
            .map(|t| (t.spec.id, t.pass))
            .collect()
    }

    /// Whether none of `held` is leased to `victim` any more (back in the queue,
    /// leased to another trainer, done, or of a later pass), and whether every one is
    /// leased to a trainer other than `victim`, done, or of a later pass (done in its
    /// own). Neither when etcd cannot say.
    async fn leased_again(&self, held: &[(String, u32)], victim: &str) -> (bool, bool) {
        let (mut back, mut again) = (true, true);
        for (id, pass) in held {
            let task = match self.backend.get(&self.keys.task(id)).await {
                Ok(Some(kv)) => serde_json::from_slice::<Task>(&kv.value).ok(),
                Ok(None) => None,
                Err(_) => return (false, false),
            };
            let Some(t) = task else { continue };
            let (gone, elsewhere) = match &t.state {
                _ if t.pass > *pass => (true, true),
                TaskState::Pending { trainer, .. } => (trainer != victim, trainer != victim),
                TaskState::Todo => (true, false),
                TaskState::Done | TaskState::Failed => (true, true),
            };
            back &= gone;
            again &= elsewhere;
        }
        (back, again)
    }

    async fn recovered(&self, check: &Check, sup: &Supervisor) -> bool {
        match check {
            Check::Trainer {
                key,
                slot,
                generation,
            } => {
                let gone = self.backend.get(key).await.is_ok_and(|kv| kv.is_none());
                // A scale-down may drain the replacement before it registers: the
                // slot is then no longer wanted, which ends the fault too.
                gone && (sup.slot_retired(Role::Trainer, *slot)
                    || self.registered_trainer_keys().await.iter().any(|k| {
                        self.keys
                            .trainer_id(k)
                            .and_then(trainer_slot)
                            .is_some_and(|(s, g)| s == *slot && g > *generation)
                    }))
            }
            Check::TrainerGone { key } => self.backend.get(key).await.is_ok_and(|kv| kv.is_none()),
            Check::Pserver { key, old_create } => self.claim_serves(key, *old_create).await,
            Check::Replicated {
                shard,
                old_change,
                replicas,
            } => {
                let whole = self.group(*shard).await.is_some_and(|g| {
                    g.change > *old_change
                        && g.joining.is_empty()
                        && g.backups.len() + 1 == *replicas as usize
                });
                whole && self.claim_serves(&self.keys.ps(*shard), -1).await
            }
            Check::Master { old_leader } => {
                let now = leader(&self.backend, &self.keys)
                    .await
                    .map(|(k, _)| k.into_bytes());
                now.is_some() && now != *old_leader && self.quick_status().await.is_some()
            }
        }
    }

    /// Whether `key` is claimed by a claim other than `old_create`'s and its pserver
    /// answers.
    async fn claim_serves(&self, key: &str, old_create: i64) -> bool {
        let claim = self.backend.get(key).await.ok().flatten();
        match claim.filter(|kv| kv.create_revision != old_create) {
            Some(kv) => match PserverRecord::decode(&kv.value) {
                Ok(r) => edl_pserver_client::probe(
                    &r.addr,
                    self.job.as_str(),
                    self.access.token.as_deref(),
                    self.access.tls(),
                    Duration::from_millis(500),
                )
                .await
                .is_ok(),
                Err(_) => true,
            },
            None => false,
        }
    }

    /// Shard `shard`'s replica group, as etcd holds it.
    async fn group(&self, shard: u32) -> Option<edl_job::GroupRecord> {
        let kv = self.backend.get(&self.keys.ps_group(shard)).await.ok()??;
        edl_job::GroupRecord::decode(&kv.value).ok()
    }

    /// The faults and crashes whose recovery was not seen, as `FAULT of ROLE PROCESS`.
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
        let mut cfg = self.access.master_client(&self.job);
        cfg.retry_for = Duration::from_millis(300);
        cfg.call_timeout = Duration::from_millis(300);
        MasterClient::new(self.backend.clone(), cfg, CancellationToken::new())
            .status()
            .await
            .ok()
    }
}

/// Records `p`'s recovery in `sup`.
fn record(sup: &mut Supervisor, p: Pending) {
    let seconds = p.served.unwrap_or_else(|| p.at.elapsed().as_secs_f64());
    tracing::info!(process = %p.process, fault = p.fault, seconds, task_back_s = ?p.back, task_again_s = ?p.again, "recovered");
    sup.recovered(Recovery {
        fault: p.fault.into(),
        role: p.role.name().into(),
        process: p.process,
        seconds,
        task_back_s: p.back,
        task_again_s: p.again,
    });
}

/// The leading master's election key and value (its address): the oldest key under
/// the election prefix, as `edl status` reads it.
async fn leader(backend: &Arc<dyn Backend>, keys: &JobKeys) -> Option<(String, Vec<u8>)> {
    let l = Election::new(backend.clone(), keys.master_election())
        .leader()
        .await
        .ok()??;
    Some((l.key, l.value))
}
