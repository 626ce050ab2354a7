//! A lone trainer under an additive rule (plain SGD) skips the pull after its pushes and
//! hands runs over at the cap; another writer's update between two of its pushes, or a
//! rule that is not additive (weight decay), brings back the pull after every push and the
//! adaptive hand-over.
//!
//! (The pipeline runs stateless rules only: see `runtime::local_updates`. SGD with weight
//! decay is stateless and not additive.)

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use edl_job::spec::per_push::ADAPTIVE_MAX_BATCHES;
use edl_pserver_client::{OptimizerConfig, Origin};

use super::*;
use crate::model::{Params, StepOutput};
use crate::runtime::pipeline::{PUSH_WINDOW, SOLE_STREAK};
use crate::store::{ParamInit, ParamStore, Position, StoreError};

/// A [`LocalStore`] that counts the pipeline's pulls and records its pushes' runs; with
/// `other_every` > 0, another trainer pushes zero gradients before every
/// `other_every`th push (an update between this trainer's, changing no value).
#[derive(Debug)]
struct Counting {
    inner: LocalStore,
    other_every: u64,
    pulls: AtomicU64,
    pushes: AtomicU64,
    /// What happened, in order: `o` another trainer's push, `P` a push of the
    /// pipeline's, `l` a pull.
    events: Mutex<String>,
    /// Per task (pass, index): the runs pushed, by first batch: their length.
    runs: Mutex<BTreeMap<(u32, u32), BTreeMap<u32, u32>>>,
}

impl Counting {
    fn new(inner: LocalStore, other_every: u64) -> Self {
        Counting {
            inner,
            other_every,
            pulls: AtomicU64::new(0),
            pushes: AtomicU64::new(0),
            events: Mutex::new(String::new()),
            runs: Mutex::new(BTreeMap::new()),
        }
    }
}

#[async_trait::async_trait]
impl ParamStore for Counting {
    async fn init(
        &self,
        trainer: &str,
        params: &ParamInit,
    ) -> Result<crate::store::InitOutcome, StoreError> {
        self.inner.init(trainer, params).await
    }
    async fn pull_dense(&self, params: &mut Params) -> Result<(), StoreError> {
        self.inner.pull_dense(params).await
    }
    async fn pull_sparse(
        &self,
        rows: &[(String, Vec<u64>)],
        params: &mut Params,
    ) -> Result<(), StoreError> {
        self.inner.pull_sparse(rows, params).await
    }
    async fn push(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: &StepOutput,
    ) -> Result<(), StoreError> {
        self.inner.push(trainer, step, origin, grads).await
    }
    async fn push_applied(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: StepOutput,
    ) -> Result<Position, StoreError> {
        let n = self.pushes.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(o) = origin {
            let mut runs = self.runs.lock().unwrap();
            runs.entry((o.pass, o.task))
                .or_default()
                .insert(o.seq, o.count);
        }
        if self.other_every > 0 && n.is_multiple_of(self.other_every) {
            let mut zero = grads.clone();
            zero.dense.iter_mut().for_each(|g| g.fill(0.0));
            self.inner.push("other", n, None, &zero).await?;
            self.events.lock().unwrap().push('o');
        }
        let at = self.inner.push_applied(trainer, step, origin, grads).await;
        self.events.lock().unwrap().push('P');
        at
    }
    async fn pull_current(&self, params: &mut Params) -> Result<Position, StoreError> {
        self.pulls.fetch_add(1, Ordering::SeqCst);
        self.events.lock().unwrap().push('l');
        self.inner.pull_current(params).await
    }
    fn local_updates(&self) -> Option<OptimizerConfig> {
        self.inner.local_updates()
    }
}

/// One trainer fits a line in tasks of a whole file (17 batches of 8) with `kind`:
/// its progress and the store.
async fn alone(kind: OptimizerKind, other_every: u64) -> (Progress, Arc<Counting>) {
    let (train, _) = split_every(&boston(), 5);
    let inner = LocalStore::new(line_model(&train), kind, 0.01, 3);
    let store = Arc::new(Counting::new(inner.clone(), other_every));
    let (_, p) = alone_on_a_line(store.clone(), &inner, PerPush::Adaptive, 1_000).await;
    (p, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_trainer_under_sgd_pulls_once_a_task_and_hands_runs_over_at_the_cap() {
    let (p, store) = alone(OptimizerKind::sgd(), 0).await;
    let pulls = store.pulls.load(Ordering::SeqCst);
    let pushes = store.pushes.load(Ordering::SeqCst);
    // The runtime's pull before the pipeline starts, one at each task's start, and at
    // most one after the first push (whose answer follows no earlier one of the pipeline's).
    assert!(
        pulls <= p.tasks + 2,
        "{pulls} pulls for {} tasks and {pushes} pushes",
        p.tasks
    );
    let runs = store.runs.lock().unwrap();
    assert_eq!(runs.len() as u64, p.tasks);
    // Every run but a task's last is of the cap (the last: what the task had left),
    // except the first pushes': until SOLE_STREAK pushes in a row followed the answers
    // before them (the first push follows none of the pipeline's).
    let (mut capped, mut short) = (0, Vec::new());
    for (task, runs) in runs.iter() {
        let lens: Vec<u32> = runs.values().copied().collect();
        let (last, whole) = lens.split_last().expect("a task pushes");
        assert!(
            *last <= ADAPTIVE_MAX_BATCHES,
            "task {task:?}: runs {lens:?}"
        );
        capped += whole.iter().filter(|&&n| n == ADAPTIVE_MAX_BATCHES).count();
        short.extend(
            whole
                .iter()
                .filter(|&&n| n != ADAPTIVE_MAX_BATCHES)
                .map(|n| (task, *n)),
        );
    }
    assert!(
        short.len() as u32 <= SOLE_STREAK + 1,
        "runs cut before the cap, not a task's last: {short:?}"
    );
    // Witness: the tasks were longer than the cap, and runs were cut at it.
    assert!(capped as u64 >= p.tasks / 2, "{capped} runs at the cap");
}

/// How many of the pushes `events` marks with `after` (`o`: those another trainer's
/// update came before; `P`: every push) were followed by a pull within the next
/// `PUSH_WINDOW + 1` pushes, and how many were not (the job's last pushes not counted).
/// (The pull due after a push goes after the pushes already handed over, up to
/// [`PUSH_WINDOW`], when the pull before it has not been swapped in yet: see `comm`.)
fn pulled_after(events: &str, after: char) -> (usize, usize) {
    let b = events.as_bytes();
    let (mut pulled, mut not) = (0, 0);
    for (i, &e) in b.iter().enumerate() {
        let push = match after {
            'o' if e == b'o' => i + 1,
            'P' if e == b'P' => i,
            _ => continue,
        };
        let rest = &b[push + 1..];
        let Some(second) = rest
            .iter()
            .enumerate()
            .filter(|(_, e)| **e == b'P')
            .nth(PUSH_WINDOW as usize)
            .map(|(j, _)| j)
        else {
            continue;
        };
        if rest[..second].contains(&b'l') {
            pulled += 1;
        } else {
            not += 1;
        }
    }
    (pulled, not)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_writers_update_or_a_rule_that_is_not_additive_brings_the_pulls_back() {
    // Another trainer's update before every other push: each of those is followed by
    // a pull (the working copy would miss the update otherwise).
    let (_, store) = alone(OptimizerKind::sgd(), 2).await;
    let events = store.events.lock().unwrap().clone();
    let (pulled, not) = pulled_after(&events, 'o');
    assert_eq!(not, 0, "{events}");
    assert!(
        pulled >= 10,
        "witness: {pulled} pushes after another's update: {events}"
    );
    // SGD with weight decay: a pull after every push.
    let decay = OptimizerKind::Sgd {
        momentum: 0.0,
        nesterov: false,
        weight_decay: 1e-3,
    };
    let (p, store) = alone(decay, 0).await;
    let events = store.events.lock().unwrap().clone();
    let (pulled, not) = pulled_after(&events, 'P');
    assert_eq!(not, 0, "{events}");
    // Witness: more pushes than tasks (runs shorter than a task).
    assert!(
        pulled as u64 > p.tasks,
        "{pulled} pushes for {} tasks",
        p.tasks
    );
}
