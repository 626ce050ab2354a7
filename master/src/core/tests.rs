//! The actor on the in-memory backend, driven through its handle (no gRPC, no
//! followers: the test delivers what the followers would, when it chooses).

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Fence, MemBackend};
use edl_job::{JobKeys, JobName, RECORD_VERSION, Record, RestoreRecord};
use edl_master_client::Answer;
use tokio_util::sync::CancellationToken;

use super::Core;
use crate::dataset::DatasetSpec;
use crate::queue::QueueConfig;
use crate::store::Store;
use crate::testing::dataset;

/// A restore of shard `shard` at `incarnation` holding nothing: a shard's first start.
fn first_start(shard: u32, incarnation: u64) -> RestoreRecord {
    RestoreRecord {
        version: RECORD_VERSION,
        shard,
        incarnation,
        step: 0,
        contains: Default::default(),
        at_ms: 0,
    }
}

/// A pserver publishes its restore before it serves, so the record is in etcd before any
/// acknowledgement through its incarnation; the follower may deliver it much later
/// (here: after two passes trained on it, as when it came before the dataset existed and
/// was dropped, then was sent again with another shard's restore). It is applied before
/// the first such acknowledgement, so its late delivery changes nothing (before, it took
/// the queue back to pass 0: the whole job trained again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_is_applied_before_any_acknowledgement_through_its_incarnation() {
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
    let keys = JobKeys::new(&JobName::new("core").unwrap());
    let key = format!("{}master/election/x", keys.root());
    let revision = backend.put(&key, b"x".to_vec(), None).await.unwrap();
    let store = Store::new(backend.clone(), keys.clone(), Fence { key, revision });
    // Shard 0 started (incarnation 9, nothing held) before the master had a dataset.
    let record = first_start(0, 9);
    backend
        .put(&keys.restore(0), record.encode(), None)
        .await
        .unwrap();
    let (core, handle) = Core::start(store, QueueConfig::default(), 10)
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    tokio::spawn(core.run(cancel));
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 20);
    handle
        .set_dataset(DatasetSpec {
            globs: vec![glob],
            chunks_per_task: 1,
            passes: 3,
        })
        .await
        .unwrap();
    // Passes 0 and 1 trained through incarnation 9 of shard 0.
    let mut request = 0;
    loop {
        let pass = handle.status().await.unwrap().pass;
        if pass == 2 {
            break;
        }
        request += 1;
        match handle
            .get_task("t".into(), pass, request, Duration::ZERO)
            .await
            .unwrap()
        {
            Answer::Task(t) => {
                let applied = handle
                    .finished(t.id, t.generation, t.records, vec![9])
                    .await
                    .unwrap();
                assert!(applied);
            }
            Answer::PassFinished(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    // The follower delivers the record only now.
    handle.restored(vec![record]).await;
    let st = handle.status().await.unwrap();
    assert_eq!(st.pass, 2, "not taken back: {st:?}");
    assert_eq!(st.counters.recomputed, 0, "{st:?}");
}
