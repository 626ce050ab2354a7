//! Reading chunk by chunk: [`ChunkReader`] over any `Read + Seek` source, with strict
//! (stop at the first corrupt chunk) and lenient (skip it and resynchronise) modes.

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::ops::AddAssign;
use std::path::{Path, PathBuf};

use crate::chunk::Chunk;
use crate::compress::{self, Compressor};
use crate::error::{CorruptionKind, Error, Result};
use crate::header::{ChunkHeader, HEADER_LEN, MAGIC_BYTES};
use crate::index::ChunkMeta;

/// The most bytes a compressed chunk may decompress to (1 GiB). A larger output is
/// reported as [`CorruptionKind::DecompressedTooLarge`], so a decompression bomb or a
/// damaged payload cannot exhaust memory. Writers store larger payloads uncompressed.
pub const MAX_DECOMPRESSED_CHUNK_BYTES: u64 = 1 << 30;

/// Capacity of the `BufReader` put around files. Payloads larger than this bypass the
/// buffer, so most bytes are copied once.
pub(crate) const READ_BUFFER_BYTES: usize = 64 << 10;

/// Block size used when scanning for the next chunk header after a corrupt region.
const SCAN_BLOCK_BYTES: usize = 64 << 10;

/// How to read.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadOptions {
    /// On a corrupt or truncated chunk, skip forward to the next valid chunk header (one
    /// whose payload passes its checksum and decodes) instead of failing, and count what
    /// was skipped in [`ReadStats`]. I/O errors still fail.
    pub lenient: bool,
}

impl ReadOptions {
    /// Fail at the first corrupt chunk (the default).
    pub const fn strict() -> ReadOptions {
        ReadOptions { lenient: false }
    }

    /// Skip corrupt regions, counting them.
    pub const fn lenient() -> ReadOptions {
        ReadOptions { lenient: true }
    }
}

/// What a reader has read so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Valid chunks read.
    pub chunks: u64,
    /// Records read.
    pub records: u64,
    /// Record bytes read (sum of record lengths).
    pub bytes: u64,
    /// Stored (compressed) payload bytes of the valid chunks read, headers excluded.
    pub compressed_bytes: u64,
    /// Corrupt regions skipped by a lenient reader; each counts as one chunk.
    pub skipped_chunks: u64,
    /// Bytes skipped by a lenient reader.
    pub skipped_bytes: u64,
}

impl ReadStats {
    pub(crate) fn count_chunk(&mut self, chunk: &Chunk) {
        self.chunks += 1;
        self.records += chunk.len() as u64;
        self.bytes += chunk.record_bytes();
        self.compressed_bytes += chunk.header().map_or(0, |h| u64::from(h.compressed_len));
    }
}

impl AddAssign for ReadStats {
    fn add_assign(&mut self, other: ReadStats) {
        self.chunks += other.chunks;
        self.records += other.records;
        self.bytes += other.bytes;
        self.compressed_bytes += other.compressed_bytes;
        self.skipped_chunks += other.skipped_chunks;
        self.skipped_bytes += other.skipped_bytes;
    }
}

/// Reads a RecordIO stream chunk by chunk.
///
/// Offsets are positions in `inner` counted from its start; reading starts at offset 0
/// and ends at the length `inner` had when the first chunk was read. Each chunk's payload
/// is read with one read, checked against its CRC, decompressed (bounded by
/// [`MAX_DECOMPRESSED_CHUNK_BYTES`]) and split into records.
///
/// In strict mode the first corrupt chunk is returned as an [`Error::Corruption`], after
/// which the reader is finished. In lenient mode it is logged, counted and skipped.
/// I/O errors are returned in both modes and leave the reader where it was.
#[derive(Debug)]
pub struct ChunkReader<R> {
    inner: R,
    name: PathBuf,
    opts: ReadOptions,
    /// Offset of the next chunk header.
    next: u64,
    /// Where `inner` is positioned, when known.
    inner_pos: Option<u64>,
    /// Length of the stream, read on first use.
    len: Option<u64>,
    /// Ordinal of the next chunk.
    ordinal: u64,
    stats: ReadStats,
    /// Buffer for compressed payloads.
    scratch: Vec<u8>,
    done: bool,
}

impl ChunkReader<BufReader<File>> {
    /// Opens the file at `path` for reading.
    pub fn open(path: impl AsRef<Path>, opts: ReadOptions) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        Ok(ChunkReader::new(
            BufReader::with_capacity(READ_BUFFER_BYTES, file),
            path.to_path_buf(),
            opts,
        ))
    }
}

impl<R: Read + Seek> ChunkReader<R> {
    /// A reader over `inner`; `name` is the file name used in errors.
    pub fn new(inner: R, name: PathBuf, opts: ReadOptions) -> Self {
        ChunkReader {
            inner,
            name,
            opts,
            next: 0,
            inner_pos: None,
            len: None,
            ordinal: 0,
            stats: ReadStats::default(),
            scratch: Vec::new(),
            done: false,
        }
    }

    /// Starts reading at the chunk at byte `offset`, chunk number `ordinal` of the file
    /// (as an index found them: a task's first chunk), not at the file's start.
    pub fn starting_at(mut self, offset: u64, ordinal: u64) -> Self {
        self.next = offset;
        self.ordinal = ordinal;
        self
    }

    /// The next chunk, or `None` at the end of the file.
    pub fn next_chunk(&mut self) -> Result<Option<Chunk>> {
        let mut chunk = Chunk::default();
        Ok(self.next_chunk_into(&mut chunk)?.then_some(chunk))
    }

    /// Reads the next chunk into `chunk`, reusing its buffers; `false` at the end of the
    /// file (and `chunk` is then empty).
    pub fn next_chunk_into(&mut self, chunk: &mut Chunk) -> Result<bool> {
        chunk.reset();
        if self.done {
            return Ok(false);
        }
        let offset = self.next;
        let len = self.len()?;
        if offset >= len {
            self.done = true;
            return Ok(false);
        }
        let kind = match self.decode_at(offset, None, chunk, true)? {
            Ok(next) => {
                self.accept(chunk, next);
                return Ok(true);
            }
            Err(kind) => kind,
        };
        let ordinal = self.ordinal;
        if !self.opts.lenient {
            self.done = true;
            return Err(self.corruption(offset, ordinal, kind));
        }
        tracing::warn!(
            path = %self.name.display(),
            offset,
            chunk = ordinal,
            error = %kind,
            "skipping corrupt recordio chunk"
        );
        self.ordinal += 1;
        self.stats.skipped_chunks += 1;
        match self.find_valid_chunk(offset + 1, chunk)? {
            Some((at, next)) => {
                self.stats.skipped_bytes += at - offset;
                tracing::warn!(
                    path = %self.name.display(),
                    offset = at,
                    skipped_bytes = at - offset,
                    "resynchronised at next valid recordio chunk"
                );
                self.accept(chunk, next);
                Ok(true)
            }
            None => {
                self.stats.skipped_bytes += len - offset;
                tracing::warn!(
                    path = %self.name.display(),
                    skipped_bytes = len - offset,
                    "no valid recordio chunk after corrupt region, skipped to end of file"
                );
                chunk.reset();
                self.next = len;
                self.done = true;
                Ok(false)
            }
        }
    }

    /// What has been read so far.
    pub fn stats(&self) -> ReadStats {
        self.stats
    }

    /// The name used in errors.
    pub fn path(&self) -> &Path {
        &self.name
    }

    /// Offset of the next chunk header to read.
    pub fn position(&self) -> u64 {
        self.next
    }

    /// The underlying reader.
    pub fn into_inner(self) -> R {
        self.inner
    }

    /// Reads the header of the next chunk and skips over its payload without reading or
    /// checking it (strict; used to build an index).
    pub(crate) fn next_meta(&mut self) -> Result<Option<ChunkMeta>> {
        if self.done {
            return Ok(None);
        }
        let offset = self.next;
        if offset >= self.len()? {
            self.done = true;
            return Ok(None);
        }
        match self.read_header(offset, None, true)? {
            Ok(header) => {
                self.next = offset + header.chunk_len();
                self.ordinal += 1;
                Ok(Some(ChunkMeta::from_header(offset, &header)))
            }
            Err(kind) => {
                self.done = true;
                let ordinal = self.ordinal;
                Err(self.corruption(offset, ordinal, kind))
            }
        }
    }

    /// Reads the chunk an index entry describes, checking the header against it.
    /// `ordinal` is the entry's position in the index. Counts the chunk on success.
    pub(crate) fn read_indexed(
        &mut self,
        meta: &ChunkMeta,
        ordinal: u64,
        chunk: &mut Chunk,
    ) -> Result<Result<(), CorruptionKind>> {
        chunk.reset();
        let decoded = self.decode_at(meta.offset, Some(meta), chunk, true)?;
        if decoded.is_ok() {
            chunk.index = ordinal;
            self.stats.count_chunk(chunk);
        }
        Ok(decoded.map(|_| ()))
    }

    /// Counts a chunk skipped by a caller that knows where the next one starts.
    pub(crate) fn count_skipped(&mut self, bytes: u64) {
        self.stats.skipped_chunks += 1;
        self.stats.skipped_bytes += bytes;
    }

    pub(crate) fn corruption(&self, offset: u64, chunk: u64, kind: CorruptionKind) -> Error {
        Error::Corruption {
            path: self.name.clone(),
            offset,
            chunk,
            kind,
        }
    }

    fn accept(&mut self, chunk: &mut Chunk, next: u64) {
        chunk.index = self.ordinal;
        self.ordinal += 1;
        self.next = next;
        self.stats.count_chunk(chunk);
    }

    /// Length of the stream, found by seeking to its end on first use.
    fn len(&mut self) -> Result<u64> {
        if let Some(len) = self.len {
            return Ok(len);
        }
        self.inner_pos = None;
        let len = self
            .inner
            .seek(SeekFrom::End(0))
            .map_err(|e| Error::io(&self.name, e))?;
        self.inner_pos = Some(len);
        self.len = Some(len);
        Ok(len)
    }

    fn seek_to(&mut self, offset: u64) -> Result<()> {
        if self.inner_pos != Some(offset) {
            self.inner_pos = None;
            self.inner
                .seek(SeekFrom::Start(offset))
                .map_err(|e| Error::io(&self.name, e))?;
            self.inner_pos = Some(offset);
        }
        Ok(())
    }

    /// Reads into `buf` from `offset` until it is full or the stream ends; returns the
    /// number of bytes read.
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        self.seek_to(offset)?;
        self.inner_pos = None;
        let n = read_full(&mut self.inner, buf).map_err(|e| Error::io(&self.name, e))?;
        self.inner_pos = Some(offset + n as u64);
        Ok(n)
    }

    /// Reads and checks the header at `offset`: magic, compressor, the index entry when
    /// there is one, and that the payload fits in the stream. When it does not and
    /// `classify` is set, a scan for a later valid chunk decides whether the stream is torn
    /// (`TruncatedPayload`) or the size field damaged (`ImpossibleSize`).
    fn read_header(
        &mut self,
        offset: u64,
        expect: Option<&ChunkMeta>,
        classify: bool,
    ) -> Result<Result<ChunkHeader, CorruptionKind>> {
        let remaining = self.len()?.saturating_sub(offset);
        if remaining < HEADER_LEN as u64 {
            return Ok(Err(CorruptionKind::TruncatedHeader {
                len: remaining as usize,
            }));
        }
        let mut bytes = [0u8; HEADER_LEN];
        let n = self.read_at(offset, &mut bytes)?;
        if n < HEADER_LEN {
            // The stream shrank since its length was taken.
            return Ok(Err(CorruptionKind::TruncatedHeader { len: n }));
        }
        let header = match ChunkHeader::decode(&bytes) {
            Ok(header) => header,
            Err(kind) => return Ok(Err(kind)),
        };
        if let Some(kind) = expect.and_then(|meta| meta.mismatch(&header)) {
            return Ok(Err(kind));
        }
        let size = u64::from(header.compressed_len);
        let available = remaining - HEADER_LEN as u64;
        if size > available {
            let mut probe = Chunk::default();
            let damaged = classify && self.find_valid_chunk(offset + 1, &mut probe)?.is_some();
            return Ok(Err(if damaged {
                CorruptionKind::ImpossibleSize {
                    size,
                    remaining: available,
                }
            } else {
                CorruptionKind::TruncatedPayload {
                    expected: size,
                    available,
                }
            }));
        }
        Ok(Ok(header))
    }

    /// Reads, checks and decodes the chunk at `offset` into `chunk`. Returns the offset
    /// of the chunk after it, or what is wrong with it; `Err` only for I/O errors.
    fn decode_at(
        &mut self,
        offset: u64,
        expect: Option<&ChunkMeta>,
        chunk: &mut Chunk,
        classify: bool,
    ) -> Result<Result<u64, CorruptionKind>> {
        chunk.reset();
        let header = match self.read_header(offset, expect, classify)? {
            Ok(header) => header,
            Err(kind) => return Ok(Err(kind)),
        };
        // The payload fits in the stream (checked above), so these buffers are backed by
        // bytes that exist.
        let len = header.compressed_len as usize;
        let payload_at = offset + HEADER_LEN as u64;
        let payload_len = if header.compressor == Compressor::None {
            let buf = chunk.raw_buffer(len);
            self.seek_to(payload_at)?;
            self.inner_pos = None;
            let n = read_full(&mut self.inner, buf).map_err(|e| Error::io(&self.name, e))?;
            self.inner_pos = Some(payload_at + n as u64);
            if let Err(kind) = check_payload(&header, n, buf) {
                return Ok(Err(kind));
            }
            len
        } else {
            if self.scratch.len() < len {
                self.scratch.resize(len, 0);
            }
            let mut scratch = std::mem::take(&mut self.scratch);
            let read = self.read_at(payload_at, &mut scratch[..len]);
            let decoded = read.map(|n| {
                check_payload(&header, n, &scratch[..len]).and_then(|()| {
                    let out = chunk.decompress_buffer();
                    compress::decompress(
                        header.compressor,
                        &scratch[..len],
                        out,
                        MAX_DECOMPRESSED_CHUNK_BYTES,
                    )
                    .map(|()| out.len())
                })
            });
            self.scratch = scratch;
            match decoded? {
                Ok(n) => n,
                Err(kind) => return Ok(Err(kind)),
            }
        };
        if let Err(kind) = chunk.parse(header, payload_len) {
            chunk.reset();
            return Ok(Err(kind));
        }
        chunk.offset = offset;
        Ok(Ok(offset + header.chunk_len()))
    }

    /// Scans forward from `from` for a chunk that decodes cleanly, decoding it into
    /// `chunk`. Returns its offset and the offset after it.
    fn find_valid_chunk(&mut self, from: u64, chunk: &mut Chunk) -> Result<Option<(u64, u64)>> {
        let len = self.len()?;
        let mut window = vec![0u8; SCAN_BLOCK_BYTES];
        let mut pos = from;
        while pos.saturating_add(HEADER_LEN as u64) <= len {
            let want = usize::try_from(len - pos)
                .unwrap_or(usize::MAX)
                .min(SCAN_BLOCK_BYTES);
            let n = self.read_at(pos, &mut window[..want])?;
            if n < MAGIC_BYTES.len() {
                break;
            }
            match window[..n]
                .windows(MAGIC_BYTES.len())
                .position(|w| w == MAGIC_BYTES.as_slice())
            {
                Some(i) => {
                    let candidate = pos + i as u64;
                    if let Ok(next) = self.decode_at(candidate, None, chunk, false)? {
                        return Ok(Some((candidate, next)));
                    }
                    pos = candidate + 1;
                }
                // Keep the last bytes: a magic number may straddle two blocks.
                None => pos += (n - (MAGIC_BYTES.len() - 1)) as u64,
            }
        }
        chunk.reset();
        Ok(None)
    }
}

/// Checks that a whole payload was read and that its CRC matches the header.
fn check_payload(header: &ChunkHeader, read: usize, payload: &[u8]) -> Result<(), CorruptionKind> {
    let expected = u64::from(header.compressed_len);
    if (read as u64) < expected {
        return Err(CorruptionKind::TruncatedPayload {
            expected,
            available: read as u64,
        });
    }
    let actual = crc32fast::hash(payload);
    if actual != header.crc32 {
        return Err(CorruptionKind::ChecksumMismatch {
            expected: header.crc32,
            actual,
        });
    }
    Ok(())
}

/// Reads until `buf` is full or the reader is exhausted; returns the bytes read.
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}
