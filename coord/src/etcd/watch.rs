//! A watch on etcd as a stream of [`WatchEvent`]s that ends with an error when the
//! watch ends (compacted, cancelled, connection lost).

use std::collections::VecDeque;

use edl_proto::etcd::etcdserverpb as pb;
use edl_proto::etcd::mvccpb;

use super::codec::decode_kv;
use super::failure::{status_failure, with_endpoint};
use crate::error::{Error, Result};
use crate::types::{EventKind, WatchEvent};

/// Appends the events of one watch response; an error when the watch ended
/// (compacted, cancelled by the server) or an event cannot be decoded.
pub(super) fn decode_watch_response(
    resp: pb::WatchResponse,
    buf: &mut VecDeque<WatchEvent>,
) -> Result<()> {
    if resp.compact_revision != 0 {
        return Err(Error::Compacted {
            compact_revision: resp.compact_revision,
        });
    }
    for ev in resp.events {
        let kind = match mvccpb::event::EventType::try_from(ev.r#type) {
            Ok(mvccpb::event::EventType::Put) => EventKind::Put,
            Ok(mvccpb::event::EventType::Delete) => EventKind::Delete,
            Err(_) => {
                return Err(Error::Malformed(format!(
                    "unknown watch event type {}",
                    ev.r#type
                )));
            }
        };
        let Some(kv) = ev.kv else {
            return Err(Error::Malformed("watch event without key-value".into()));
        };
        buf.push_back(WatchEvent {
            kind,
            kv: decode_kv(kv)?,
        });
    }
    if resp.canceled {
        let reason = if resp.cancel_reason.is_empty() {
            "watch cancelled by the server".to_owned()
        } else {
            resp.cancel_reason
        };
        if reason.contains("permission denied") {
            return Err(Error::PermissionDenied(reason));
        }
        return Err(Error::unavailable(String::new(), reason));
    }
    Ok(())
}

pub(super) struct EtcdWatch {
    /// Kept so the request side of the stream stays open.
    pub(super) _requests: tokio::sync::mpsc::Sender<pb::WatchRequest>,
    pub(super) ws: tonic::Streaming<pb::WatchResponse>,
    pub(super) buf: VecDeque<WatchEvent>,
    pub(super) pending_err: Option<Error>,
    pub(super) done: bool,
    pub(super) endpoint: String,
}

impl EtcdWatch {
    pub(super) async fn next_item(mut self) -> Option<(Result<WatchEvent>, Self)> {
        loop {
            if let Some(ev) = self.buf.pop_front() {
                return Some((Ok(ev), self));
            }
            if self.done {
                return None;
            }
            if let Some(e) = self.pending_err.take() {
                self.done = true;
                let e = with_endpoint(e, &self.endpoint);
                return Some((Err(e), self));
            }
            match self.ws.message().await {
                Ok(Some(resp)) => {
                    if let Err(e) = decode_watch_response(resp, &mut self.buf) {
                        self.pending_err = Some(e);
                    }
                }
                Ok(None) => {
                    self.pending_err =
                        Some(Error::unavailable(String::new(), "watch stream closed"));
                }
                Err(status) => self.pending_err = Some(status_failure(&status).error),
            }
        }
    }
}
