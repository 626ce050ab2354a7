//! The typed values stored under a job's keys, each with a `version`.
//!
//! Every record is JSON with a `version` field ([`RECORD_VERSION`]). A reader accepts any
//! version up to the one it knows; fields may be added within a version (readers ignore
//! fields they do not know), and a change of meaning bumps it. [`Record::decode`] refuses
//! a newer version with an error that says so, rather than misreading it.
//!
//! | key | record | writer |
//! |---|---|---|
//! | `job/run` | [`RunRecord`] | `edl run` |
//! | `job/state` | [`JobStateRecord`] | `edl run` |
//! | `job/control` | [`ControlRecord`] | `edl kill` |
//! | `scale/trainers` | [`ScaleRecord`] | `edl scale`, autoscalers |
//! | `trainers/<id>` | [`TrainerRecord`] | each trainer (and `edl consume`) |
//! | `ps/<index>` | [`PserverRecord`] | the pserver holding the shard |
//! | `restores/<index>` | [`RestoreRecord`] | the pserver that restored the shard |
//! | `job/failed/<pass>` | [`FailedRecord`] | the leading master |

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The version of every record this build writes.
pub const RECORD_VERSION: u32 = 1;

/// Now, in ms since the Unix epoch (the timestamps of records).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn v1() -> u32 {
    RECORD_VERSION
}

/// A record that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Not the JSON of this record.
    #[error("{what}: not a valid record: {error}")]
    Malformed {
        /// The record.
        what: &'static str,
        /// Why.
        error: String,
    },
    /// Written by a newer edl.
    #[error("{what}: version {found} is newer than this edl reads ({known}); upgrade edl")]
    TooNew {
        /// The record.
        what: &'static str,
        /// The version stored.
        found: u32,
        /// The newest version this build reads.
        known: u32,
    },
}

/// The records of type `R` among `kvs` (a range or a followed prefix); one that cannot be
/// read is skipped, with an error in the log naming its key (an edl of another version
/// wrote it), so that one bad record does not hide the others.
pub fn decode_readable<'a, R: Record>(
    kvs: impl IntoIterator<Item = &'a edl_coord::KeyValue>,
) -> Vec<R> {
    kvs.into_iter()
        .filter_map(|kv| match R::decode(&kv.value) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::error!(key = %kv.key, error = %e, "unreadable record ignored");
                None
            }
        })
        .collect()
}

/// A value stored under a job key.
pub trait Record: Serialize + DeserializeOwned {
    /// What the record is, for errors (its key).
    const WHAT: &'static str;

    /// The stored version.
    fn version(&self) -> u32;

    /// The bytes to store.
    fn encode(&self) -> Vec<u8> {
        // Plain data (strings, numbers, enums of unit variants) always serialises.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Reads a stored value.
    fn decode(bytes: &[u8]) -> Result<Self, RecordError> {
        let r: Self = serde_json::from_slice(bytes).map_err(|e| RecordError::Malformed {
            what: Self::WHAT,
            error: e.to_string(),
        })?;
        if r.version() > RECORD_VERSION {
            return Err(RecordError::TooNew {
                what: Self::WHAT,
                found: r.version(),
                known: RECORD_VERSION,
            });
        }
        Ok(r)
    }
}

macro_rules! record {
    ($t:ty, $what:literal) => {
        impl Record for $t {
            const WHAT: &'static str = $what;

            fn version(&self) -> u32 {
                self.version
            }
        }
    };
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinalState {
    /// Every pass trained and evaluated.
    Succeeded,
    /// Stopped by `edl kill`.
    Stopped,
    /// Failed (the reason says why).
    Failed,
}

impl FinalState {
    /// `succeeded`, `stopped` or `failed`.
    pub fn name(self) -> &'static str {
        match self {
            FinalState::Succeeded => "succeeded",
            FinalState::Stopped => "stopped",
            FinalState::Failed => "failed",
        }
    }
}

/// `job/state`: the job's final state, written once when it ends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobStateRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// How it ended.
    pub state: FinalState,
    /// Why, when it did not succeed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When, ms since the Unix epoch.
    #[serde(default)]
    pub at_ms: u64,
}
record!(JobStateRecord, "job/state");

/// A request to a running job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Control {
    /// Stop every process gracefully.
    Stop,
}

/// `job/control`: a request to the running job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// The request.
    pub command: Control,
}
record!(ControlRecord, "job/control");

impl ControlRecord {
    /// A stop request.
    pub fn stop() -> Self {
        ControlRecord {
            version: RECORD_VERSION,
            command: Control::Stop,
        }
    }
}

/// `job/run`: the `edl run` process that started the job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// Its process id.
    pub pid: u32,
    /// The run directory (logs, checkpoints, report).
    pub dir: String,
    /// The machine (`$HOSTNAME`; may be empty).
    #[serde(default)]
    pub host: String,
    /// When it started, ms since the Unix epoch.
    #[serde(default)]
    pub started_ms: u64,
}
record!(RunRecord, "job/run");

/// `scale/trainers`: the trainer count the job should have.
///
/// Written by `edl scale` (and autoscalers); `edl run` follows it. A bare decimal number
/// (as `etcdctl put /edl/<job>/scale/trainers 4` writes) is read as version 1 too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScaleRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// Desired trainers.
    pub trainers: u32,
}

impl Record for ScaleRecord {
    const WHAT: &'static str = "scale/trainers";

    fn version(&self) -> u32 {
        self.version
    }

    fn decode(bytes: &[u8]) -> Result<Self, RecordError> {
        if let Some(n) = std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
        {
            return Ok(ScaleRecord::new(n));
        }
        let r: ScaleRecord = serde_json::from_slice(bytes).map_err(|e| RecordError::Malformed {
            what: Self::WHAT,
            error: e.to_string(),
        })?;
        if r.version > RECORD_VERSION {
            return Err(RecordError::TooNew {
                what: Self::WHAT,
                found: r.version,
                known: RECORD_VERSION,
            });
        }
        Ok(r)
    }
}

impl ScaleRecord {
    /// `trainers` trainers.
    pub fn new(trainers: u32) -> Self {
        ScaleRecord {
            version: RECORD_VERSION,
            trainers,
        }
    }
}

/// `trainers/<id>`: a trainer's registration, under its lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// Its process id.
    pub pid: u32,
    /// The device it computes on (`cpu`, `cuda:0`; none for `edl consume`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// When it started, ms since the Unix epoch.
    #[serde(default)]
    pub started_ms: u64,
    /// Where it serves `/metrics`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
}
record!(TrainerRecord, "trainers/<id>");

impl TrainerRecord {
    /// The record of this process started now, with no device or metrics (`edl
    /// consume`, the lightweight trainers of `edl bench scale`).
    pub fn model_less() -> TrainerRecord {
        TrainerRecord {
            version: RECORD_VERSION,
            pid: std::process::id(),
            device: None,
            started_ms: crate::records::now_ms(),
            metrics: None,
        }
    }
}

/// `ps/<index>`: the claim of a shard by the pserver serving it, under its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PserverRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// The gRPC address clients reach it at.
    pub addr: String,
    /// The claim revision (create revision of the key; 0 in the very first write).
    #[serde(default)]
    pub claim_revision: i64,
    /// The bulk-path protocol version served on the same address (0: none).
    #[serde(default)]
    pub bulk: u32,
    /// Process id.
    #[serde(default)]
    pub pid: u32,
    /// Start time, ms since the Unix epoch.
    #[serde(default)]
    pub started_ms: u64,
    /// Its process's incarnation ([`crate::env::INSTANCE`]; "" when not given one).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
}
record!(PserverRecord, "ps/<index>");

impl PserverRecord {
    /// A claim of a pserver at `addr` (no bulk path, no process details).
    pub fn at(addr: impl Into<String>) -> Self {
        PserverRecord {
            version: RECORD_VERSION,
            addr: addr.into(),
            claim_revision: 0,
            bulk: 0,
            pid: 0,
            started_ms: 0,
            instance: String::new(),
        }
    }

    /// The claim of this process, serving at `addr` with bulk-path protocol `bulk`: its
    /// process id, start time (now) and [instance](crate::env::instance).
    pub fn of_this_process(addr: impl Into<String>, bulk: u32) -> Self {
        PserverRecord {
            bulk,
            pid: std::process::id(),
            started_ms: now_ms(),
            instance: crate::env::instance().to_owned(),
            ..PserverRecord::at(addr)
        }
    }
}

/// `ps-group/<index>`: shard `index`'s replica group (docs/replication.md): its primary,
/// its in-sync backups and joiners, and the epoch that fences them. No lease; changed
/// only by a compare-and-swap on `change`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// Raised by every change of the record (the compare-and-swap's guard).
    pub change: u64,
    /// Raised whenever the primary changes (a promotion or a restore): the fence every
    /// replica checks. A replica applies and answers nothing of an older epoch than the
    /// newest it has seen.
    pub epoch: u64,
    /// Changed when the shard is restored from a checkpoint (the restorer's claim
    /// revision, as `restores/<index>` names it): the acknowledged ops of an older
    /// incarnation are guaranteed only as far as the checkpoint holds them. A promotion
    /// keeps it.
    pub incarnation: u64,
    /// The member (`ps-member/<id>`) that orders, applies and acknowledges the shard's
    /// ops.
    pub primary: String,
    /// The backups in sync: each holds every op acknowledged (the primary not included).
    #[serde(default)]
    pub backups: std::collections::BTreeSet<String>,
    /// Members catching up (a snapshot, then the ops since): not waited for, not
    /// promotable.
    #[serde(default)]
    pub joining: std::collections::BTreeSet<String>,
    /// The primary's last applied op when its epoch began.
    pub seq_base: u64,
    /// The epoch whose stream the primary's state was a prefix of when its epoch began
    /// (0 after a restore). A backup whose state is a prefix of the same stream and
    /// holds no op past `seq_base` follows the new primary from where it is; any other
    /// is sent a snapshot.
    pub base_epoch: u64,
    /// Replicas wanted, the primary included, as the writer was configured (0: not said,
    /// a record written before it was). A shard of one replica is a group of one.
    #[serde(default)]
    pub replicas: u32,
}
record!(GroupRecord, "ps-group/<index>");

impl GroupRecord {
    /// The record of a shard restored (or first created) by `primary` as `incarnation`
    /// (its claim's revision: what pushes and restores name): a new epoch, no backups,
    /// its stream starting afresh, `replicas` wanted.
    pub fn restored(
        prev: Option<&GroupRecord>,
        primary: String,
        incarnation: u64,
        replicas: u32,
    ) -> GroupRecord {
        GroupRecord {
            version: RECORD_VERSION,
            change: prev.map_or(1, |p| p.change + 1),
            epoch: prev.map_or(1, |p| p.epoch + 1),
            incarnation,
            primary,
            backups: Default::default(),
            joining: Default::default(),
            seq_base: 0,
            base_epoch: 0,
            replicas,
        }
    }

    /// Whether `m` is the primary or an in-sync backup.
    pub fn in_sync(&self, m: &str) -> bool {
        self.primary == m || self.backups.contains(m)
    }

    /// Whether `m` has any place in the group.
    pub fn has(&self, m: &str) -> bool {
        self.in_sync(m) || self.joining.contains(m)
    }
}

/// `ps-member/<id>`: a pserver process that can hold replicas, under its lease (the id
/// is new at every process start).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// The address its replicas are reached at (gRPC and the bulk path).
    pub addr: String,
    /// Process id.
    #[serde(default)]
    pub pid: u32,
    /// Start time, ms since the Unix epoch.
    #[serde(default)]
    pub started_ms: u64,
    /// Its process's incarnation ([`crate::env::INSTANCE`]; "" when not given one).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
}
record!(MemberRecord, "ps-member/<id>");

impl MemberRecord {
    /// The registration of this process, reached at `addr`: its process id, start time
    /// (now) and [instance](crate::env::instance).
    pub fn of_this_process(addr: impl Into<String>) -> Self {
        MemberRecord {
            version: RECORD_VERSION,
            addr: addr.into(),
            pid: std::process::id(),
            started_ms: now_ms(),
            instance: crate::env::instance().to_owned(),
        }
    }
}

/// `restores/<index>`: a pserver restored shard `index` (from a checkpoint, or with its
/// initial values when there was none) and serves it from now on. Written, fenced by the
/// claim, before the restored shard serves; the master trains again every acknowledged
/// task that `contains` lacks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// The shard.
    pub shard: u32,
    /// The claim revision of the restored shard (its incarnation).
    pub incarnation: u64,
    /// The checkpoint step restored (0: none, the shard started over from its initial
    /// values).
    pub step: u64,
    /// The tasks whose updates the restored shard contains.
    pub contains: crate::ledger::LedgerSummary,
    /// When (ms since the Unix epoch).
    #[serde(default)]
    pub at_ms: u64,
}
record!(RestoreRecord, "restores/<index>");

/// `checkpoints/pins/<snapshot>`: the checkpoint manifests an etcd snapshot holds, as
/// they were stored. A job restored from that snapshot restores its shards from them,
/// so the pservers keep every file they name while the pin lasts (their retention
/// otherwise deletes the files of all but the newest manifests within seconds, and a
/// restored job would start over). The leading master writes it once the snapshot is
/// stored whole, while the manifests are held (`checkpoints/hold`: nothing is deleted
/// between the snapshot and its pin), and deletes it with the snapshot.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CheckpointPin {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// The manifests (`checkpoints/<step>`) as stored, newest first.
    pub manifests: Vec<serde_json::Value>,
}
record!(CheckpointPin, "checkpoints/pins/<snapshot>");

/// `job/failed/<pass>`: the tasks of pass `pass` that failed for good. Written by the
/// master in the same fenced transaction as the failure; each pserver shard settles them
/// (counts them as complete in its ledger, so the pass seals, and no restore trains it
/// again) and the master skips them when a restore rewinds the queue. A failed task's
/// records are lost for that pass (reported), never trained again in it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedRecord {
    /// [`RECORD_VERSION`].
    #[serde(default = "v1")]
    pub version: u32,
    /// The pass.
    pub pass: u32,
    /// The dataset's task count.
    pub tasks: u32,
    /// The indexes of the tasks failed for good in the pass (a list: failures are few;
    /// at about 8 bytes an index, etcd's 1.5 MiB request limit holds some 190,000).
    pub failed: std::collections::BTreeSet<u32>,
}
record!(FailedRecord, "job/failed/<pass>");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_with_their_version() {
        let s = JobStateRecord {
            version: RECORD_VERSION,
            state: FinalState::Failed,
            reason: Some("boom".into()),
            at_ms: 7,
        };
        let bytes = s.encode();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.contains("\"version\":1"), "{text}");
        assert!(text.contains("\"state\":\"failed\""), "{text}");
        assert_eq!(JobStateRecord::decode(&bytes).unwrap(), s);

        let c = ControlRecord::stop();
        assert_eq!(ControlRecord::decode(&c.encode()).unwrap(), c);
        let r = RunRecord {
            version: RECORD_VERSION,
            pid: 1,
            dir: "/tmp/x".into(),
            host: String::new(),
            started_ms: 2,
        };
        assert_eq!(RunRecord::decode(&r.encode()).unwrap(), r);
        let t = TrainerRecord {
            version: RECORD_VERSION,
            pid: 3,
            device: Some("cpu".into()),
            started_ms: 4,
            metrics: None,
        };
        assert_eq!(TrainerRecord::decode(&t.encode()).unwrap(), t);
        let p = PserverRecord {
            bulk: 1,
            ..PserverRecord::at("127.0.0.1:1")
        };
        assert_eq!(PserverRecord::decode(&p.encode()).unwrap(), p);
    }

    #[test]
    fn scale_reads_json_and_a_bare_number() {
        assert_eq!(ScaleRecord::decode(b"4").unwrap(), ScaleRecord::new(4));
        assert_eq!(ScaleRecord::decode(b" 7\n").unwrap(), ScaleRecord::new(7));
        let r = ScaleRecord::new(9);
        assert_eq!(ScaleRecord::decode(&r.encode()).unwrap(), r);
        assert!(matches!(
            ScaleRecord::decode(b"-1"),
            Err(RecordError::Malformed { .. })
        ));
    }

    #[test]
    fn newer_and_malformed_records_are_refused_by_name() {
        let e = ControlRecord::decode(br#"{"version":2,"command":"stop"}"#).unwrap_err();
        assert!(matches!(e, RecordError::TooNew { found: 2, .. }));
        assert!(e.to_string().contains("job/control"), "{e}");
        assert!(e.to_string().contains("upgrade edl"), "{e}");
        let e = ControlRecord::decode(b"stop").unwrap_err();
        assert!(matches!(e, RecordError::Malformed { .. }), "{e}");
        let e = JobStateRecord::decode(br#"{"state":"exploded"}"#).unwrap_err();
        assert!(
            e.to_string().starts_with("job/state: not a valid record"),
            "{e}"
        );
    }
}
