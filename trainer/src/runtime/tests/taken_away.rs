//! A task taken away mid-flight: a shard refuses an adaptive run of batches because
//! another attempt at the task applied part of it (`Overlap`).

use std::sync::Mutex;

use edl_pserver_client::Origin;

use super::*;
use crate::store::{ParamStore, StoreError};

/// A [`LocalStore`] whose pushes take a few milliseconds (a network: the adaptive
/// pipeline sums the batches computed meanwhile), and that refuses the first run of
/// several batches as partly applied by another attempt at its task.
#[derive(Debug)]
struct Refusing {
    inner: LocalStore,
    /// Every origin pushed, in order.
    origins: Mutex<Vec<Origin>>,
    refused: Mutex<Option<Origin>>,
}

#[async_trait::async_trait]
impl ParamStore for Refusing {
    async fn init(
        &self,
        trainer: &str,
        params: &crate::store::ParamInit,
    ) -> Result<crate::store::InitOutcome, StoreError> {
        self.inner.init(trainer, params).await
    }
    async fn pull_dense(&self, params: &mut crate::model::Params) -> Result<(), StoreError> {
        self.inner.pull_dense(params).await
    }
    async fn pull_sparse(
        &self,
        rows: &[(String, Vec<u64>)],
        params: &mut crate::model::Params,
    ) -> Result<(), StoreError> {
        self.inner.pull_sparse(rows, params).await
    }
    async fn push(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: &crate::model::StepOutput,
    ) -> Result<(), StoreError> {
        tokio::time::sleep(Duration::from_millis(3)).await;
        let o = origin.expect("the trainer names its batches");
        self.origins.lock().unwrap().push(o);
        {
            let mut refused = self.refused.lock().unwrap();
            if refused.is_none() && o.count > 1 {
                *refused = Some(o);
                return Err(StoreError::Superseded(
                    "injected: another attempt applied part of this run".into(),
                ));
            }
        }
        self.inner.push(trainer, step, origin, grads).await
    }
    fn local_updates(&self) -> Option<edl_pserver_client::OptimizerConfig> {
        self.inner.local_updates()
    }
}

/// A trainer whose run of batches is refused as partly applied by another attempt does
/// not acknowledge the task: it hands it back (it still held the lease here), the master
/// leases it again as a second dispatch, and that attempt pushes batch by batch. Every
/// record is counted once, the refused attempt's not at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_whose_run_is_refused_is_handed_back_and_trained_again_batch_by_batch() {
    const PASSES: u32 = 3;
    let job = LineJob::start("taken", PASSES).await;
    let (train, backend, stop, client) = (
        job.train.clone(),
        job.backend.clone(),
        job.stop.clone(),
        job.client.clone(),
    );
    let model = line_model(&train);
    let store = Arc::new(Refusing {
        inner: LocalStore::new(model.clone(), OptimizerKind::sgd(), 0.01, 1),
        origins: Mutex::new(Vec::new()),
        refused: Mutex::new(None),
    });
    let _lease = register(&backend, "taken", "only", &stop).await;
    let mut cfg = RuntimeConfig::new("only");
    cfg.batch_size = 4;
    assert_eq!(cfg.batches_per_push, PerPush::Adaptive, "the default");
    let (tx, _rx) = watch::channel(Progress::default());
    let reader = CloudReader::start(client.clone(), ReaderConfig::new("only"));
    let p = tokio::time::timeout(
        Duration::from_secs(120),
        run(reader, model, store.clone(), cfg, stop.child_token(), tx),
    )
    .await
    .expect("the trainer finishes")
    .expect("a refused run is not an error");
    let refused = store
        .refused
        .lock()
        .unwrap()
        .expect("witness: a run of several batches was pushed, and refused");
    let total = u64::from(PASSES) * train.len() as u64;
    assert_eq!(p.records, total, "counted once: {p:?}");
    let st = client.status().await.unwrap();
    assert!(st.finished);
    let c = st.counters.unwrap();
    assert_eq!(c.records_trained, total);
    assert!(c.released >= 1, "handed back: {c:?}");
    // The attempt after the refusal pushed the task batch by batch, every batch of the
    // refused run among them.
    let origins = store.origins.lock().unwrap().clone();
    let at = origins.iter().position(|o| *o == refused).unwrap();
    let again: Vec<&Origin> = origins[at + 1..]
        .iter()
        .filter(|o| (o.pass, o.task) == (refused.pass, refused.task))
        .collect();
    assert!(again.iter().all(|o| o.count == 1), "{again:?}");
    for b in refused.seq..refused.seq + refused.count {
        assert!(again.iter().any(|o| o.seq == b), "batch {b}: {again:?}");
    }
    job.finish().await;
}
