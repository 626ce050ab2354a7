//! The groups of a task's batches (a group: the batches summed into one push): prepared
//! on a blocking thread while the previous group computes, and computed in one blocking
//! call that also checks and sums the gradients.

use std::sync::Arc;

use edl_master_client::task::LeasedTask;
use tokio::task::JoinHandle;

use edl_job::spec::PerPush;

use super::{RuntimeConfig, batch_seed};
use crate::model::{Model, Params, StepOutput};
use crate::progress::RuntimeError;
use crate::store::StoreError;

/// The batches of a group being prepared on a blocking thread.
pub(super) type Prepare = JoinHandle<Result<Vec<crate::model::Batch>, BadBatch>>;

/// Starts preparing group `g` (of `per_push` batches) of a task's `records`.
fn prepare(
    model: &Arc<dyn Model>,
    records: &Arc<Vec<Vec<u8>>>,
    task: &LeasedTask,
    cfg: &RuntimeConfig,
    per_push: usize,
    g: usize,
) -> Prepare {
    let (model, records, task) = (model.clone(), records.clone(), task.clone());
    let (seed, batch_size) = (cfg.seed, cfg.batch_size.max(1));
    tokio::task::spawn_blocking(move || {
        prepare_group(
            model.as_ref(),
            &records,
            &task,
            seed,
            batch_size,
            per_push,
            g,
        )
    })
}

/// A task's groups, each prepared on a blocking thread while the one before is used
/// (decoding overlaps the math).
pub(super) struct Groups<'a> {
    model: &'a Arc<dyn Model>,
    records: Arc<Vec<Vec<u8>>>,
    task: &'a LeasedTask,
    cfg: &'a RuntimeConfig,
    next: Option<Prepare>,
    /// Batches per group.
    per_push: usize,
    /// The number of the group being prepared, and how many the task has.
    g: usize,
    groups: usize,
}

impl<'a> Groups<'a> {
    /// Starts preparing the first group (of `per_push` batches) of `task`'s `records`
    /// that this attempt trains: the task's first, or, when an earlier attempt handed
    /// the task back after applying its first batches, the first group after them. A
    /// resume point inside a group (not expected: a drain stops between groups) makes
    /// this attempt push batch by batch: a run partly applied by another attempt would
    /// be refused. A resume point whose records are not its batches at this trainer's
    /// batch size (a trainer of another batch size handed it back) is not used: the
    /// attempt trains the task whole (the shards apply no batch twice).
    pub(super) fn new(
        model: &'a Arc<dyn Model>,
        records: Arc<Vec<Vec<u8>>>,
        task: &'a LeasedTask,
        cfg: &'a RuntimeConfig,
        per_push: usize,
    ) -> Self {
        let batch_size = cfg.batch_size.max(1);
        let start = match &task.resume {
            Some(r) if r.records == u64::from(r.batch) * batch_size as u64 => r.batch as usize,
            Some(r) => {
                tracing::warn!(task = %task.id, batch = r.batch, records = r.records, batch_size, "a resume point of another batch size: training the task whole");
                0
            }
            None => 0,
        };
        let mut per_push = per_push.max(1);
        if start % per_push != 0 {
            tracing::warn!(task = %task.id, start, per_push, "resuming inside a group: pushing batch by batch");
            per_push = 1;
        }
        let groups = records.len().div_ceil(batch_size * per_push);
        let g = start / per_push;
        let next = (g < groups).then(|| prepare(model, &records, task, cfg, per_push, g));
        Groups {
            model,
            records,
            task,
            cfg,
            next,
            per_push,
            g,
            groups,
        }
    }

    /// The next group (the number of its first batch in the task, and its batches or why
    /// they could not be prepared), once prepared; the one after it starts preparing.
    /// `None` after the last.
    pub(super) async fn next(
        &mut self,
    ) -> Result<Option<(u32, Result<Vec<crate::model::Batch>, BadBatch>)>, RuntimeError> {
        let Some(preparing) = self.next.take() else {
            return Ok(None);
        };
        let g = self.g;
        let prepared = preparing
            .await
            .map_err(|e| StoreError::Unavailable(format!("preparing batches panicked: {e}")))?;
        self.g += 1;
        if self.g < self.groups {
            self.next = Some(prepare(
                self.model,
                &self.records,
                self.task,
                self.cfg,
                self.per_push,
                self.g,
            ));
        }
        Ok(Some(((g * self.per_push) as u32, prepared)))
    }
}

/// A batch that could not be prepared.
pub(super) struct BadBatch {
    /// Its first record's index in the task.
    pub(super) first: usize,
    /// Its records.
    pub(super) len: usize,
    /// Why.
    pub(super) error: crate::Error,
}

/// Prepares the batches of group `g` of a task's `records` (batch seeds by their
/// number in the task: the same in every attempt, whichever trainer makes it).
fn prepare_group(
    model: &dyn Model,
    records: &[Vec<u8>],
    task: &LeasedTask,
    seed: u64,
    batch_size: usize,
    per_push: usize,
    g: usize,
) -> Result<Vec<crate::model::Batch>, BadBatch> {
    let start = g * batch_size * per_push;
    let end = (start + batch_size * per_push).min(records.len());
    records[start..end]
        .chunks(batch_size)
        .enumerate()
        .map(|(i, chunk)| {
            let seq = (g * per_push + i) as u32;
            model
                .prepare_records(chunk, batch_seed(seed, task, seq))
                .map_err(|error| BadBatch {
                    first: start + i * batch_size,
                    len: chunk.len(),
                    error,
                })
        })
        .collect()
}

impl BadBatch {
    /// Why `task` fails, when its data is bad (the file, chunks and records named); the
    /// error itself otherwise.
    pub(super) fn reason(self, task: &LeasedTask) -> Result<String, RuntimeError> {
        if !self.error.is_bad_data() {
            return Err(self.error.into());
        }
        Ok(format!(
            "{} chunks {}..{}: records {}..{} of the task: {}",
            task.path,
            task.chunk_begin,
            task.chunk_end,
            self.first,
            self.first + self.len,
            self.error
        ))
    }
}

/// What computing a group gave.
pub(super) struct GroupOut {
    /// The summed gradients of its batches with a finite loss and gradients (`None`:
    /// every batch was skipped).
    pub(super) sum: Option<StepOutput>,
    /// Batches skipped for a non-finite loss or gradients.
    pub(super) skipped: u64,
    /// The loss of its last batch pushed.
    pub(super) last_loss: Option<f32>,
    /// The error that stopped it (the group is not pushed).
    pub(super) end: Option<crate::Error>,
}

/// Computes the batches of a group on `params` and sums their gradients. A batch with
/// a non-finite loss or gradients is skipped (never pushed: some shards would refuse it
/// after others applied their part); it counts as trained, since it was seen.
pub(super) fn compute_group(
    model: &dyn Model,
    params: &Params,
    batches: &[crate::model::Batch],
    task: &str,
    batch_size: usize,
) -> GroupOut {
    let mut out = GroupOut {
        sum: None,
        skipped: 0,
        last_loss: None,
        end: None,
    };
    for batch in batches {
        let skip = match model.forward_backward(params, batch) {
            // A model of its own may return a non-finite loss instead of the error.
            Ok(o) if !o.loss.is_finite() => format!("a non-finite loss ({})", o.loss),
            Ok(o) if !o.gradients_finite() => {
                format!("non-finite gradients (loss {})", o.loss)
            }
            Ok(mut step) => {
                step.weigh_partial(batch.len(), batch_size);
                out.last_loss = Some(step.loss);
                match &mut out.sum {
                    None => out.sum = Some(step),
                    Some(sum) => add_gradients(sum, &step),
                }
                continue;
            }
            Err(e @ crate::Error::NonFiniteLoss { .. }) => e.to_string(),
            Err(e) => {
                out.end = Some(e);
                return out;
            }
        };
        tracing::warn!(task, "skipping a batch: {skip}");
        out.skipped += 1;
    }
    out
}

/// Batches per push for `model` in the per-group loop: the config's fixed number (1
/// when adaptive: this loop waits for every push). A model with sparse tables pulls
/// the rows of all of a group's batches before its first and pushes their gradients
/// merged (a row touched by several batches is sent once).
pub(super) fn fixed_per_push(cfg: &RuntimeConfig, _model: &dyn Model) -> usize {
    match cfg.batches_per_push {
        PerPush::Fixed(n) => (n as usize).max(1),
        PerPush::Adaptive => 1,
    }
}

/// The rows of every table that any of `batches` touches, sorted and distinct.
pub(super) fn group_rows(
    model: &dyn Model,
    batches: &[crate::model::Batch],
) -> Vec<(String, Vec<u64>)> {
    let mut all: Vec<(String, Vec<u64>)> = Vec::new();
    for batch in batches {
        for (table, rows) in model.sparse_rows(batch) {
            match all.iter_mut().find(|(t, _)| *t == table) {
                Some((_, r)) => r.extend(rows),
                None => all.push((table, rows)),
            }
        }
    }
    for (_, rows) in &mut all {
        rows.sort_unstable();
        rows.dedup();
    }
    all
}

/// Adds the gradients of `out` into `sum` (a group of batches: their sum is pushed as
/// one step): dense ones element by element, sparse ones row by row (a row in both is
/// summed, a row only in `out` is appended).
pub(super) fn add_gradients(sum: &mut StepOutput, out: &StepOutput) {
    sum.examples += out.examples;
    for (s, g) in sum.dense.iter_mut().zip(&out.dense) {
        for (a, b) in s.iter_mut().zip(g) {
            *a += b;
        }
    }
    for g in &out.sparse {
        match sum.sparse.iter_mut().find(|s| s.table == g.table) {
            Some(s) => add_rows(s, g),
            None => sum.sparse.push(g.clone()),
        }
    }
}

fn add_rows(sum: &mut crate::model::SparseGrad, g: &crate::model::SparseGrad) {
    let dim = sum.dim;
    let at: std::collections::HashMap<u64, usize> =
        sum.rows.iter().enumerate().map(|(i, &r)| (r, i)).collect();
    for (k, &row) in g.rows.iter().enumerate() {
        let src = &g.values[k * dim..(k + 1) * dim];
        match at.get(&row) {
            Some(&i) => {
                for (a, b) in sum.values[i * dim..(i + 1) * dim].iter_mut().zip(src) {
                    *a += b;
                }
            }
            None => {
                sum.rows.push(row);
                sum.values.extend_from_slice(src);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SparseGrad;

    fn grad(table: &str, rows: &[u64], values: &[f32]) -> SparseGrad {
        SparseGrad {
            table: table.into(),
            rows: rows.to_vec(),
            dim: 2,
            values: values.to_vec(),
        }
    }

    fn step(dense: Vec<Vec<f32>>, sparse: Vec<SparseGrad>) -> StepOutput {
        StepOutput {
            loss: 1.0,
            examples: 3,
            dense,
            sparse,
        }
    }

    /// A row two batches touch is summed and sent once; rows and tables only one batch
    /// touches are kept; dense gradients add element by element.
    #[test]
    fn a_groups_sparse_gradients_merge_row_by_row() {
        let mut sum = step(
            vec![vec![1.0, 2.0]],
            vec![grad("a", &[5, 1], &[1.0, 1.0, 2.0, 2.0])],
        );
        let other = step(
            vec![vec![0.5, 0.5]],
            vec![
                grad("a", &[1, 9], &[10.0, 20.0, 3.0, 4.0]),
                grad("b", &[0], &[7.0, 8.0]),
            ],
        );
        add_gradients(&mut sum, &other);
        assert_eq!(sum.examples, 6);
        assert_eq!(sum.dense, vec![vec![1.5, 2.5]]);
        assert_eq!(sum.sparse.len(), 2);
        let a = &sum.sparse[0];
        assert_eq!(a.rows, vec![5, 1, 9]);
        assert_eq!(a.values, vec![1.0, 1.0, 12.0, 22.0, 3.0, 4.0]);
        assert_eq!(sum.sparse[1], grad("b", &[0], &[7.0, 8.0]));
    }

    /// A group pulls the sorted union of its batches' rows, table by table.
    #[test]
    fn a_group_pulls_the_union_of_its_batches_rows() {
        use edl_proto::sample::Sample;
        let model = crate::build(&crate::ModelSpec::Word2vec {
            vocab_size: 50,
            dim: 4,
            window: 1,
            negatives: 2,
            sampler: edl_job::model::NegativeSampler::Uniform,
            seed: 1,
        })
        .unwrap();
        let batches: Vec<_> = [vec![3u64, 7, 3], vec![7, 40, 2]]
            .into_iter()
            .enumerate()
            .map(|(i, ids)| {
                model
                    .prepare_seeded(&[Sample::sparse(ids)], i as u64)
                    .unwrap()
            })
            .collect();
        let union = group_rows(model.as_ref(), &batches);
        let each: Vec<_> = batches.iter().map(|b| model.sparse_rows(b)).collect();
        assert_eq!(union.len(), 2, "both tables");
        for (t, (table, rows)) in union.iter().enumerate() {
            let mut want: Vec<u64> = each.iter().flat_map(|e| e[t].1.clone()).collect();
            want.sort_unstable();
            want.dedup();
            assert_eq!((table, rows), (&each[0][t].0, &want));
        }
        assert_eq!(union[0].1, vec![2, 3, 7, 40], "the centres of both batches");
    }
}
