//! Property tests over every decoder of network input in the protocol: each message a
//! master, a pserver or a client decodes from the network (gRPC bodies, the bulk path's
//! headers) is fed random bytes and random mutations of valid encodings. Decoding never
//! panics; whatever decodes re-encodes to bytes that decode to the same message.

use crate::{master as m, pserver as p};
use proptest::prelude::*;
use prost::Message;

fn check<T: Message + Default + PartialEq + std::fmt::Debug>(bytes: &[u8]) {
    if let Ok(msg) = T::decode(bytes) {
        let again = T::decode(msg.encode_to_vec().as_slice()).expect("re-encoded bytes decode");
        assert_eq!(again, msg);
    }
}

macro_rules! all {
    ($bytes:expr; $($t:ty),* $(,)?) => {
        $( check::<$t>($bytes); )*
    };
}

fn decode_all(bytes: &[u8]) {
    all!(bytes;
        m::SetDatasetRequest, m::SetDatasetResponse, m::GetTaskRequest, m::Task,
        m::GetTaskResponse, m::Empty, m::TaskFinishedRequest, m::TaskFailedRequest,
        m::ReleaseTaskRequest, m::TaskReportResponse, m::StatusRequest, m::FailedTask,
        m::Counters, m::StatusResponse,
        p::DenseBlock, p::SparseRows, p::InitRequest, p::InitResponse, p::FinishInitRequest,
        p::FinishInitResponse, p::PushRequest, p::TaskOrigin, p::TaskDoneRequest,
        p::TaskDoneResponse, p::PushResponse, p::PullRequest, p::PullResponse,
        p::PullSparseRequest, p::PullSparseResponse, p::LeaveRequest, p::LeaveResponse,
        p::StatusRequest, p::Counters, p::StatusResponse, p::BulkHello, p::BulkPush,
        p::BulkPull, p::BulkError,
    );
}

/// Valid encodings to mutate: messages with every kind of field set.
fn seeds() -> Vec<Vec<u8>> {
    vec![
        p::BulkPush {
            request: Some(p::PushRequest {
                shard: 1,
                shards: 2,
                trainer: "t".into(),
                step: 7,
                dense: vec![p::DenseBlock {
                    id: 3,
                    version: 1,
                    values: vec![1, 2, 3, 4].into(),
                }],
                sparse: vec![p::SparseRows {
                    table: 1,
                    rows: vec![1, 5, 9],
                    values: vec![0; 12].into(),
                }],
                ..Default::default()
            }),
            dense_bytes: vec![4],
            sparse_bytes: vec![12],
        }
        .encode_to_vec(),
        m::TaskFailedRequest {
            trainer: "trainer-1".into(),
            task_id: "00001-0000002-0000004".into(),
            generation: 3,
            reason: "boom".into(),
            records_trained: 10,
        }
        .encode_to_vec(),
        p::BulkHello {
            job: "mnist".into(),
            token: "s3cret".into(),
        }
        .encode_to_vec(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic_a_decoder(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        decode_all(&bytes);
    }

    #[test]
    fn mutated_valid_messages_never_panic_a_decoder(
        seed in 0usize..3,
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut bytes = seeds()[seed].clone();
        for (at, x) in flips {
            let i = at % bytes.len();
            bytes[i] ^= x;
        }
        bytes.truncate(cut % (bytes.len() + 1));
        decode_all(&bytes);
    }
}
