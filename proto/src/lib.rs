//! Protobuf messages and gRPC services of edl.
//!
//! Layout:
//! - [`sample`]: the versioned training-sample encoding stored in RecordIO records
//!   (`proto/edl/sample.proto`), with [`sample::encode`] and [`sample::decode`].
//! - [`master`]: the master's gRPC service (`proto/edl/master.proto`).
//! - [`pserver`]: the parameter server's gRPC service (`proto/edl/pserver.proto`),
//!   with [`codec::SizedProstCodec`] for its large messages.
//! - [`headers`]: the one metadata scheme of both services (job and token on requests,
//!   error details on statuses).
//! - [`tls`]: TLS between edl's processes (gRPC and the bulk path), and the private CA
//!   of a job on one machine.
//! - [`etcd`]: client stubs of the etcd v3 API (`third_party/etcd/`, vendored), which
//!   `edl-coord` speaks to etcd with.
//!
//! Every `.proto` file is compiled by protox (a protobuf compiler in Rust) in
//! `build.rs`: building needs no `protoc`.

pub mod codec;
pub mod headers;
pub mod metrics;
pub mod tls;

#[cfg(test)]
mod tests;

/// The master's gRPC service and messages (`edl.master.v1`).
pub mod master {
    #![allow(missing_docs, missing_debug_implementations, clippy::all)]
    tonic::include_proto!("edl.master.v1");
}

/// The parameter server's gRPC service and messages (`edl.pserver.v1`).
pub mod pserver {
    #![allow(missing_docs, missing_debug_implementations, clippy::all)]
    tonic::include_proto!("edl.pserver.v1");
}

/// The etcd v3 API (client stubs and messages), as etcd publishes it.
pub mod etcd {
    /// KV, Watch, Lease, Cluster, Maintenance and Auth services (`etcdserverpb`).
    pub mod etcdserverpb {
        #![allow(missing_docs, missing_debug_implementations, clippy::all)]
        tonic::include_proto!("etcdserverpb");
    }
    /// Keys, values and events (`mvccpb`).
    pub mod mvccpb {
        #![allow(missing_docs, missing_debug_implementations, clippy::all)]
        tonic::include_proto!("mvccpb");
    }
    /// Users, roles and permissions (`authpb`).
    pub mod authpb {
        #![allow(missing_docs, missing_debug_implementations, clippy::all)]
        tonic::include_proto!("authpb");
    }
}

/// The training sample encoding (`edl.sample.v1`).
pub mod sample {
    #![allow(missing_docs, missing_debug_implementations, clippy::module_inception)]
    tonic::include_proto!("edl.sample.v1");

    use prost::Message;

    mod view;
    pub use view::{SampleView, view};

    /// The sample encoding version written by this build.
    pub const SAMPLE_VERSION: u32 = 1;

    /// Why a record could not be decoded as a [`Sample`].
    #[derive(Debug, thiserror::Error)]
    pub enum DecodeError {
        /// The bytes are not a protobuf `Sample`.
        #[error("record is not a valid sample: {0}")]
        Malformed(prost::DecodeError),
        /// The sample was written by an encoding version this build does not read.
        #[error(
            "unsupported sample encoding version {found} (this build reads version {SAMPLE_VERSION})"
        )]
        Version {
            /// The version found in the record.
            found: u32,
        },
    }

    // The message includes the cause's text, so the cause is not also its `source()`
    // (a report of the chain would say it twice).
    impl From<prost::DecodeError> for DecodeError {
        fn from(e: prost::DecodeError) -> Self {
            DecodeError::Malformed(e)
        }
    }

    impl Sample {
        /// A sample of dense features with a real-valued target.
        pub fn regression(dense: Vec<f32>, value: f32) -> Self {
            Sample {
                version: SAMPLE_VERSION,
                dense,
                label: Some(sample::Label::Value(value)),
                ..Default::default()
            }
        }

        /// A sample of dense features with a class label.
        pub fn classification(dense: Vec<f32>, class_id: u32) -> Self {
            Sample {
                version: SAMPLE_VERSION,
                dense,
                label: Some(sample::Label::ClassId(class_id)),
                ..Default::default()
            }
        }

        /// A sample of sparse ids without a label (a tokenised sentence).
        pub fn sparse(ids: Vec<u64>) -> Self {
            Sample {
                version: SAMPLE_VERSION,
                sparse_ids: ids,
                ..Default::default()
            }
        }
    }

    /// Encodes a sample into record bytes.
    pub fn encode(sample: &Sample) -> Vec<u8> {
        sample.encode_to_vec()
    }

    /// Decodes record bytes into a sample, checking the encoding version.
    pub fn decode(bytes: &[u8]) -> Result<Sample, DecodeError> {
        let sample = Sample::decode(bytes)?;
        if sample.version != SAMPLE_VERSION {
            return Err(DecodeError::Version {
                found: sample.version,
            });
        }
        Ok(sample)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn round_trip_each_label_kind() {
            for s in [
                Sample::regression(vec![1.0, -2.5, 3.25], 24.0),
                Sample::classification(vec![0.0; 784], 7),
                Sample::sparse(vec![1, 5, 99_999]),
            ] {
                assert_eq!(decode(&encode(&s)).unwrap(), s);
            }
        }

        #[test]
        fn unknown_version_is_rejected() {
            let mut s = Sample::regression(vec![1.0], 2.0);
            s.version = 2;
            match decode(&encode(&s)) {
                Err(DecodeError::Version { found: 2 }) => {}
                other => panic!("expected version error, got {other:?}"),
            }
            s.version = 0;
            assert!(matches!(
                decode(&encode(&s)),
                Err(DecodeError::Version { found: 0 })
            ));
        }

        #[test]
        fn garbage_is_malformed_not_a_panic() {
            assert!(matches!(
                decode(&[0xff, 0xff, 0xff]),
                Err(DecodeError::Malformed(_))
            ));
        }
    }
}
