//! A snapshot of an etcd member's database, for a tool that backs up the etcd it runs
//! (the operator's managed etcd of a job): what `etcdctl snapshot save` writes, so that
//! `etcdctl snapshot restore` (`etcdutl` from etcd 3.5) restores it.
//!
//! etcd's `Maintenance.Snapshot` streams the member's bbolt database in messages, each
//! saying how many bytes remain; the last data message says 0, and one more message
//! carries the SHA-256 of all the data bytes. The file is the data followed by those 32
//! bytes; `snapshot restore` checks them. [`EtcdSnapshot`] yields the file's bytes as
//! they come and checks the stream as it goes ([`SnapshotCheck`], a pure state
//! machine): the hash's bytes are yielded only once they match the data, so a writer
//! that makes its object whole only at the end (edl-storage's `ObjectWriter`) never
//! keeps a snapshot that is cut short, reordered or damaged.
//!
//! Invariants of [`SnapshotCheck`]:
//! - the data bytes it passes on are the bytes received, in order; it passes on the hash
//!   only when it equals the SHA-256 of those bytes;
//! - it is [`done`](SnapshotCheck::done) only after exactly one hash message that
//!   followed a data message saying 0 bytes remain; a stream that ends before is an
//!   error, as is anything after the hash, a remaining count that grows, or a hash that
//!   is not 32 bytes.
//!
//! Taking one needs a user with the `root` role (etcd refuses `Snapshot` to others with
//! `PermissionDenied`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use edl_proto::etcd::etcdserverpb::{self as pb, maintenance_client::MaintenanceClient};
use ring::digest;

use super::EtcdBackend;
use super::failure::{Failure, Resend};
use crate::error::{Error, Result};

/// Longest wait for the next message of a snapshot stream (a member writing its
/// database out answers continuously; one that stops is stuck).
const MIN_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// Bytes of the SHA-256 that ends a snapshot.
pub const SNAPSHOT_HASH_LEN: usize = 32;

/// Checks a snapshot stream message by message (see the module's invariants).
pub struct SnapshotCheck {
    hash: digest::Context,
    data: u64,
    remaining: Option<u64>,
    done: bool,
}

impl Default for SnapshotCheck {
    fn default() -> Self {
        SnapshotCheck {
            hash: digest::Context::new(&digest::SHA256),
            data: 0,
            remaining: None,
            done: false,
        }
    }
}

impl std::fmt::Debug for SnapshotCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotCheck")
            .field("data", &self.data)
            .field("remaining", &self.remaining)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl SnapshotCheck {
    /// Takes one message (`remaining` bytes after it, its `blob`): `Ok` with the bytes
    /// to write (the data, or the hash once it matched), or an error saying what is
    /// wrong with the stream.
    pub fn message(&mut self, remaining: u64, blob: Bytes) -> std::result::Result<Bytes, String> {
        if self.done {
            return Err("the stream went on after the snapshot's hash".into());
        }
        match self.remaining {
            // The data has ended: this is the hash.
            Some(0) => {
                if remaining != 0 || blob.len() != SNAPSHOT_HASH_LEN {
                    return Err(format!(
                        "after the data, a message of {} bytes saying {remaining} remain, not the \
                         {SNAPSHOT_HASH_LEN}-byte hash",
                        blob.len()
                    ));
                }
                let want = self.hash.clone().finish();
                if want.as_ref() != blob.as_ref() {
                    return Err(format!(
                        "the snapshot's hash does not match its {} data bytes: damaged in transit",
                        self.data
                    ));
                }
                self.done = true;
                Ok(blob)
            }
            Some(before) if remaining > before => Err(format!(
                "the stream said {before} bytes remained, then {remaining}"
            )),
            _ => {
                if blob.is_empty() && remaining != 0 {
                    return Err("an empty data message".into());
                }
                self.hash.update(&blob);
                self.data += blob.len() as u64;
                self.remaining = Some(remaining);
                Ok(blob)
            }
        }
    }

    /// Whether the whole snapshot, its hash included, was received and checked.
    pub fn done(&self) -> bool {
        self.done
    }

    /// The data bytes received so far (the database, without the hash).
    pub fn data_bytes(&self) -> u64 {
        self.data
    }
}

/// A snapshot being received from one member ([`EtcdBackend::snapshot`]).
#[derive(Debug)]
pub struct EtcdSnapshot {
    stream: tonic::Streaming<pb::SnapshotResponse>,
    check: SnapshotCheck,
    endpoint: String,
    revision: i64,
    timeout: Duration,
}

impl EtcdSnapshot {
    /// The next bytes of the snapshot file, or `None` once all were received and the
    /// hash checked. An error (a stream cut short, damaged, or a member that stopped
    /// answering) means the bytes yielded so far must not be kept.
    pub async fn next(&mut self) -> Result<Option<Bytes>> {
        let done = self.check.done();
        match self.message().await? {
            None if done => Ok(None),
            None => Err(self.damaged(format!(
                "the stream ended after {} data bytes, before the snapshot's hash",
                self.check.data_bytes()
            ))),
            // After the hash, any message is an error ([`SnapshotCheck::message`]).
            Some(m) => self
                .check
                .message(m.remaining_bytes, m.blob.into())
                .map(Some)
                .map_err(|e| self.damaged(e)),
        }
    }

    async fn message(&mut self) -> Result<Option<pb::SnapshotResponse>> {
        match tokio::time::timeout(self.timeout, self.stream.message()).await {
            Err(_) => Err(Error::Timeout(self.timeout)),
            Ok(Err(status)) => Err(super::failure::with_endpoint(
                Failure::from(status).error,
                &self.endpoint,
            )),
            Ok(Ok(m)) => Ok(m),
        }
    }

    fn damaged(&self, why: String) -> Error {
        Error::Malformed(format!("etcd snapshot from {}: {why}", self.endpoint))
    }

    /// The member's revision when the snapshot began (the snapshot holds at least it).
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The endpoint of the member it comes from.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The data bytes received so far (the database, without its hash).
    pub fn data_bytes(&self) -> u64 {
        self.check.data_bytes()
    }
}

impl EtcdBackend {
    /// Starts a snapshot of one member's database (the first that answers, from the
    /// pinned one): read it with [`EtcdSnapshot::next`]. Needs a user with the `root`
    /// role ([`Error::PermissionDenied`] otherwise).
    pub async fn snapshot(&self) -> Result<EtcdSnapshot> {
        let timeout = self.inner.cfg.request_timeout.max(MIN_MESSAGE_TIMEOUT);
        let (stream, revision) = self
            .call("start a snapshot", Resend::Always, |c| async move {
                let mut m = MaintenanceClient::with_interceptor(c.channel.clone(), c.meta.clone());
                let status = m.status(pb::StatusRequest {}).await?.into_inner();
                let stream = m.snapshot(pb::SnapshotRequest {}).await?.into_inner();
                let revision = status.header.map(|h| h.revision).unwrap_or_default();
                Ok::<_, Failure>((stream, revision))
            })
            .await?;
        // The member that answered is the pinned one.
        let n = self.inner.slots.len();
        let endpoint = self.inner.slots[self.inner.pinned.load(Ordering::Relaxed) % n]
            .endpoint
            .clone();
        Ok(EtcdSnapshot {
            stream,
            check: SnapshotCheck::default(),
            endpoint,
            revision,
            timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(data: &[u8]) -> Bytes {
        Bytes::copy_from_slice(digest::digest(&digest::SHA256, data).as_ref())
    }

    /// A stream as etcd sends it: data messages counting down to 0, then the hash.
    fn feed(
        check: &mut SnapshotCheck,
        msgs: &[(u64, Bytes)],
    ) -> std::result::Result<Vec<u8>, String> {
        let mut out = Vec::new();
        for (remaining, blob) in msgs {
            out.extend_from_slice(&check.message(*remaining, blob.clone())?);
        }
        Ok(out)
    }

    #[test]
    fn a_whole_snapshot_is_its_data_then_its_hash() {
        let data = b"0123456789abcdef".to_vec();
        let mut c = SnapshotCheck::default();
        let out = feed(
            &mut c,
            &[
                (10, Bytes::from_static(b"012345")),
                (0, Bytes::from_static(b"6789abcdef")),
                (0, sha(&data)),
            ],
        )
        .expect("whole");
        assert!(c.done());
        assert_eq!(c.data_bytes(), 16);
        assert_eq!(&out[..16], &data[..]);
        assert_eq!(&out[16..], sha(&data).as_ref());
        assert!(
            c.message(0, Bytes::from_static(b"x")).is_err(),
            "nothing after the hash"
        );
    }

    #[test]
    fn a_damaged_or_cut_or_reordered_stream_is_refused() {
        let data = b"0123456789".to_vec();
        // A flipped byte: the hash does not match.
        let mut c = SnapshotCheck::default();
        let e = feed(
            &mut c,
            &[(0, Bytes::from_static(b"0123456788")), (0, sha(&data))],
        )
        .expect_err("damaged");
        assert!(e.contains("does not match"), "{e}");
        assert!(!c.done());
        // The hash before the data ended: taken as data, so not done.
        let mut c = SnapshotCheck::default();
        feed(
            &mut c,
            &[(4, Bytes::from_static(b"012345")), (0, sha(&data))],
        )
        .expect("data");
        assert!(!c.done(), "a stream without its hash is never done");
        // A remaining count that grows.
        let mut c = SnapshotCheck::default();
        let e = feed(
            &mut c,
            &[
                (4, Bytes::from_static(b"01")),
                (6, Bytes::from_static(b"23")),
            ],
        )
        .expect_err("grows");
        assert!(e.contains("remained"), "{e}");
        // A hash of the wrong length.
        let mut c = SnapshotCheck::default();
        let e = feed(
            &mut c,
            &[
                (0, Bytes::from_static(b"01")),
                (0, Bytes::from_static(b"short")),
            ],
        )
        .expect_err("short hash");
        assert!(e.contains("32-byte hash"), "{e}");
    }
}
