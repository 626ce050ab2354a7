//! Transactions with etcd's rules: compares (a missing key compares as zero, except
//! in a value compare, which is then false), the request size limit, at most
//! [`MAX_TXN_OPS`] operations per branch, and the duplicate-key rule (within a branch,
//! nested transactions included, a key is put at most once and never both put and
//! deleted). Every branch is decided up front against the state before the
//! transaction, leases are checked on the chosen path, and only then is it applied, so
//! a refused transaction changes nothing.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::MemLease;
use super::store::{Writer, check_key};
use crate::error::{Error, Result};
use crate::types::{
    Compare, CompareOp, CompareTarget, KeyValue, LeaseId, MAX_REQUEST_BYTES, MAX_TXN_OPS, Op,
    OpResponse, Txn, TxnResponse,
};

fn holds(ord: Ordering, op: CompareOp) -> bool {
    match op {
        CompareOp::Equal => ord == Ordering::Equal,
        CompareOp::NotEqual => ord != Ordering::Equal,
        CompareOp::Less => ord == Ordering::Less,
        CompareOp::Greater => ord == Ordering::Greater,
    }
}

/// Evaluates one compare with etcd's rules: a missing key compares as zero, except
/// that a value compare on a missing key is always false.
fn compare_holds(kvs: &BTreeMap<String, KeyValue>, c: &Compare) -> bool {
    let kv = kvs.get(&c.key);
    match &c.target {
        CompareTarget::Value(v) => kv.is_some_and(|kv| holds(kv.value.as_slice().cmp(v), c.op)),
        CompareTarget::CreateRevision(r) => {
            holds(kv.map_or(0, |kv| kv.create_revision).cmp(r), c.op)
        }
        CompareTarget::ModRevision(r) => holds(kv.map_or(0, |kv| kv.mod_revision).cmp(r), c.op),
        CompareTarget::Version(v) => holds(kv.map_or(0, |kv| kv.version).cmp(v), c.op),
        CompareTarget::Lease(l) => {
            let have = kv.and_then(|kv| kv.lease).map_or(0, |l| l.0);
            holds(have.cmp(&l.map_or(0, |l| l.0)), c.op)
        }
    }
}

/// The size etcd measures against `--max-request-bytes`, approximately: keys, values
/// and compare operands, plus a few bytes of framing each.
fn op_size(op: &Op) -> usize {
    const FRAMING: usize = 16;
    FRAMING
        + match op {
            Op::Put { key, value, .. } => key.len() + value.len(),
            Op::Get { key } | Op::Delete { key } => key.len(),
            // The key and the range end.
            Op::GetPrefix { prefix } | Op::DeletePrefix { prefix } => 2 * prefix.len(),
            Op::Txn(inner) => txn_size(inner),
        }
}

pub(super) fn txn_size(txn: &Txn) -> usize {
    let compares: usize = txn
        .compares
        .iter()
        .map(|c| {
            16 + c.key.len()
                + match &c.target {
                    CompareTarget::Value(v) => v.len(),
                    _ => 8,
                }
        })
        .sum();
    compares
        + txn
            .success
            .iter()
            .chain(&txn.failure)
            .map(op_size)
            .sum::<usize>()
}

/// etcd's answer to a request over [`MAX_REQUEST_BYTES`].
pub(super) fn check_request_size(size: usize) -> Result<()> {
    if size > MAX_REQUEST_BYTES {
        return Err(Error::InvalidArgument(format!(
            "etcdserver: request is too large ({size} bytes, the limit is {MAX_REQUEST_BYTES})"
        )));
    }
    Ok(())
}

/// Size limits and etcd's "duplicate key" rule: within a branch (nested
/// transactions included) a key is put at most once and never both put and deleted.
pub(super) fn validate_txn(txn: &Txn) -> Result<()> {
    if txn.compares.len() > MAX_TXN_OPS
        || txn.success.len() > MAX_TXN_OPS
        || txn.failure.len() > MAX_TXN_OPS
    {
        return Err(Error::InvalidArgument(
            "etcdserver: too many operations in txn request".into(),
        ));
    }
    for op in txn.success.iter().chain(&txn.failure) {
        match op {
            Op::Put { key, .. } | Op::Delete { key } | Op::Get { key } => check_key(key)?,
            Op::Txn(inner) => validate_txn(inner)?,
            Op::GetPrefix { .. } | Op::DeletePrefix { .. } => {}
        }
    }
    check_intervals(&txn.success)?;
    check_intervals(&txn.failure)?;
    Ok(())
}

/// Deletes of one branch level, as exact keys or prefixes.
#[derive(Default)]
struct Dels {
    keys: BTreeSet<String>,
    prefixes: Vec<String>,
}

impl Dels {
    fn covers(&self, key: &str) -> bool {
        self.keys.contains(key) || self.prefixes.iter().any(|p| key.starts_with(p.as_str()))
    }

    fn union(&mut self, other: Dels) {
        self.keys.extend(other.keys);
        self.prefixes.extend(other.prefixes);
    }
}

/// Mirrors etcd's `checkIntervals`: returns the keys put and the ranges deleted by
/// `ops` (recursively), failing on an overlap.
fn check_intervals(ops: &[Op]) -> Result<(BTreeSet<String>, Dels)> {
    let dup = || Error::InvalidArgument("duplicate key given in txn request".into());
    let mut dels = Dels::default();
    for op in ops {
        match op {
            Op::Delete { key } => {
                dels.keys.insert(key.clone());
            }
            Op::DeletePrefix { prefix } => dels.prefixes.push(prefix.clone()),
            _ => {}
        }
    }
    let mut puts = BTreeSet::new();
    for op in ops {
        let Op::Txn(inner) = op else { continue };
        let (puts_then, dels_then) = check_intervals(&inner.success)?;
        let (puts_else, dels_else) = check_intervals(&inner.failure)?;
        for k in &puts_then {
            if puts.contains(k) || dels.covers(k) {
                return Err(dup());
            }
            puts.insert(k.clone());
        }
        for k in puts_else {
            // A key put in both branches of one nested txn is fine: they exclude each other.
            if (puts.contains(&k) && !puts_then.contains(&k)) || dels.covers(&k) {
                return Err(dup());
            }
            puts.insert(k);
        }
        dels.union(dels_then);
        dels.union(dels_else);
    }
    for op in ops {
        let Op::Put { key, .. } = op else { continue };
        if puts.contains(key) || dels.covers(key) {
            return Err(dup());
        }
        puts.insert(key.clone());
    }
    Ok((puts, dels))
}

/// Decides every branch up front, against the state before the transaction (as etcd
/// does): one bool per transaction, nested ones included, in pre-order.
pub(super) fn decide_path(kvs: &BTreeMap<String, KeyValue>, txn: &Txn, path: &mut Vec<bool>) {
    let ok = txn.compares.iter().all(|c| compare_holds(kvs, c));
    path.push(ok);
    let branch = if ok { &txn.success } else { &txn.failure };
    for op in branch {
        if let Op::Txn(inner) = op {
            decide_path(kvs, inner, path);
        }
    }
}

/// Checks that every lease used by a put on the chosen path exists.
pub(super) fn check_leases(
    leases: &HashMap<LeaseId, MemLease>,
    txn: &Txn,
    path: &[bool],
    at: &mut usize,
) -> Result<()> {
    let ok = path.get(*at).copied().unwrap_or(false);
    *at += 1;
    for op in if ok { &txn.success } else { &txn.failure } {
        match op {
            Op::Put {
                lease: Some(id), ..
            } if !leases.contains_key(id) => return Err(Error::LeaseLost),
            Op::Txn(inner) => check_leases(leases, inner, path, at)?,
            _ => {}
        }
    }
    Ok(())
}

pub(super) fn apply_txn(
    w: &mut Writer<'_>,
    txn: &Txn,
    path: &[bool],
    at: &mut usize,
) -> TxnResponse {
    let ok = path.get(*at).copied().unwrap_or(false);
    *at += 1;
    let mut responses = Vec::new();
    for op in if ok { &txn.success } else { &txn.failure } {
        let resp = match op {
            Op::Put { key, value, lease } => {
                w.put(key, value.clone(), *lease);
                OpResponse::Put
            }
            Op::Get { key } => OpResponse::Get(w.get(key)),
            Op::GetPrefix { prefix } => OpResponse::Get(w.get_prefix(prefix)),
            Op::Delete { key } => OpResponse::Delete {
                deleted: u64::from(w.delete(key)),
            },
            Op::DeletePrefix { prefix } => OpResponse::Delete {
                deleted: w.delete_prefix(prefix),
            },
            Op::Txn(inner) => OpResponse::Txn(apply_txn(w, inner, path, at)),
        };
        responses.push(resp);
    }
    TxnResponse {
        succeeded: ok,
        revision: 0,
        responses,
    }
}
