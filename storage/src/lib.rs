//! Where edl's data and checkpoints live, behind one interface: a local path (or a
//! `file://` URL), or an object in a store: `s3://bucket/key` (AWS S3 or any
//! S3-compatible store), `gs://bucket/key` (Google Cloud Storage), `az://container/key`
//! (Azure Blob Storage), all through the `object_store` crate.
//!
//! - [`Location::parse`] reads a path or URL; [`Location::open`] makes its [`Store`].
//!   Credentials and endpoints come from the environment as the clouds' own SDKs take
//!   them (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
//!   `AWS_ENDPOINT_URL` for an S3-compatible store, `AWS_ALLOW_HTTP=true` for one
//!   without TLS; `GOOGLE_APPLICATION_CREDENTIALS`; `AZURE_STORAGE_ACCOUNT_NAME`,
//!   `AZURE_STORAGE_ACCOUNT_KEY`), never from a job spec. Missing credentials are one
//!   error, said before any request ([`Error::Credentials`]).
//! - A [`Store`] reads whole objects and byte ranges, writes objects (each write
//!   replaces the object whole: readers see the old or the new bytes, never a mix; one
//!   too large to hold in memory goes in parts through an [`ObjectWriter`]), lists a
//!   prefix, deletes, and expands globs ([`Store::glob`]).
//! - Errors say the URL ([`Error`]); [`Error::is_transient`] tells what a retry may
//!   cure (a store that is down or slow) from what it cannot (a missing object, a bad
//!   URL, refused credentials).
//!
//! - [`blocking`]: a `Read + Seek` over an object ([`blocking::ObjectReader`], ranged
//!   reads a block at a time), glob expansion, and a store whose calls wait
//!   ([`blocking::BlockingStore`]), for blocking code (RecordIO, checkpoint files).
//!
//! Layout: `location.rs` parsing and opening; `store.rs` the operations; `blocking.rs`;
//! `error.rs`.

pub mod blocking;
mod error;
mod location;
mod store;

pub use error::{Error, Result};
pub use location::{Location, Scheme};
pub use store::{ObjectInfo, ObjectWriter, PARALLEL, PART, Store};
