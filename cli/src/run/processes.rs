//! The etcd mode: every role a child process, driven by the [`Supervisor`] state
//! machine. This is its shell: it turns exits, the clock, `edl scale`/`edl kill`, the
//! autoscaler's answers and due faults into events, and runs the effects on real processes.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_coord::Backend;
use edl_job::holders::Holder;
use edl_job::{ControlRecord, JobKeys, JobSpec, Record, ScaleRecord};
use edl_master_client::MasterClient;
use edl_proto::master::StatusResponse;
use edl_pserver_client::PsClient;
use edl_trainer::DeviceChoice;
use tokio_util::sync::CancellationToken;

use super::autoscale::{JobNow, LocalAutoscaler, progress};
use super::chaos::Chaos;
use super::display::Display;
use super::faults::Faults;
use super::lifecycle::{Evaluator, final_params, prepare_job, record_end};
use super::procs::{Children, Launch, TrainerProgram, log_tail};
use super::report::{FinalMetric, Outcome};
use super::supervisor::{Effect, Limits, ProcId, Role, Stuck, Supervisor};

/// How often etcd is asked for `edl kill`, `edl scale` and the master's status.
const POLL: Duration = Duration::from_millis(500);
/// The supervisor's tick.
const TICK: Duration = Duration::from_millis(100);

/// What the etcd mode runs.
#[derive(Debug)]
pub(crate) struct ProcessRun {
    pub spec: JobSpec,
    pub backend: Arc<dyn Backend>,
    pub endpoints: Vec<String>,
    pub run_dir: PathBuf,
    pub device: DeviceChoice,
    /// What runs as each trainer.
    pub trainer: TrainerProgram,
    pub chaos: Option<Chaos>,
    /// `etcd` or `private-etcd`.
    pub coordination: String,
    /// `--autoscale`: the cores it may fill.
    pub autoscale_cores: Option<u32>,
    /// The token, TLS and etcd credentials of the job's processes.
    pub access: super::access::Access,
}

/// The shell around the supervisor.
struct Shell {
    spec: JobSpec,
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    launch: Launch,
    sup: Supervisor,
    children: Children,
    faults: Faults,
    /// Since when etcd has answered the registration check without a gap.
    etcd_since: Instant,
    /// `--autoscale`.
    autoscaler: Option<LocalAutoscaler>,
    /// Pservers seen holding their claim or replica registration, and those of them
    /// seen holding nothing at the last look (`restart_unclaimed_pservers`).
    claimed: BTreeSet<ProcId>,
    unclaimed: BTreeSet<ProcId>,
}

/// Runs the job as processes until it ends, stops everything, and records the end.
pub(crate) async fn run(
    job: ProcessRun,
    shutdown: &CancellationToken,
    started: Instant,
    quiet: bool,
    timeout: Duration,
) -> Outcome {
    let c = &job.spec.cluster;
    let limits = Limits {
        masters: c.masters,
        // Every replica of every shard is a process slot.
        pservers: c.pservers * c.pserver_replicas,
        trainers: c.trainers,
        min_trainers: c.min_trainers,
        max_trainers: c.max_trainers(),
        max_restarts: c.max_restarts,
        healthy_after: c.healthy_after,
        lease_ttl: c.lease_ttl,
        register_within: job.spec.trainer.register_within(),
        notice_deadline: job
            .chaos
            .as_ref()
            .map_or(super::chaos::NOTICE_DEADLINE, Chaos::notice_deadline),
    };
    let mut shell = Shell {
        keys: JobKeys::new(&job.spec.name),
        launch: Launch::new(
            &job.spec,
            &job.endpoints,
            &job.run_dir,
            job.device,
            job.trainer.clone(),
            job.access.clone(),
        ),
        sup: Supervisor::new(limits, job.run_dir.join("logs"), started),
        children: Children::default(),
        faults: Faults::new(
            job.backend.clone(),
            &job.spec.name,
            job.chaos.as_ref(),
            started,
            job.access.clone(),
        ),
        spec: job.spec,
        backend: job.backend,
        etcd_since: Instant::now(),
        autoscaler: job
            .autoscale_cores
            .map(|cores| LocalAutoscaler::new(cores, started)),
        claimed: BTreeSet::new(),
        unclaimed: BTreeSet::new(),
    };
    // The final parameters and evaluation come from the pservers while they run.
    let supervised = shell.supervise(shutdown, started, quiet, timeout).await;
    let (error, (metric, params_file)) = match supervised {
        Ok(Ok(fin)) => (None, fin),
        Ok(Err(e)) => {
            tracing::warn!(error = %format!("{e:#}"), "final evaluation");
            (None, (None, None))
        }
        Err(e) => (Some(format!("{e:#}")), (None, None)),
    };
    let status = shell.status().await;
    shell.stop_all().await;
    shell.faults.settle(&mut shell.sup);
    let mut outcome = Outcome {
        job: shell.spec.name.to_string(),
        coordination: job.coordination,
        error,
        status,
        final_metric: metric,
        params_file,
        recoveries: shell.sup.recoveries().to_vec(),
        unrecovered: shell.faults.unrecovered(),
        restarts: shell.sup.restarts(),
        preemptions: shell.sup.preemptions(),
        notices_past_deadline: shell.sup.notices_past_deadline(),
        scale_events: shell.sup.scale_events().to_vec(),
        run_dir: job.run_dir.display().to_string(),
        wall_s: 0.0,
    };
    outcome.settle_error();
    record_end(&shell.backend, &shell.keys, outcome.error.as_deref()).await;
    outcome.wall_s = started.elapsed().as_secs_f64();
    outcome
}

/// The final metric and the final parameters' file.
type Final = (Option<FinalMetric>, Option<String>);

/// How the end of a job settled (see [`Shell::settle`]).
enum End {
    /// The final parameters contain every task of every pass; pulled and evaluated.
    Complete(anyhow::Result<Final>),
    /// A pserver restored since the master finished lacks some of that training: the
    /// master trains it again.
    Reopened,
}

impl Shell {
    /// Supervises the job until it ends; then the final parameters (or why they could
    /// not be evaluated).
    async fn supervise(
        &mut self,
        shutdown: &CancellationToken,
        started: Instant,
        quiet: bool,
        timeout: Duration,
    ) -> anyhow::Result<anyhow::Result<Final>> {
        prepare_job(&self.backend, &self.spec, &self.launch.run_dir).await?;
        let start = self.sup.start(Instant::now());
        self.apply(start)?;
        let mut display = Display::new(quiet);
        let mut last_poll = Instant::now() - Duration::from_secs(10);
        let control_key = self.keys.control();
        let scale_key = self.keys.scale_trainers();
        loop {
            if shutdown.is_cancelled() {
                anyhow::bail!("interrupted");
            }
            anyhow::ensure!(
                started.elapsed() < timeout,
                "the job did not finish within {timeout:?}"
            );
            self.step(false).await?;
            if let Some(effect) = self
                .faults
                .inject_due(&mut self.sup, &self.launch, Instant::now())
                .await
            {
                self.apply(vec![effect])?;
            }
            if last_poll.elapsed() >= POLL {
                last_poll = Instant::now();
                if let Ok(Some(kv)) = self.backend.get(&control_key).await
                    && ControlRecord::decode(&kv.value)
                        .is_ok_and(|c| c.command == edl_job::Control::Stop)
                {
                    anyhow::bail!("stopped by `edl kill`");
                }
                if let Ok(Some(kv)) = self.backend.get(&scale_key).await
                    && let Ok(ScaleRecord { trainers: n, .. }) = ScaleRecord::decode(&kv.value)
                {
                    let scale = self.sup.scale(n, Instant::now());
                    self.apply(scale)?;
                }
                self.check_registrations().await?;
                let status = self.status().await;
                self.restart_unclaimed_pservers().await?;
                if let Some(s) = &status {
                    self.restart_stuck(s)?;
                }
                let alive = self.registered_trainers().await;
                self.autoscale(status.as_ref(), alive).await?;
                display.update(
                    status.as_ref(),
                    alive,
                    self.sup.restarts(),
                    self.sup.recoveries(),
                );
                if let Some(s) = &status
                    && s.finished
                {
                    // Trainers stop on their own at the end of the job; pservers killed
                    // near the end come back (the final parameters are pulled from them).
                    let deadline = Instant::now() + Duration::from_secs(60);
                    loop {
                        self.step(true).await?;
                        if !self.sup.draining() || Instant::now() >= deadline {
                            break;
                        }
                        tokio::time::sleep(TICK).await;
                    }
                    match self.settle(s.passes).await? {
                        End::Complete(fin) => {
                            display.finish();
                            return Ok(fin);
                        }
                        End::Reopened => {
                            tracing::warn!(
                                "a pserver restored after the job finished lacks training; \
                                 the master trains it again: trainers restarted"
                            );
                            let resume = self.sup.resume_trainers(Instant::now());
                            self.apply(resume)?;
                        }
                    }
                }
            }
            tokio::time::sleep(TICK).await;
        }
    }

    /// Once the master says the job finished: makes sure the pservers' parameters hold
    /// every task of every pass (each shard's ledger has all `passes` sealed) before and
    /// after the final parameters are pulled and evaluated, with no pserver restored in
    /// between. A shard that lacks some (restored, after the master finished, from a
    /// checkpoint older than its last updates) makes the master train them again
    /// ([`End::Reopened`]). Tasks failed for good (lost records, reported as such) are
    /// settled in every ledger (the shards follow the master's `job/failed/` records), so
    /// completeness is asked for then too.
    async fn settle(&mut self, passes: u32) -> anyhow::Result<End> {
        const WITHIN: Duration = Duration::from_secs(120);
        let cancel = CancellationToken::new();
        let _guard = cancel.clone().drop_guard();
        let mut cfg = self.launch.access.ps_client(&self.spec.name);
        cfg.retry_for = Duration::from_secs(5);
        let client = PsClient::connect(self.backend.clone(), cfg, cancel.child_token())
            .await
            .context("connect to the pservers for the final parameters")?;
        let deadline = Instant::now() + WITHIN;
        let mut seen = None;
        loop {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the job's end did not settle within {WITHIN:?}: {}",
                seen.unwrap_or_else(|| "no answer from every pserver".to_owned())
            );
            self.step(true).await?;
            let before = ledgers(&client).await;
            let status = self.status().await;
            match (&before, &status) {
                (Some(l), Some(s)) => {
                    if !s.finished {
                        return Ok(End::Reopened);
                    }
                    let lacking: Vec<u32> = l
                        .iter()
                        .enumerate()
                        .filter(|(_, (_, sealed))| *sealed < passes)
                        .map(|(i, _)| i as u32)
                        .collect();
                    if lacking.is_empty() {
                        let evaluator = if self.launch.trainer.entry {
                            Evaluator::Entry(&self.launch)
                        } else {
                            Evaluator::Builtin(self.launch.device)
                        };
                        let fin = final_params(
                            &self.backend,
                            &self.spec,
                            &self.launch.run_dir,
                            evaluator,
                            &self.launch.access,
                        )
                        .await;
                        if ledgers(&client).await.as_ref() == Some(l) {
                            return Ok(End::Complete(fin));
                        }
                        seen = Some(
                            "a pserver was restored while the final parameters were pulled".into(),
                        );
                    } else {
                        // The master has yet to see the restore (it reopens the job), or
                        // the shards have yet to settle a task failed for good.
                        seen = Some(format!(
                            "shards {lacking:?} lack training the master counts as done or failed"
                        ));
                    }
                }
                _ => seen = Some("waiting for the master and every pserver to answer".into()),
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// One tick: exits reaped (a crash's recovery awaited before its restart),
    /// stopped processes resumed, restarts that are due started (trainers' too unless
    /// `skip_trainers`), recoveries checked.
    async fn step(&mut self, skip_trainers: bool) -> anyhow::Result<()> {
        for (id, status, pid) in self.children.exited()? {
            if let Some(p) = self.sup.proc(id) {
                self.release(p.role, &p.name.clone(), pid).await;
            }
            let success = status.success();
            let job_finished = self.sup.exit_needs_job_status(id, success)
                && self.status().await.is_some_and(|s| s.finished);
            let seen = Instant::now();
            let name = self.sup.proc(id).map(|p| p.name.clone());
            let crash = self
                .sup
                .exited(id, success, &status.to_string(), job_finished, seen)
                .map_err(|e| {
                    let tail = name.as_deref().map(|n| log_tail(&self.launch.log_path(n)));
                    anyhow::anyhow!("{e:#}\n{}", tail.unwrap_or_default())
                })?;
            if let Some(crash) = crash {
                if !crash.healthy {
                    tracing::warn!(
                        process = %crash.process,
                        "it failed before it was healthy ({status});\n{}",
                        log_tail(&self.launch.log_path(&crash.process))
                    );
                }
                self.faults.crashed(crash, &self.launch, seen).await;
            }
        }
        let tick = self.sup.tick(Instant::now(), skip_trainers);
        self.apply(tick)?;
        self.faults.check_recoveries(&mut self.sup).await;
        Ok(())
    }

    /// The trainers the master names stuck (alive, no report on a task for the task
    /// timeout; their tasks are already handed out again) are SIGKILLed, so that they
    /// are restarted (`Supervisor::stuck`).
    fn restart_stuck(&mut self, status: &StatusResponse) -> anyhow::Result<()> {
        let names: Vec<String> = status.stuck.iter().map(|t| t.trainer.clone()).collect();
        for (effect, name) in self.sup.stuck(&names, Stuck::NoProgress) {
            let task = status.stuck.iter().find(|t| t.trainer == name);
            tracing::warn!(
                process = %name,
                task = task.map_or("", |t| t.task.as_str()),
                held_s = task.map_or(0.0, |t| t.held_ms as f64 / 1000.0),
                "stuck: no report on its task for the task timeout; killing it to restart it"
            );
            self.apply(vec![effect])?;
        }
        Ok(())
    }

    /// The pservers whose process lives but whose claim (or replica registration) is
    /// gone since the last look, having held one before: stopped or hung past their
    /// lease, they would hold their shard up until they answer again (a hang: for ever).
    /// Each is SIGKILLed to be restarted at once (`Supervisor::stuck`); its replacement
    /// claims the shard. A pserver that has not claimed yet (starting, waiting for its
    /// shard) is left alone, and so is everything while etcd cannot be read.
    async fn restart_unclaimed_pservers(&mut self) -> anyhow::Result<()> {
        let live: Vec<(ProcId, String, u32)> = self
            .sup
            .ids(Role::Pserver)
            .into_iter()
            .filter_map(|id| {
                let name = self.sup.proc(id)?.name.clone();
                Some((id, name, self.children.pid(id)?))
            })
            .collect();
        // Forget the processes gone.
        self.claimed.retain(|id| live.iter().any(|(l, ..)| l == id));
        self.unclaimed
            .retain(|id| live.iter().any(|(l, ..)| l == id));
        let mut kvs = Vec::new();
        for prefix in (Holder::Pserver {
            pid: None,
            addr: None,
            instance: None,
        })
        .prefixes(&self.keys)
        {
            match self.backend.range(&prefix).await {
                Ok((mut more, _)) => kvs.append(&mut more),
                Err(_) => return Ok(()),
            }
        }
        let mut lost = Vec::new();
        for (id, name, pid) in live {
            let holder = Holder::Pserver {
                pid: Some(pid),
                addr: None,
                instance: None,
            };
            let holds = !edl_job::holders::leases_held(&self.keys, &holder, &kvs).is_empty();
            match (
                holds,
                self.claimed.contains(&id),
                self.unclaimed.contains(&id),
            ) {
                (true, ..) => {
                    self.claimed.insert(id);
                    self.unclaimed.remove(&id);
                }
                // Gone at two looks in a row: not a record being rewritten.
                (false, true, true) => lost.push(name),
                (false, true, false) => {
                    self.unclaimed.insert(id);
                }
                (false, false, _) => {}
            }
        }
        for (effect, name) in self.sup.stuck(&lost, Stuck::ClaimLost) {
            tracing::warn!(process = %name, "stuck: its shard's lease ended while it lived; killing it to restart it");
            self.apply(vec![effect])?;
        }
        Ok(())
    }

    /// Process `name` of `role` (`pid`) was seen dead: the etcd leases it held are
    /// revoked at once ([`edl_job::holders`]), so the master hands its tasks out again,
    /// its shard is claimed or its replica replaced, or a standby master leads, now
    /// instead of a lease TTL later. Best effort, within a second: what is not revoked
    /// expires.
    async fn release(&self, role: Role, name: &str, pid: u32) {
        let addr = std::fs::read_to_string(self.launch.addr_file(name)).ok();
        let holder = match (role, addr) {
            (Role::Trainer, _) => Holder::Trainer { id: name.into() },
            (Role::Pserver, _) => Holder::Pserver {
                pid: Some(pid),
                addr: None,
                instance: None,
            },
            (Role::Master, Some(addr)) => Holder::Master {
                addr: Some(addr.trim().into()),
                instance: None,
            },
            (Role::Master, None) => return,
        };
        let revoked = tokio::time::timeout(
            Duration::from_secs(1),
            edl_job::holders::revoke_held(&self.backend, &self.keys, &holder),
        )
        .await;
        match revoked {
            Ok(Ok(leases)) if !leases.is_empty() => {
                tracing::info!(process = %name, ?leases, "exited: the leases it held are revoked");
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(process = %name, error = %e, "exited: its leases expire instead");
            }
            Err(_) => tracing::debug!(process = %name, "exited: its leases expire instead"),
        }
    }

    /// Runs the supervisor's effects.
    fn apply(&mut self, effects: Vec<Effect>) -> anyhow::Result<()> {
        for effect in effects {
            match effect {
                Effect::Spawn {
                    id,
                    role,
                    slot,
                    name,
                } => self.children.spawn(
                    &self.launch,
                    id,
                    role,
                    slot,
                    &name,
                    self.sup.desired_trainers(),
                )?,
                Effect::Signal { id, sig } => self.children.signal(id, sig),
                Effect::Kill { id } => self.children.kill(id),
            }
        }
        Ok(())
    }

    /// Stops every process: trainers first (they drain), then pservers and masters;
    /// each role is given 40 s, then killed.
    async fn stop_all(&mut self) {
        for role in [Role::Trainer, Role::Pserver, Role::Master] {
            let ids = self.sup.ids(role);
            let stop = self.sup.stop(role);
            // Signals only: nothing to fail.
            let _ = self.apply(stop);
            let deadline = Instant::now() + Duration::from_secs(40);
            while self.children.running(&ids) > 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            self.children.kill_and_reap(&ids);
        }
        self.sup.clear();
    }

    async fn status(&self) -> Option<StatusResponse> {
        let mut cfg = self.launch.access.master_client(&self.spec.name);
        cfg.retry_for = Duration::from_secs(2);
        cfg.call_timeout = Duration::from_secs(2);
        MasterClient::new(self.backend.clone(), cfg, CancellationToken::new())
            .status()
            .await
            .ok()
    }

    /// Marks the trainers registered in etcd; kills those that have not registered
    /// within `trainer.register_within` (said with the tail of their log).
    async fn check_registrations(&mut self) -> anyhow::Result<()> {
        let names = match self.backend.range(&self.keys.trainers()).await {
            Ok((kvs, _)) => kvs
                .iter()
                .filter_map(|kv| kv.key.rsplit('/').next().map(str::to_owned))
                .collect::<Vec<_>>(),
            Err(_) => {
                // etcd is away: nobody can register; the deadline restarts when it is back.
                self.etcd_since = Instant::now();
                return Ok(());
            }
        };
        let kills = self
            .sup
            .registrations(&names, self.etcd_since, Instant::now());
        for (effect, name) in kills {
            tracing::warn!(
                process = %name,
                "it has not registered with the job within trainer.register_within ({}): \
                 killing it (is the program an edl trainer? does it call edl_trainer::main?)\n{}",
                humantime::format_duration(self.spec.trainer.register_within()),
                log_tail(&self.launch.log_path(&name))
            );
            self.apply(vec![effect])?;
        }
        Ok(())
    }

    /// `--autoscale`: when a decision is due, asks the autoscaler and applies a new count
    /// as `edl scale` would (the `scale/trainers` key, then the supervisor).
    async fn autoscale(
        &mut self,
        status: Option<&StatusResponse>,
        registered: usize,
    ) -> anyhow::Result<()> {
        let now = Instant::now();
        let Some(a) = self.autoscaler.as_mut().filter(|a| a.due(now)) else {
            return Ok(());
        };
        if status.is_some_and(|s| s.finished) {
            return Ok(());
        }
        let c = &self.spec.cluster;
        let desired = self.sup.desired_trainers();
        let job = JobNow {
            min: c.min_trainers,
            max: c.max_trainers(),
            desired,
            alive: desired,
            registered: u32::try_from(registered).unwrap_or(u32::MAX),
            pservers: c.pservers * c.pserver_replicas,
            progress: status.and_then(progress),
        };
        let Some(to) = a.decide(now, &job) else {
            return Ok(());
        };
        let written = self
            .backend
            .put(
                &self.keys.scale_trainers(),
                ScaleRecord::new(to).encode(),
                None,
            )
            .await;
        match written {
            Ok(_) => {
                tracing::info!(from = desired, to, "autoscaler: trainers");
                let scale = self.sup.scale(to, now);
                self.apply(scale)?;
            }
            Err(e) => {
                tracing::warn!(error = %e, to, "autoscaler: cannot write scale/trainers; asked again later");
            }
        }
        Ok(())
    }

    async fn registered_trainers(&self) -> usize {
        self.backend
            .range(&self.keys.trainers())
            .await
            .map_or(0, |(kvs, _)| kvs.len())
    }
}

/// Each shard's incarnation (the create revision of the claim it was restored under) and
/// the passes its ledger holds whole; `None` unless every shard answers.
async fn ledgers(client: &PsClient) -> Option<Vec<(i64, u32)>> {
    client
        .status()
        .await
        .into_iter()
        .map(|r| {
            r.ok()
                .filter(|s| s.initialised)
                .map(|s| (s.incarnation, s.passes_contained))
        })
        .collect()
}
