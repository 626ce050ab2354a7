//! Conversion between edl's types ([`crate::types`]) and etcd's protobuf messages.

use std::time::Duration;

use edl_proto::etcd::etcdserverpb::{self as pb, compare, request_op, response_op};
use edl_proto::etcd::mvccpb;

use crate::error::{Error, Result};
use crate::types::{
    Compare, CompareOp, CompareTarget, KeyValue, LeaseId, Op, OpResponse, Revision, Txn,
    TxnResponse,
};

pub(super) fn decode_kv(kv: mvccpb::KeyValue) -> Result<KeyValue> {
    let key = String::from_utf8(kv.key)
        .map_err(|e| Error::Malformed(format!("non-UTF-8 key {:?}", e.as_bytes())))?;
    Ok(KeyValue {
        key,
        value: kv.value,
        create_revision: kv.create_revision,
        mod_revision: kv.mod_revision,
        version: kv.version,
        lease: (kv.lease != 0).then_some(LeaseId(kv.lease)),
    })
}

pub(super) fn decode_kvs(kvs: Vec<mvccpb::KeyValue>) -> Result<Vec<KeyValue>> {
    kvs.into_iter().map(decode_kv).collect()
}

pub(super) fn revision_of(header: Option<&pb::ResponseHeader>) -> Revision {
    header.map_or(0, |h| h.revision)
}

pub(super) fn decode_txn(resp: pb::TxnResponse) -> Result<TxnResponse> {
    let revision = revision_of(resp.header.as_ref());
    let mut responses = Vec::with_capacity(resp.responses.len());
    for op in resp.responses {
        let r = match op.response {
            Some(response_op::Response::ResponsePut(_)) => OpResponse::Put,
            Some(response_op::Response::ResponseRange(r)) => OpResponse::Get(decode_kvs(r.kvs)?),
            Some(response_op::Response::ResponseDeleteRange(d)) => OpResponse::Delete {
                deleted: u64::try_from(d.deleted).unwrap_or(0),
            },
            Some(response_op::Response::ResponseTxn(t)) => OpResponse::Txn(decode_txn(t)?),
            None => {
                return Err(Error::Malformed(
                    "txn response op without a response".into(),
                ));
            }
        };
        responses.push(r);
    }
    Ok(TxnResponse {
        succeeded: resp.succeeded,
        revision,
        responses,
    })
}

pub(super) fn encode_compare(c: &Compare) -> pb::Compare {
    use compare::{CompareResult as R, CompareTarget as T, TargetUnion as U};
    let result = match c.op {
        CompareOp::Equal => R::Equal,
        CompareOp::NotEqual => R::NotEqual,
        CompareOp::Less => R::Less,
        CompareOp::Greater => R::Greater,
    };
    let (target, value) = match &c.target {
        CompareTarget::Value(v) => (T::Value, U::Value(v.clone())),
        CompareTarget::CreateRevision(r) => (T::Create, U::CreateRevision(*r)),
        CompareTarget::ModRevision(r) => (T::Mod, U::ModRevision(*r)),
        CompareTarget::Version(v) => (T::Version, U::Version(*v)),
        CompareTarget::Lease(l) => (T::Lease, U::Lease(l.map_or(0, |l| l.0))),
    };
    pb::Compare {
        result: result as i32,
        target: target as i32,
        key: c.key.clone().into_bytes(),
        range_end: Vec::new(),
        target_union: Some(value),
    }
}

/// A range request for exactly `key`.
pub(super) fn range_one(key: &[u8]) -> pb::RangeRequest {
    pb::RangeRequest {
        key: key.to_vec(),
        ..Default::default()
    }
}

/// The `(key, range_end)` of every key starting with `prefix` (etcd's
/// `WithPrefix`): the whole key space for the empty prefix.
pub(super) fn prefix_range(prefix: &str) -> (Vec<u8>, Vec<u8>) {
    let start = if prefix.is_empty() {
        vec![0]
    } else {
        prefix.as_bytes().to_vec()
    };
    (start, prefix_end(prefix.as_bytes()))
}

pub(super) fn range_prefix(prefix: &str) -> pb::RangeRequest {
    let (key, range_end) = prefix_range(prefix);
    pb::RangeRequest {
        key,
        range_end,
        ..Default::default()
    }
}

pub(super) fn put_request(key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> pb::PutRequest {
    pb::PutRequest {
        key: key.as_bytes().to_vec(),
        value,
        lease: lease.map_or(0, |l| l.0),
        ..Default::default()
    }
}

pub(super) fn delete_request(key: &str) -> pb::DeleteRangeRequest {
    pb::DeleteRangeRequest {
        key: key.as_bytes().to_vec(),
        ..Default::default()
    }
}

pub(super) fn delete_prefix_request(prefix: &str) -> pb::DeleteRangeRequest {
    let (key, range_end) = prefix_range(prefix);
    pb::DeleteRangeRequest {
        key,
        range_end,
        ..Default::default()
    }
}

pub(super) fn encode_op(op: &Op) -> pb::RequestOp {
    use request_op::Request;
    let request = match op {
        Op::Put { key, value, lease } => {
            Request::RequestPut(put_request(key, value.clone(), *lease))
        }
        Op::Get { key } => Request::RequestRange(range_one(key.as_bytes())),
        Op::GetPrefix { prefix } => Request::RequestRange(range_prefix(prefix)),
        Op::Delete { key } => Request::RequestDeleteRange(delete_request(key)),
        Op::DeletePrefix { prefix } => Request::RequestDeleteRange(delete_prefix_request(prefix)),
        Op::Txn(t) => Request::RequestTxn(encode_txn(t)),
    };
    pb::RequestOp {
        request: Some(request),
    }
}

pub(super) fn encode_txn(t: &Txn) -> pb::TxnRequest {
    pb::TxnRequest {
        compare: t.compares.iter().map(encode_compare).collect(),
        success: t.success.iter().map(encode_op).collect(),
        failure: t.failure.iter().map(encode_op).collect(),
    }
}

/// The end of the key range of `prefix` (etcd's `GetPrefixRangeEnd`): `[0]`, meaning
/// "to the end of the key space", for the empty prefix or one of only `0xff` bytes.
pub(super) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

pub(super) fn ttl_secs(ttl: Duration) -> Result<i64> {
    if ttl.is_zero() {
        return Err(Error::InvalidArgument("lease ttl must be positive".into()));
    }
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs).map_err(|_| Error::InvalidArgument("too large lease TTL".into()))
}

pub(super) fn secs(ttl: i64) -> Duration {
    Duration::from_secs(u64::try_from(ttl).unwrap_or(0))
}
