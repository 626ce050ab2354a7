//! The tasks the master failed for good (`job/failed/<pass>`): read before the restore
//! is published (so that its summary holds them), then followed for the pserver's life,
//! and settled in the shard's ledger ([`Shard::settle`]).

use std::sync::Arc;

use edl_coord::{Backend, follow_prefix};
use edl_job::JobKeys;
use edl_job::records::decode_readable;
use tokio_util::sync::CancellationToken;

use crate::shard::Shard;

/// Settles every failed-task record in `shard` whenever they change, until `stop`.
pub(super) async fn follow_failed(
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    shard: Arc<Shard>,
    stop: CancellationToken,
) {
    let mut view = follow_prefix(backend, keys.failed(), stop.child_token());
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            r = view.changed() => if r.is_err() { return },
        }
        let v = view.borrow_and_update().clone();
        if v.revision == 0 {
            continue;
        }
        shard.settle(decode_readable(v.kvs.values()));
    }
}
