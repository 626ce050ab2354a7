//! Writing: [`Writer`] frames records into chunks on any `Write` sink.

use std::fmt;
use std::io::Write;
use std::path::PathBuf;

use crate::chunk::{append_record, framed_len};
use crate::compress::{Compression, Compressor};
use crate::error::{Error, Result};
use crate::header::{ChunkHeader, HEADER_LEN};
use crate::reader::MAX_DECOMPRESSED_CHUNK_BYTES;

/// Uncompressed payload size at which a writer flushes a chunk (1 MiB).
pub const DEFAULT_MAX_CHUNK_BYTES: usize = 1 << 20;

/// The largest record a chunk can frame: its 4-byte length prefix plus the record must
/// fit in the u32 payload size of a chunk header.
pub const MAX_RECORD_LEN: usize = u32::MAX as usize - 4;

/// How to write.
#[derive(Clone, Debug)]
pub struct WriterOptions {
    /// Uncompressed payload bytes (records plus their 4-byte length prefixes) at which
    /// the buffered records are flushed as a chunk. A record that would take the buffer
    /// past it first flushes what is buffered, so only a single record larger than this
    /// makes a larger chunk. Values above [`MAX_DECOMPRESSED_CHUNK_BYTES`] are capped to
    /// it; 0 writes every record in its own chunk.
    pub max_chunk_bytes: usize,
    /// How chunk payloads are compressed.
    pub compressor: Compressor,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            max_chunk_bytes: DEFAULT_MAX_CHUNK_BYTES,
            compressor: Compressor::default(),
        }
    }
}

/// What a writer has written so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Records accepted (buffered ones included).
    pub records: u64,
    /// Chunks written.
    pub chunks: u64,
    /// Record bytes accepted (sum of record lengths, buffered ones included; framing
    /// excluded), comparable with [`ReadStats::bytes`](crate::ReadStats::bytes).
    pub uncompressed_bytes: u64,
    /// Bytes written to the sink: chunk headers plus stored payloads.
    pub file_bytes: u64,
}

/// Writes records as RecordIO chunks to a `Write` sink.
///
/// Records are buffered until a chunk is full, then the chunk is compressed, checksummed
/// and written with a single `write_all`. Dropping a `Writer` does **not** write the
/// buffered records: call [`Writer::flush_chunk`] or [`Writer::into_inner`]. If writing
/// to the sink fails the writer refuses further use ([`Error::WriterFailed`]), since the
/// sink may now end in a torn chunk.
pub struct Writer<W: Write> {
    inner: W,
    name: PathBuf,
    /// Effective flush threshold.
    threshold: usize,
    compressor: Compressor,
    /// A header-sized gap followed by the uncompressed payload being built.
    buf: Vec<u8>,
    buf_records: u32,
    /// A header-sized gap followed by the compressed payload.
    packed: Vec<u8>,
    compression: Compression,
    stats: WriteStats,
    failed: bool,
}

impl<W: Write> fmt::Debug for Writer<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Writer")
            .field("name", &self.name)
            .field("threshold", &self.threshold)
            .field("compressor", &self.compressor)
            .field("buffered_records", &self.buf_records)
            .field("stats", &self.stats)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl<W: Write> Writer<W> {
    /// A writer on `inner`.
    pub fn new(inner: W, opts: WriterOptions) -> Self {
        let threshold = opts
            .max_chunk_bytes
            .min(usize::try_from(MAX_DECOMPRESSED_CHUNK_BYTES).unwrap_or(usize::MAX));
        let mut buf = Vec::with_capacity(HEADER_LEN + threshold.min(DEFAULT_MAX_CHUNK_BYTES) + 64);
        buf.resize(HEADER_LEN, 0);
        Writer {
            inner,
            name: PathBuf::new(),
            threshold,
            compressor: opts.compressor,
            buf,
            buf_records: 0,
            packed: Vec::new(),
            compression: Compression::default(),
            stats: WriteStats::default(),
            failed: false,
        }
    }

    /// Names the sink in errors (a file path, usually).
    pub fn with_name(mut self, name: impl Into<PathBuf>) -> Self {
        self.name = name.into();
        self
    }

    /// Appends a record, flushing a chunk when the buffer is full.
    pub fn write(&mut self, record: &[u8]) -> Result<()> {
        self.check_usable()?;
        if record.len() > MAX_RECORD_LEN {
            return Err(Error::RecordTooLarge { len: record.len() });
        }
        let framed = framed_len(record.len());
        let buffered = self.buf.len() - HEADER_LEN;
        if self.buf_records > 0
            && (buffered.saturating_add(framed) > self.threshold
                || buffered.saturating_add(framed) > u32::MAX as usize
                || self.buf_records == u32::MAX)
        {
            self.write_chunk()?;
        }
        append_record(&mut self.buf, record);
        self.buf_records += 1;
        self.stats.records += 1;
        self.stats.uncompressed_bytes += record.len() as u64;
        if self.buf.len() - HEADER_LEN >= self.threshold {
            self.write_chunk()?;
        }
        Ok(())
    }

    /// Writes the buffered records as one chunk (nothing when none are buffered) and
    /// flushes the sink.
    pub fn flush_chunk(&mut self) -> Result<()> {
        self.check_usable()?;
        self.write_chunk()?;
        let flushed = self.inner.flush();
        self.note_io(flushed)
    }

    /// What has been written so far.
    pub fn stats(&self) -> WriteStats {
        self.stats
    }

    /// Records buffered and not yet written.
    pub fn buffered_records(&self) -> u32 {
        self.buf_records
    }

    /// The sink.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    /// Writes the last chunk, flushes the sink and returns it with the final stats.
    pub fn into_inner(mut self) -> Result<(W, WriteStats)> {
        self.flush_chunk()?;
        Ok((self.inner, self.stats))
    }

    pub(crate) fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    fn check_usable(&self) -> Result<()> {
        if self.failed {
            return Err(Error::WriterFailed {
                path: self.name.clone(),
            });
        }
        Ok(())
    }

    fn note_io(&mut self, result: std::io::Result<()>) -> Result<()> {
        result.map_err(|e| {
            self.failed = true;
            Error::io(&self.name, e)
        })
    }

    /// Writes the buffered records as a chunk, without flushing the sink.
    fn write_chunk(&mut self) -> Result<()> {
        if self.buf_records == 0 {
            return Ok(());
        }
        let payload_len = self.buf.len() - HEADER_LEN;
        // Readers refuse to decompress more than MAX_DECOMPRESSED_CHUNK_BYTES, so a
        // larger payload (a single huge record) is stored as is.
        let mut compressor = if payload_len as u64 > MAX_DECOMPRESSED_CHUNK_BYTES {
            Compressor::None
        } else {
            self.compressor
        };
        if compressor != Compressor::None {
            self.packed.clear();
            self.packed.resize(HEADER_LEN, 0);
            let packed =
                self.compression
                    .compress(compressor, &self.buf[HEADER_LEN..], &mut self.packed);
            if let Err(e) = packed {
                // Compressing into memory cannot fail for lack of space; treat any error
                // as the sink's so the writer is not left half-way.
                return self.note_io(Err(e));
            }
            if u32::try_from(self.packed.len() - HEADER_LEN).is_err() {
                compressor = Compressor::None;
            }
        }
        let frame = if compressor == Compressor::None {
            &mut self.buf
        } else {
            &mut self.packed
        };
        let (head, payload) = frame.split_at_mut(HEADER_LEN);
        let header = ChunkHeader {
            crc32: crc32fast::hash(payload),
            compressor,
            // The payload fits a u32: records are capped and the buffer flushed before
            // it could exceed u32::MAX; compressed payloads were checked above.
            compressed_len: u32::try_from(payload.len()).unwrap_or(u32::MAX),
            records: self.buf_records,
        };
        head.copy_from_slice(&header.encode());
        let written = self.inner.write_all(frame);
        let frame_len = frame.len() as u64;
        self.note_io(written)?;
        self.stats.chunks += 1;
        self.stats.file_bytes += frame_len;
        self.buf.truncate(HEADER_LEN);
        self.buf_records = 0;
        // Do not keep a huge buffer around after a single oversized record.
        let keep = self.threshold.clamp(64 << 10, 16 << 20) * 2;
        if self.buf.capacity() > keep {
            self.buf.shrink_to(keep);
        }
        if self.packed.capacity() > keep {
            self.packed.shrink_to(keep);
        }
        Ok(())
    }
}
