//! Reads for trainers: the dense blocks whose version changed since the caller's copy,
//! and the values of sparse rows (rows never trained: their initial values). In sync
//! mode both read under the step lock, so they see one step whole.

use std::sync::atomic::Ordering;

use bytes::Bytes;

use super::storage::stripe_of;
use super::{ShardCore, bump, lock};
use crate::error::PsError;
use crate::wire;

/// One dense block of a pull: its values at a version.
#[derive(Debug, Clone)]
pub struct VersionedBlock {
    /// Global block id.
    pub id: u32,
    /// The block's version.
    pub version: u64,
    /// Little-endian `f32` values.
    pub values: Bytes,
}

/// What a pull returns.
#[derive(Debug, Clone)]
pub struct PullReply {
    /// The blocks whose version differs from the caller's.
    pub blocks: Vec<VersionedBlock>,
    /// Sync: the next step to push. Async: the shard's update count.
    pub next_step: u64,
    /// Updates applied.
    pub updates: u64,
    /// Identifies this copy of the shard (the claim revision): block versions only
    /// compare within one incarnation.
    pub incarnation: u64,
}

impl ShardCore {
    /// The blocks whose version differs from `known` (all when `incarnation` is not
    /// ours or `known` is empty).
    pub fn pull(&self, known: &[u64], incarnation: u64) -> PullReply {
        let known = if incarnation == self.incarnation {
            known
        } else {
            &[]
        };
        let view = self.step_view();
        let ids = self.layout.shard_blocks(self.index);
        let mut blocks = Vec::new();
        for (i, (b, &id)) in self.blocks.iter().zip(ids).enumerate() {
            let mut b = lock(b);
            if known.get(i) == Some(&b.version) {
                continue;
            }
            // Encoded once per version; later pulls of it share the bytes.
            let version = b.version;
            let values = match &b.encoded {
                Some((v, e)) if *v == version => e.clone(),
                _ => {
                    let e = wire::encode(&b.values);
                    b.encoded = Some((version, e.clone()));
                    e
                }
            };
            blocks.push(VersionedBlock {
                id,
                version,
                values,
            });
        }
        bump(&self.counters.pulls);
        let resp = PullReply {
            blocks,
            next_step: if self.is_sync() {
                self.next_step()
            } else {
                self.updates()
            },
            updates: self.updates(),
            incarnation: self.incarnation,
        };
        drop(view);
        resp
    }

    /// Values of `rows` of table `table` (rows never trained: their initial values), in
    /// at most `max_bytes`.
    pub fn pull_sparse(
        &self,
        table: u32,
        rows: &[u64],
        max_bytes: usize,
    ) -> Result<Bytes, PsError> {
        let Some(t) = self.tables.get(table as usize) else {
            return Err(PsError::InvalidArgument(format!("unknown table {table}")));
        };
        let dim = t.dim;
        let Some(size) = rows
            .len()
            .checked_mul(dim)
            .and_then(|n| n.checked_mul(4))
            .filter(|&n| n <= max_bytes)
        else {
            return Err(PsError::InvalidArgument(format!(
                "{} rows of {dim} floats exceed the {max_bytes} byte message limit; pull fewer \
                 rows at once",
                rows.len()
            )));
        };
        if let Some(r) = rows
            .iter()
            .find(|&&r| self.layout.row_shard(r) != self.index)
        {
            return Err(PsError::InvalidArgument(format!(
                "row {r} belongs to shard {}, not {}",
                self.layout.row_shard(*r),
                self.index
            )));
        }
        let mut out = vec![0u8; size];
        let mut init = vec![0f32; dim];
        let _view = self.step_view();
        for (i, &r) in rows.iter().enumerate() {
            let dst = &mut out[i * dim * 4..(i + 1) * dim * 4];
            let st = lock(&t.stripes[stripe_of(r)]);
            let values = match st.rows.get(&r) {
                Some(row) => &row.values,
                None => {
                    t.init.fill(r, &mut init);
                    &init
                }
            };
            for (c, v) in dst.chunks_exact_mut(4).zip(values) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        self.counters
            .sparse_rows_pulled
            .fetch_add(rows.len() as u64, Ordering::Relaxed);
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::time::Instant;

    use super::*;
    use crate::layout::{DenseSpec, Layout, Mode, ParamConfig, ParamSpec};
    use crate::optim::OptimizerConfig;
    use crate::shard::testutil::{core, push};
    use crate::sync::Admit;

    struct DropFlag<'a>(&'a std::sync::atomic::AtomicBool);

    impl Drop for DropFlag<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }

    #[test]
    fn a_sync_pull_sees_one_step_whole() {
        let spec = ParamSpec {
            dense: vec![DenseSpec {
                name: "w".into(),
                shape: vec![64 * 256],
            }],
            sparse: Vec::new(),
            config: ParamConfig {
                block_size: 256,
                ..ParamConfig::new(Mode::sync(), OptimizerConfig::sgd(1.0))
            },
        };
        let layout = Arc::new(Layout::new(spec, 1).unwrap());
        let values = layout
            .shard_blocks(0)
            .iter()
            .map(|&id| vec![0.0; layout.block(id).unwrap().len])
            .collect();
        let c = ShardCore::new(layout, 0, 1, values, Arc::default()).unwrap();
        c.sync_set_members(["a".to_string()].into());
        const STEPS: u64 = 300;
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                // Set even if this thread panics, so the puller stops.
                let _done = DropFlag(&done);
                for step in 1..=STEPS {
                    let mut req = push(&c, "a", 1, step, 1.0, &[]);
                    req.sparse.clear();
                    let p = c.validate_push(req).unwrap();
                    assert_eq!(
                        c.sync_push(&p, Instant::now()).unwrap(),
                        Admit::Join { step }
                    );
                }
            });
            let mut pulls = 0;
            while !done.load(Ordering::Acquire) || pulls == 0 {
                let resp = c.pull(&[], 0);
                // Every block holds the same step: the one before the next to push, or
                // the one before that while the next is being applied.
                let first = wire::decode(&resp.blocks[0].values)[0];
                let applied = (-first) as u64;
                assert!(
                    applied + 1 == resp.next_step || applied + 2 == resp.next_step,
                    "pull {pulls}: step {applied} applied, the next step is {}",
                    resp.next_step
                );
                for b in &resp.blocks {
                    let v = wire::decode(&b.values);
                    assert!(
                        v.iter().all(|&x| x == first),
                        "pull {pulls}: block {} holds {}, block 0 holds {first}",
                        b.id,
                        v[0],
                    );
                }
                pulls += 1;
            }
        });
        assert_eq!(c.last_closed(), STEPS);
    }

    #[test]
    fn a_version_is_encoded_once_and_shared_by_its_pulls() {
        let c = core(Mode::Async, 0, 1);
        let first = c.pull(&[], 0);
        let again = c.pull(&[], 0);
        assert!(!first.blocks.is_empty());
        for (a, b) in first.blocks.iter().zip(&again.blocks) {
            assert_eq!(a.version, b.version);
            assert_eq!(
                a.values.as_ptr(),
                b.values.as_ptr(),
                "block {}: shared",
                a.id
            );
        }
        let p = c.validate_push(push(&c, "t", 1, 1, 1.0, &[])).unwrap();
        assert!(c.apply_async(&p).unwrap().applied);
        let after = c.pull(&[], 0);
        for (a, b) in first.blocks.iter().zip(&after.blocks) {
            assert!(b.version > a.version, "block {}", a.id);
            assert_ne!(a.values.as_ptr(), b.values.as_ptr());
            // The new encoding holds the new values (SGD at rate 1 of a gradient of 1).
            let (old, new) = (wire::decode(&a.values), wire::decode(&b.values));
            assert!(
                old.iter().zip(&new).all(|(o, n)| *n == o - 1.0),
                "block {}",
                a.id
            );
        }
    }
}
