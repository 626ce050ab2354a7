//! Plain data types of the KV model: keys and values, leases, compares, operations,
//! transactions and watch events. They mirror etcd's v3 API.

use std::fmt;
use std::time::Duration;

/// An etcd revision: a cluster-wide counter bumped by every committed write
/// (one bump per transaction, however many keys it changes).
pub type Revision = i64;

/// Most operations allowed in one branch of a transaction (etcd's default
/// `--max-txn-ops`). Both backends refuse larger transactions.
pub const MAX_TXN_OPS: usize = 128;

/// Largest request etcd accepts by default (`--max-request-bytes`, 1.5 MiB): the
/// keys, values and compares of one put or transaction, plus a little framing.
/// Larger requests fail with [`Error::InvalidArgument`](crate::Error::InvalidArgument)
/// ("request is too large") on both backends; split them into several
/// transactions, or keep large payloads out of etcd.
pub const MAX_REQUEST_BYTES: usize = 1536 * 1024;

/// A lease id as granted by the server.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({:x})", self.0)
    }
}

/// A granted lease: its id and the TTL the server actually granted (etcd rounds up
/// to whole seconds and to its minimum TTL).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LeaseGrant {
    /// The lease id.
    pub id: LeaseId,
    /// The granted time to live.
    pub ttl: Duration,
}

/// What [`Backend::free_space`](crate::Backend::free_space) did.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct FreedSpace {
    /// The database's size before, in bytes (the largest of the members').
    pub size_before: u64,
    /// The database's size after compacting and defragmenting.
    pub size_after: u64,
    /// Whether a space alarm was raised and has been ended.
    pub disarmed: bool,
}

/// One key with its value and metadata, as stored.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct KeyValue {
    /// The key.
    pub key: String,
    /// The value (empty in delete events).
    pub value: Vec<u8>,
    /// Revision of the write that created the key (0 in delete events).
    pub create_revision: Revision,
    /// Revision of the last write to the key (the deletion revision in delete events).
    pub mod_revision: Revision,
    /// Number of writes since creation (1 after creation, 0 in delete events).
    pub version: i64,
    /// The lease the key is attached to.
    pub lease: Option<LeaseId>,
}

/// Comparison operator of a [`Compare`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CompareOp {
    /// `==`
    Equal,
    /// `!=`
    NotEqual,
    /// `<`
    Less,
    /// `>`
    Greater,
}

/// What a [`Compare`] looks at, with the operand. A missing key compares as a key
/// with zero revisions, version 0 and no lease; a `Value` compare on a missing key
/// is always false (etcd semantics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompareTarget {
    /// The value (bytewise).
    Value(Vec<u8>),
    /// The create revision (0 when absent).
    CreateRevision(Revision),
    /// The mod revision (0 when absent).
    ModRevision(Revision),
    /// The version (0 when absent).
    Version(i64),
    /// The lease (`None` when absent or not leased).
    Lease(Option<LeaseId>),
}

/// One guard of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compare {
    /// The key compared.
    pub key: String,
    /// The operator.
    pub op: CompareOp,
    /// The field compared and the operand.
    pub target: CompareTarget,
}

impl Compare {
    /// Compares the value of `key`.
    pub fn value(key: impl Into<String>, op: CompareOp, value: impl Into<Vec<u8>>) -> Self {
        Self {
            key: key.into(),
            op,
            target: CompareTarget::Value(value.into()),
        }
    }

    /// Compares the create revision of `key`.
    pub fn create_revision(key: impl Into<String>, op: CompareOp, rev: Revision) -> Self {
        Self {
            key: key.into(),
            op,
            target: CompareTarget::CreateRevision(rev),
        }
    }

    /// Compares the mod revision of `key`.
    pub fn mod_revision(key: impl Into<String>, op: CompareOp, rev: Revision) -> Self {
        Self {
            key: key.into(),
            op,
            target: CompareTarget::ModRevision(rev),
        }
    }

    /// Compares the version of `key`.
    pub fn version(key: impl Into<String>, op: CompareOp, version: i64) -> Self {
        Self {
            key: key.into(),
            op,
            target: CompareTarget::Version(version),
        }
    }

    /// Compares the lease of `key`.
    pub fn lease(key: impl Into<String>, op: CompareOp, lease: Option<LeaseId>) -> Self {
        Self {
            key: key.into(),
            op,
            target: CompareTarget::Lease(lease),
        }
    }

    /// True when `key` does not exist (`create_revision == 0`).
    pub fn absent(key: impl Into<String>) -> Self {
        Self::create_revision(key, CompareOp::Equal, 0)
    }

    /// True when `key` exists (`create_revision > 0`).
    pub fn exists(key: impl Into<String>) -> Self {
        Self::create_revision(key, CompareOp::Greater, 0)
    }
}

/// One operation of a transaction branch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Write `value` at `key`, attached to `lease` (or detached from any lease).
    Put {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
        /// The lease to attach the key to.
        lease: Option<LeaseId>,
    },
    /// Read one key.
    Get {
        /// The key.
        key: String,
    },
    /// Read every key starting with `prefix`, sorted by key. Unlike
    /// [`Backend::range`](crate::Backend::range) it is one response, not paginated:
    /// on etcd the whole transaction's answer must fit in
    /// [`MAX_DECODING_MESSAGE_SIZE`](crate::etcd::MAX_DECODING_MESSAGE_SIZE).
    GetPrefix {
        /// The prefix.
        prefix: String,
    },
    /// Delete one key.
    Delete {
        /// The key.
        key: String,
    },
    /// Delete every key starting with `prefix`.
    DeletePrefix {
        /// The prefix.
        prefix: String,
    },
    /// A nested transaction (etcd >= 3.3), evaluated at this point of the branch.
    Txn(Box<Txn>),
}

impl Op {
    /// A put without lease.
    pub fn put(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Op::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
        }
    }

    /// A put attached to `lease`.
    pub fn put_with_lease(
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
        lease: LeaseId,
    ) -> Self {
        Op::Put {
            key: key.into(),
            value: value.into(),
            lease: Some(lease),
        }
    }

    /// A read of one key.
    pub fn get(key: impl Into<String>) -> Self {
        Op::Get { key: key.into() }
    }

    /// A read of a prefix.
    pub fn get_prefix(prefix: impl Into<String>) -> Self {
        Op::GetPrefix {
            prefix: prefix.into(),
        }
    }

    /// A delete of one key.
    pub fn delete(key: impl Into<String>) -> Self {
        Op::Delete { key: key.into() }
    }

    /// A delete of a prefix.
    pub fn delete_prefix(prefix: impl Into<String>) -> Self {
        Op::DeletePrefix {
            prefix: prefix.into(),
        }
    }

    /// A nested transaction.
    pub fn txn(txn: Txn) -> Self {
        Op::Txn(Box::new(txn))
    }
}

/// A transaction: if every compare holds, the `success` ops run, else the `failure`
/// ops; atomically, at one revision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    /// The guards (all must hold).
    pub compares: Vec<Compare>,
    /// Ops run when every compare holds.
    pub success: Vec<Op>,
    /// Ops run otherwise.
    pub failure: Vec<Op>,
}

impl Txn {
    /// An empty transaction (succeeds, does nothing).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds guards.
    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Self {
        self.compares.extend(compares);
        self
    }

    /// Adds ops to the success branch.
    pub fn and_then(mut self, ops: impl IntoIterator<Item = Op>) -> Self {
        self.success.extend(ops);
        self
    }

    /// Adds ops to the failure branch.
    pub fn or_else(mut self, ops: impl IntoIterator<Item = Op>) -> Self {
        self.failure.extend(ops);
        self
    }
}

/// The result of one op of the branch that ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpResponse {
    /// A put was applied.
    Put,
    /// The keys read (empty when absent), sorted by key.
    Get(Vec<KeyValue>),
    /// How many keys were deleted.
    Delete {
        /// Number of keys deleted.
        deleted: u64,
    },
    /// The response of a nested transaction.
    Txn(TxnResponse),
}

/// The result of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnResponse {
    /// Whether every compare held (so the success branch ran).
    pub succeeded: bool,
    /// The store revision after the transaction.
    pub revision: Revision,
    /// One response per op of the branch that ran, in order.
    pub responses: Vec<OpResponse>,
}

impl TxnResponse {
    /// The key-values read by the `i`-th op, if it was a get.
    pub fn get(&self, i: usize) -> Option<&[KeyValue]> {
        match self.responses.get(i) {
            Some(OpResponse::Get(kvs)) => Some(kvs),
            _ => None,
        }
    }

    /// Sets the revision of this response and of its nested responses.
    pub(crate) fn set_revision(&mut self, rev: Revision) {
        self.revision = rev;
        for r in &mut self.responses {
            if let OpResponse::Txn(inner) = r {
                inner.set_revision(rev);
            }
        }
    }
}

/// Kind of a watch event.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// The key was created or updated.
    Put,
    /// The key was deleted (explicitly, or by its lease ending).
    Delete,
}

/// One change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    /// Put or delete.
    pub kind: EventKind,
    /// The key-value after a put; for a delete, only `key` and `mod_revision` (the
    /// deletion revision) are set.
    pub kv: KeyValue,
}

impl WatchEvent {
    /// The revision of the change.
    pub fn revision(&self) -> Revision {
        self.kv.mod_revision
    }
}

/// A fencing token: a key and the create revision it must still have. Writes made
/// with [`Fence::compare`] among their guards fail once the key was deleted or
/// re-created (lease ended, resigned, replaced).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The guarded key.
    pub key: String,
    /// Its create revision (the generation number of its owner).
    pub revision: Revision,
}

impl Fence {
    /// The compare `create_revision(key) == revision`.
    pub fn compare(&self) -> Compare {
        Compare::create_revision(self.key.clone(), CompareOp::Equal, self.revision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_id_formats_as_hex() {
        assert_eq!(LeaseId(255).to_string(), "ff");
        assert_eq!(format!("{:?}", LeaseId(16)), "LeaseId(10)");
    }

    #[test]
    fn txn_builder_accumulates() {
        let t = Txn::new()
            .when([Compare::absent("k")])
            .when([Compare::exists("j")])
            .and_then([Op::put("k", "v")])
            .or_else([Op::get("k")]);
        assert_eq!(t.compares.len(), 2);
        assert_eq!(t.success, vec![Op::put("k", "v")]);
        assert_eq!(t.failure, vec![Op::get("k")]);
    }
}
