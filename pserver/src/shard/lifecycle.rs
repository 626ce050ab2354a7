//! A shard before and after initialisation: empty, loading its initial blocks
//! (`Init`, possibly in several calls and from a successor when the first initialiser
//! died), then ready ([`ShardCore`]), or installed whole from a checkpoint.
//!
//! Invariant: a ready shard never changes spec; `Init` with the same spec is a no-op and
//! with another one an error, while a loading shard given another spec starts over.
//! Every core that becomes ready (initialised or installed) has the tasks failed for
//! good known so far settled in its ledger ([`Shard::settle`]).

use std::sync::{Arc, Mutex, PoisonError, RwLock};

use edl_job::FailedRecord;

use super::ShardCore;
use super::push::BlockValues;
use super::snapshot::CheckpointHooks;
use crate::error::PsError;
use crate::layout::{Layout, ParamSpec};
use crate::wire;

/// Initial values for some blocks of a shard (one `Init` call).
#[derive(Debug, Clone)]
pub struct InitBlocks {
    /// The shard the sender means (checked against this one).
    pub shard: u32,
    /// The shard count the sender means.
    pub shards: u32,
    /// The initialising trainer.
    pub trainer: String,
    /// The model spec and its settings.
    pub spec: ParamSpec,
    /// Initial values of blocks of this shard.
    pub blocks: Vec<BlockValues>,
}

/// A shard before and after initialisation.
#[derive(Debug)]
pub struct Shard {
    index: u32,
    shards: u32,
    incarnation: std::sync::atomic::AtomicU64,
    state: RwLock<ShardState>,
    checkpoints: Arc<CheckpointHooks>,
    /// The tasks failed for good, as the master last recorded them.
    failed: Mutex<Vec<FailedRecord>>,
    /// A replicated primary's op stream, given to every core made ready here.
    stream: Mutex<Option<super::OpStream>>,
}

#[derive(Debug)]
enum ShardState {
    Empty,
    Loading {
        layout: Arc<Layout>,
        blocks: Vec<Option<Vec<f32>>>,
    },
    Ready(Arc<ShardCore>),
}

impl Shard {
    /// An empty shard `index` of `shards`.
    pub fn new(
        index: u32,
        shards: u32,
        incarnation: u64,
        checkpoints: Arc<CheckpointHooks>,
    ) -> Self {
        Shard {
            index,
            shards,
            incarnation: std::sync::atomic::AtomicU64::new(incarnation),
            state: RwLock::new(ShardState::Empty),
            checkpoints,
            failed: Mutex::new(Vec::new()),
            stream: Mutex::new(None),
        }
    }

    /// The index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The shard count.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// The incarnation (claim revision).
    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// A replica restoring the shard under a new claim: the cores it builds (`Init`)
    /// are of that incarnation.
    pub fn set_incarnation(&self, incarnation: u64) {
        self.incarnation
            .store(incarnation, std::sync::atomic::Ordering::Release);
    }

    /// Where sync snapshots go, and when.
    pub fn checkpoints(&self) -> &Arc<CheckpointHooks> {
        &self.checkpoints
    }

    /// The initialised shard.
    pub fn core(&self) -> Result<Arc<ShardCore>, PsError> {
        match &*self.state.read().unwrap_or_else(PoisonError::into_inner) {
            ShardState::Ready(c) => Ok(c.clone()),
            _ => Err(PsError::Uninitialised(self.index)),
        }
    }

    /// Installs a restored shard.
    /// Drops the shard's copy (a replica no longer in its group, or one that must start
    /// over from a snapshot).
    pub fn uninstall(&self) {
        *super::lock(&self.stream) = None;
        *self.state.write().unwrap_or_else(PoisonError::into_inner) = ShardState::Empty;
    }

    /// A replicated primary: every change of the shard, of the core ready now and of any
    /// made ready later, goes to `stream` (set once per core: a primary that steps down
    /// drops its copy).
    pub fn set_stream(&self, stream: super::OpStream) {
        *super::lock(&self.stream) = Some(stream.clone());
        if let Ok(core) = self.core()
            && !core.has_stream()
        {
            let _ = core.set_stream(stream);
        }
    }

    /// Gives a core made ready here the stream, if there is one.
    fn with_stream(&self, core: &ShardCore) {
        if let Some(s) = super::lock(&self.stream).clone() {
            let _ = core.set_stream(s);
        }
    }

    pub fn install(&self, core: ShardCore) {
        self.with_stream(&core);
        self.settle_in(&core);
        *self.state.write().unwrap_or_else(PoisonError::into_inner) =
            ShardState::Ready(Arc::new(core));
    }

    /// The tasks failed for good (every `job/failed/<pass>` record, as etcd holds them
    /// now): settled in the ready core's ledger, and in every core made ready later.
    pub fn settle(&self, failed: Vec<FailedRecord>) {
        *self.failed.lock().unwrap_or_else(PoisonError::into_inner) = failed;
        if let Ok(core) = self.core() {
            self.settle_in(&core);
        }
    }

    fn settle_in(&self, core: &ShardCore) {
        for r in self
            .failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            if let Err(e) = core.settle(r) {
                tracing::error!(shard = self.index, pass = r.pass, error = %e, "failed tasks not settled");
            }
        }
    }

    /// Checks that a request names this shard.
    pub fn check_target(&self, shard: u32, shards: u32) -> Result<(), PsError> {
        if shard != self.index || shards != self.shards {
            return Err(PsError::WrongShard {
                have: self.index,
                shards: self.shards,
                want: shard,
                want_shards: shards,
            });
        }
        Ok(())
    }

    /// Loads initial blocks (see the `Init` RPC). Returns (already initialised, blocks
    /// still missing).
    pub fn init(&self, req: InitBlocks) -> Result<(bool, u32), PsError> {
        self.check_target(req.shard, req.shards)?;
        let spec = req.spec;
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        if let ShardState::Ready(core) = &*state {
            return if *core.spec() == spec {
                Ok((true, 0))
            } else {
                Err(PsError::SpecMismatch(format!(
                    "shard {} holds another model; the request's spec differs",
                    self.index
                )))
            };
        }
        if let ShardState::Loading { layout, .. } = &*state
            && **layout.spec() != spec
        {
            // A new initialiser (the first died) with another spec: start over.
            tracing::warn!(shard = self.index, trainer = %req.trainer, "initialisation restarted with another spec");
            *state = ShardState::Empty;
        }
        if matches!(*state, ShardState::Empty) {
            let layout = Arc::new(Layout::new(spec, self.shards)?);
            let n = layout.shard_blocks(self.index).len();
            *state = ShardState::Loading {
                layout,
                blocks: vec![None; n],
            };
        }
        let ShardState::Loading { layout, blocks } = &mut *state else {
            return Err(PsError::Uninitialised(self.index));
        };
        for b in req.blocks {
            let Some(info) = layout.block(b.id).filter(|i| i.shard == self.index) else {
                return Err(PsError::InvalidArgument(format!(
                    "block {} is not a block of shard {}",
                    b.id, self.index
                )));
            };
            if Some(b.values.len()) != wire::byte_len(info.len) {
                return Err(PsError::InvalidArgument(format!(
                    "block {} has {} bytes, expected {}",
                    b.id,
                    b.values.len(),
                    info.len * 4
                )));
            }
            if !wire::all_finite(&b.values) {
                return Err(PsError::NonFinite(format!(
                    "initial values of block {}",
                    b.id
                )));
            }
            blocks[info.local as usize] = Some(wire::decode(&b.values));
        }
        let missing = blocks.iter().filter(|b| b.is_none()).count() as u32;
        Ok((false, missing))
    }

    /// Completes initialisation; returns whether it was already done.
    pub fn finish_init(&self) -> Result<bool, PsError> {
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        let (layout, blocks) = match &mut *state {
            ShardState::Ready(_) => return Ok(true),
            ShardState::Empty => {
                return Err(PsError::InvalidArgument(
                    "FinishInit before any Init".into(),
                ));
            }
            ShardState::Loading { layout, blocks } => (layout.clone(), blocks),
        };
        let missing = blocks.iter().filter(|b| b.is_none()).count();
        if missing > 0 {
            return Err(PsError::InvalidArgument(format!(
                "{missing} blocks of shard {} were never sent",
                self.index
            )));
        }
        let values = std::mem::take(blocks).into_iter().flatten().collect();
        let core = ShardCore::new(
            layout,
            self.index,
            self.incarnation(),
            values,
            self.checkpoints.clone(),
        )?;
        self.with_stream(&core);
        self.settle_in(&core);
        *state = ShardState::Ready(Arc::new(core));
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Mode;
    use crate::optim::OptimizerConfig;
    use crate::shard::testutil::spec;

    #[test]
    fn init_is_idempotent_and_checks_the_spec() {
        let s = Shard::new(0, 2, 1, Arc::default());
        assert!(matches!(s.core(), Err(PsError::Uninitialised(0))));
        let sp = spec(Mode::Async, OptimizerConfig::sgd(0.1));
        let layout = Layout::new(sp.clone(), 2).unwrap();
        let blocks: Vec<BlockValues> = layout
            .shard_blocks(0)
            .iter()
            .map(|&id| BlockValues {
                id,
                values: wire::encode(&vec![1.0; layout.block(id).unwrap().len]),
            })
            .collect();
        let req = |blocks: Vec<BlockValues>, spec: &ParamSpec| InitBlocks {
            shard: 0,
            shards: 2,
            trainer: "t".into(),
            spec: spec.clone(),
            blocks,
        };
        assert_eq!(s.init(req(blocks[..1].to_vec(), &sp)).unwrap(), (false, 1));
        assert!(s.finish_init().is_err(), "a block is missing");
        assert_eq!(s.init(req(blocks[1..].to_vec(), &sp)).unwrap(), (false, 0));
        assert!(!s.finish_init().unwrap());
        assert!(s.finish_init().unwrap());
        assert_eq!(s.init(req(Vec::new(), &sp)).unwrap(), (true, 0));
        let other = spec(Mode::sync(), OptimizerConfig::sgd(0.1));
        assert!(matches!(
            s.init(req(Vec::new(), &other)),
            Err(PsError::SpecMismatch(_))
        ));
        let wrong = InitBlocks {
            shard: 1,
            ..req(Vec::new(), &sp)
        };
        assert!(matches!(s.init(wrong), Err(PsError::WrongShard { .. })));
        assert!(
            s.core()
                .unwrap()
                .dense_values("w")
                .iter()
                .all(|(_, v)| v.iter().all(|&x| x == 1.0))
        );
    }
}
