//! The replica group's vocabulary: the group record kept in etcd (`ps-group/<shard>`,
//! [`GroupRecord`], shared with the clients through `edl_job`), the messages replicas
//! exchange, the effects the state machine asks its shell to carry out, and its
//! configuration.

use std::collections::BTreeSet;

/// Milliseconds on the caller's clock.
pub type Millis = u64;
/// The position of an op in a shard's replication stream (1 is the first op of an
/// incarnation; 0: nothing applied).
pub type Seq = u64;
/// A pserver process, as registered under `ps-member/<id>` (unique per process start:
/// a restarted process is a new member).
pub type MemberId = String;

pub use edl_job::GroupRecord;

/// The guard under which a restore may be written over `r`: no replica that may hold an
/// acknowledged op is alive (the primary and every in-sync backup absent).
pub fn restore_guard(r: &GroupRecord, restorer: &MemberId) -> Guard {
    let mut absent: BTreeSet<MemberId> = r.backups.clone();
    absent.insert(r.primary.clone());
    Guard {
        alive: restorer.clone(),
        absent,
    }
}

/// What a compare-and-swap of the group record must also find in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    /// The proposer's member key is present (its lease is alive).
    pub alive: MemberId,
    /// These members' keys are absent (their leases ended).
    pub absent: BTreeSet<MemberId>,
}

/// A message between the replicas of one shard (over one ordered connection per pair).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Primary to backup: op `seq` of `epoch` (its payload travels with it).
    Op {
        /// The sender's epoch.
        epoch: u64,
        /// The op's position.
        seq: Seq,
    },
    /// Primary to backup: the shard's whole state as of op `seq` (replaces the backup's).
    Snapshot {
        /// The sender's epoch.
        epoch: u64,
        /// The last op the snapshot holds.
        seq: Seq,
    },
    /// Backup to primary: every op up to `seq` is applied here.
    Confirm {
        /// The epoch the backup is in sync with.
        epoch: u64,
        /// Its last applied op.
        seq: Seq,
    },
    /// Backup to primary: send the ops after `have`, or a snapshot (`None`: this
    /// replica's state is not a prefix of the primary's).
    Need {
        /// The epoch the backup follows.
        epoch: u64,
        /// Its last applied op, when its state is a prefix of the primary's.
        have: Option<Seq>,
        /// The change of the record it asks under: a request older than the record
        /// that last gave it its place is stale (it may predate a discarded state).
        change: u64,
    },
    /// Answer to an op of an old epoch: the sender is fenced by `epoch`.
    Fenced {
        /// The newest epoch the answering replica has seen.
        epoch: u64,
    },
}

/// What the state machine asks its shell to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Send `msg` to `to` (for [`Msg::Op`], with that op's payload from the log).
    Send {
        /// The recipient.
        to: MemberId,
        /// The message.
        msg: Msg,
    },
    /// Take a snapshot of the shard (holding the apply order for that moment), send it to
    /// `to` as [`Msg::Snapshot`] of `epoch`, then call
    /// [`Replica::snapshot_sent`](super::Replica::snapshot_sent) with the op it holds.
    SendSnapshot {
        /// The recipient.
        to: MemberId,
        /// The sender's epoch.
        epoch: u64,
    },
    /// Backup: apply the op just received (before the confirmation that follows).
    Apply {
        /// The op's position.
        seq: Seq,
    },
    /// Backup: replace the shard's state with the snapshot just received.
    Install {
        /// The last op it holds.
        seq: Seq,
    },
    /// Write `record` to etcd if the record's change is still `expect_change` and the
    /// guard holds; then pass the record read back to
    /// [`Replica::observe`](super::Replica::observe) whatever the outcome.
    Propose {
        /// The change the proposal replaces.
        expect_change: u64,
        /// The new record.
        record: GroupRecord,
        /// What etcd must also find.
        guard: Guard,
    },
    /// Answer every op assigned by this primary up to `upto` (every in-sync replica
    /// holds it).
    Ack {
        /// The last op acknowledged.
        upto: Seq,
    },
    /// The ops this primary assigned from `from` on will not be acknowledged here (it is
    /// no longer primary): answer them "not primary" so that clients retry at the new
    /// one.
    Fail {
        /// The first op not acknowledged.
        from: Seq,
    },
    /// This replica's copy of the shard is no longer part of the group: drop it.
    Discard,
}

/// The replica group's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// Replicas wanted per shard, the primary included (`[cluster] pserver_replicas`).
    pub replicas: usize,
    /// How long a backup may leave an op unconfirmed before the primary removes it from
    /// the in-sync set (through etcd), and how long a replica waits before asking again
    /// for what it lacks.
    pub timeout: Millis,
    /// How long a joiner may stay silent (a snapshot in transfer) before it is dropped
    /// from the group (it is recruited again later).
    pub join_timeout: Millis,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        ReplicaConfig {
            replicas: 2,
            timeout: 2_000,
            join_timeout: 60_000,
        }
    }
}

/// A replica's role in its shard's group, as it sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Orders, applies and acknowledges the shard's ops.
    Primary,
    /// In the in-sync set.
    Backup,
    /// Catching up to join the in-sync set.
    Joining,
    /// No place in the group (not in the record, or the record not seen yet).
    Outside,
}
