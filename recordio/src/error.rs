//! Errors: one [`Error`] for the crate, with [`CorruptionKind`] saying what was wrong with
//! a chunk so callers can tell a torn tail from real corruption.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::header::{HEADER_LEN, MAGIC};

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong reading or writing RecordIO files.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O error on a file (or stream) named by `path`.
    #[error("i/o error on {}: {source}", DisplayName(path))]
    Io {
        /// The file the error happened on (empty for an unnamed stream).
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A chunk of a file is corrupt or truncated.
    #[error(
        "corrupt recordio file {} at byte {offset} (chunk {chunk}): {kind}",
        DisplayName(path)
    )]
    Corruption {
        /// The file.
        path: PathBuf,
        /// Byte offset of the start (header) of the bad chunk.
        offset: u64,
        /// Ordinal of the bad chunk in the file (0-based).
        chunk: u64,
        /// What is wrong.
        kind: CorruptionKind,
    },

    /// A glob pattern could not be parsed.
    #[error("invalid glob pattern {pattern:?}: {reason}")]
    Glob {
        /// The pattern as given.
        pattern: String,
        /// Why it is invalid.
        reason: String,
    },

    /// A pattern (or plain path) matched no file.
    #[error("no files match {pattern:?}")]
    NoMatch {
        /// The pattern as given.
        pattern: String,
    },

    /// A record is too large to be framed (its length must fit the format's u32 fields).
    #[error("record of {len} bytes exceeds the maximum record size of {max} bytes", max = crate::MAX_RECORD_LEN)]
    RecordTooLarge {
        /// Length of the rejected record.
        len: usize,
    },

    /// A chunk range does not lie within a file's chunk index.
    #[error(
        "chunk range {start}..{end} is out of bounds for {} with {chunks} chunks",
        DisplayName(path)
    )]
    InvalidRange {
        /// The indexed file.
        path: PathBuf,
        /// First chunk asked for.
        start: usize,
        /// One past the last chunk asked for.
        end: usize,
        /// Number of chunks in the index.
        chunks: usize,
    },

    /// A writer is unusable because an earlier write to its sink failed part-way, so the
    /// data already written may end in a torn chunk.
    #[error(
        "recordio writer for {} failed earlier and cannot be used",
        DisplayName(path)
    )]
    WriterFailed {
        /// The file (empty for an unnamed stream).
        path: PathBuf,
    },
}

impl Error {
    /// Whether this is a [`Error::Corruption`] (of any kind, a truncated tail included).
    pub fn is_corruption(&self) -> bool {
        matches!(self, Error::Corruption { .. })
    }

    /// Whether this is a corruption that looks like a torn tail: the file ends inside a
    /// chunk header or payload and nothing valid follows, as after a crash while
    /// writing. A reader may treat the bytes before the torn chunk as the whole file.
    pub fn is_truncated_tail(&self) -> bool {
        matches!(self, Error::Corruption { kind, .. } if kind.is_truncation())
    }

    /// The corruption kind, if this is a [`Error::Corruption`].
    pub fn corruption_kind(&self) -> Option<&CorruptionKind> {
        match self {
            Error::Corruption { kind, .. } => Some(kind),
            _ => None,
        }
    }

    /// The file this error is about, where there is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Error::Io { path, .. }
            | Error::Corruption { path, .. }
            | Error::InvalidRange { path, .. }
            | Error::WriterFailed { path } => Some(path),
            Error::Glob { .. } | Error::NoMatch { .. } | Error::RecordTooLarge { .. } => None,
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// What is wrong with a corrupt chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CorruptionKind {
    /// The chunk does not start with the magic number.
    BadMagic {
        /// The u32 found where the magic number should be.
        found: u32,
    },
    /// The CRC32 of the payload does not match the header.
    ChecksumMismatch {
        /// The checksum in the header.
        expected: u32,
        /// The checksum of the payload bytes read.
        actual: u32,
    },
    /// The header names a compressor this crate does not know.
    UnknownCompressor(u32),
    /// The header claims a payload larger than the rest of the file, and a valid chunk
    /// follows further on (so the size field itself is damaged, not the file torn).
    ImpossibleSize {
        /// The payload size in the header.
        size: u64,
        /// Bytes left in the file after the header.
        remaining: u64,
    },
    /// The file ends inside a chunk header.
    TruncatedHeader {
        /// Header bytes present.
        len: usize,
    },
    /// The file ends inside a chunk payload and no valid chunk follows.
    TruncatedPayload {
        /// Payload bytes the header announces.
        expected: u64,
        /// Payload bytes present.
        available: u64,
    },
    /// The payload passed its checksum but does not decompress.
    Decompress(String),
    /// The payload decompresses to more than the reader's limit
    /// ([`MAX_DECOMPRESSED_CHUNK_BYTES`](crate::MAX_DECOMPRESSED_CHUNK_BYTES)).
    DecompressedTooLarge {
        /// The limit that was exceeded.
        limit: u64,
    },
    /// The decompressed payload is not a sequence of `[u32 length][bytes]` records.
    BadRecordFraming(String),
    /// The payload holds a different number of records than the header says.
    RecordCountMismatch {
        /// Record count in the header.
        header: u32,
        /// Records found in the payload.
        found: u32,
    },
    /// The chunk header differs from the [`ChunkIndex`](crate::ChunkIndex) entry it was
    /// read through: the file changed after it was indexed, or the index is wrong.
    IndexMismatch {
        /// The header field that differs (`magic`, `crc32`, `compressor`, `size`, `records`).
        field: &'static str,
        /// The value in the index.
        expected: u64,
        /// The value in the file.
        found: u64,
    },
}

impl CorruptionKind {
    /// Whether the file simply ends inside this chunk (a torn tail).
    pub fn is_truncation(&self) -> bool {
        matches!(
            self,
            CorruptionKind::TruncatedHeader { .. } | CorruptionKind::TruncatedPayload { .. }
        )
    }
}

impl fmt::Display for CorruptionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CorruptionKind::BadMagic { found } => {
                write!(f, "bad magic number {found:#010x} (expected {MAGIC:#010x})")
            }
            CorruptionKind::ChecksumMismatch { expected, actual } => write!(
                f,
                "checksum mismatch: header says {expected:#010x}, payload has {actual:#010x}"
            ),
            CorruptionKind::UnknownCompressor(id) => write!(f, "unknown compressor id {id}"),
            CorruptionKind::ImpossibleSize { size, remaining } => write!(
                f,
                "impossible payload size {size}: only {remaining} bytes follow the header"
            ),
            CorruptionKind::TruncatedHeader { len } => {
                write!(f, "truncated chunk header: {len} of {HEADER_LEN} bytes")
            }
            CorruptionKind::TruncatedPayload {
                expected,
                available,
            } => write!(
                f,
                "truncated chunk payload: {available} of {expected} bytes"
            ),
            CorruptionKind::Decompress(msg) => write!(f, "payload does not decompress: {msg}"),
            CorruptionKind::DecompressedTooLarge { limit } => write!(
                f,
                "payload decompresses to more than the limit of {limit} bytes"
            ),
            CorruptionKind::BadRecordFraming(msg) => write!(f, "bad record framing: {msg}"),
            CorruptionKind::RecordCountMismatch { header, found } => write!(
                f,
                "record count mismatch: header says {header}, payload holds {found}"
            ),
            CorruptionKind::IndexMismatch {
                field,
                expected,
                found,
            } => write!(
                f,
                "chunk header does not match the index: {field} is {found}, index says {expected}"
            ),
        }
    }
}

/// Displays a path, or `<stream>` for the empty path of an unnamed reader or writer.
struct DisplayName<'a>(&'a Path);

impl fmt::Display for DisplayName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.as_os_str().is_empty() {
            f.write_str("<stream>")
        } else {
            fmt::Display::fmt(&self.0.display(), f)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corruption_message_names_file_offset_and_chunk() {
        let err = Error::Corruption {
            path: PathBuf::from("/data/part-0"),
            offset: 1044,
            chunk: 3,
            kind: CorruptionKind::ChecksumMismatch {
                expected: 0xdead_beef,
                actual: 1,
            },
        };
        assert_eq!(
            err.to_string(),
            "corrupt recordio file /data/part-0 at byte 1044 (chunk 3): checksum mismatch: \
             header says 0xdeadbeef, payload has 0x00000001"
        );
        assert!(err.is_corruption());
        assert!(!err.is_truncated_tail());
        assert_eq!(err.path(), Some(Path::new("/data/part-0")));
    }

    #[test]
    fn truncation_is_told_apart() {
        let torn = Error::Corruption {
            path: PathBuf::new(),
            offset: 0,
            chunk: 0,
            kind: CorruptionKind::TruncatedHeader { len: 7 },
        };
        assert!(torn.is_truncated_tail());
        assert!(torn.to_string().contains("<stream>"));
        let io = Error::io("x", std::io::Error::other("boom"));
        assert!(!io.is_corruption());
        assert!(!io.is_truncated_tail());
        assert_eq!(io.to_string(), "i/o error on x: boom");
    }
}
