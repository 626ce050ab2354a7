//! RecordIO: chunked, checksummed record files, byte-compatible with PaddlePaddle's Go
//! RecordIO (`github.com/PaddlePaddle/recordio`). A dataset of edl is a set of these
//! files; the master splits it into tasks (runs of chunks) from [`ChunkIndex`]es and a
//! trainer reads its task with a [`RangeScanner`].
//!
//! # Format
//!
//! A file is a sequence of chunks. Each chunk is a 20-byte little-endian header — magic
//! `0x01020304`, CRC32 (IEEE) of the stored payload, compressor id, stored payload size,
//! record count (see [`header`]) — followed by the payload. Uncompressed, the payload is a
//! sequence of `[u32 length][bytes]` records. Compressors: 0 none, 1 snappy (framed
//! stream), 2 gzip and 3 zstd, the last an extension of this crate. An empty file holds
//! no records; records may be empty; a record larger than the chunk size gets a chunk of
//! its own.
//!
//! # Layout
//!
//! - [`header`]: the chunk header, its encoding and the magic number.
//! - `compress.rs`: [`Compressor`] and bounded (de)compression of payloads.
//! - `chunk.rs`: [`Chunk`], a decoded chunk handing out records as slices.
//! - `writer.rs`: [`Writer`], framing records into chunks on any `Write`.
//! - `file_writer.rs`: [`FileWriter`], a file written under a temporary name and
//!   renamed into place when finished.
//! - `reader.rs`: [`ChunkReader`], strict or lenient (resynchronising) chunk reading.
//! - `index.rs`: [`ChunkIndex`], the chunks of a file from its headers alone.
//! - `scanner.rs`: [`Scanner`] over many files and [`RangeScanner`] over a chunk range.
//! - `paths.rs`: [`expand_globs`].
//! - `error.rs`: [`Error`] and [`CorruptionKind`].
//!
//! # Errors and corruption
//!
//! Nothing read from a file is trusted: sizes are checked against the bytes present
//! before anything is allocated, decompression is capped at
//! [`MAX_DECOMPRESSED_CHUNK_BYTES`], and record framing must match the header. A bad
//! chunk is an [`Error::Corruption`] naming the file, the chunk's byte offset and
//! ordinal; [`Error::is_truncated_tail`] tells a torn tail (the file ends inside a chunk
//! and nothing valid follows) from damage. With [`ReadOptions::lenient`] readers skip
//! damaged regions, resynchronising at the next chunk whose payload verifies, and count
//! what they skipped in [`ReadStats`].
//!
//! # Example
//!
//! ```
//! use edl_recordio::{ChunkIndex, FileWriter, RangeScanner, ReadOptions, WriterOptions};
//!
//! # fn main() -> edl_recordio::Result<()> {
//! # let dir = tempfile::tempdir().map_err(|e| edl_recordio::Error::Io { path: ".".into(), source: e })?;
//! let path = dir.path().join("part-00000");
//! let mut writer = FileWriter::create(&path, WriterOptions::default())?;
//! writer.write(b"first")?;
//! writer.write(b"second")?;
//! writer.finish()?;
//!
//! let index = ChunkIndex::build(&path)?;
//! let mut scanner = RangeScanner::open(&index, 0..index.len(), ReadOptions::default())?;
//! while let Some(record) = scanner.next_record()? {
//!     println!("{} bytes", record.len());
//! }
//! assert_eq!(scanner.stats().records, 2);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod chunk;
mod compress;
mod error;
mod file_writer;
pub mod header;
mod index;
mod paths;
mod reader;
mod scanner;
mod writer;

#[cfg(test)]
mod tests;

pub use chunk::{Chunk, Records};
pub use compress::{Compressor, ParseCompressorError};
pub use error::{CorruptionKind, Error, Result};
pub use file_writer::FileWriter;
pub use header::{ChunkHeader, HEADER_LEN, MAGIC};
pub use index::{ChunkIndex, ChunkMeta};
pub use paths::expand_globs;
pub use reader::{ChunkReader, MAX_DECOMPRESSED_CHUNK_BYTES, ReadOptions, ReadStats};
pub use scanner::{Opener, RangeScanner, Scanner, Source};
pub use writer::{DEFAULT_MAX_CHUNK_BYTES, MAX_RECORD_LEN, WriteStats, Writer, WriterOptions};
