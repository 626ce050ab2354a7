//! The chunk index of a file: where each chunk starts and what its header says, built by
//! walking the headers only. The master splits a dataset into tasks (runs of chunks) from
//! these indexes; a trainer reads a task with [`RangeScanner`](crate::RangeScanner).

use std::fs::File;
use std::io::{Read, Seek};
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::compress::Compressor;
use crate::error::{CorruptionKind, Error, Result};
use crate::header::ChunkHeader;
use crate::reader::{ChunkReader, ReadOptions};

/// One chunk of a file, as its header describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkMeta {
    /// Byte offset of the chunk header.
    pub offset: u64,
    /// How the payload is stored.
    pub compressor: Compressor,
    /// Size of the stored payload.
    pub compressed_len: u32,
    /// Number of records.
    pub records: u32,
    /// CRC32 of the stored payload.
    pub crc32: u32,
}

impl ChunkMeta {
    pub(crate) fn from_header(offset: u64, header: &ChunkHeader) -> ChunkMeta {
        ChunkMeta {
            offset,
            compressor: header.compressor,
            compressed_len: header.compressed_len,
            records: header.records,
            crc32: header.crc32,
        }
    }

    /// Size of the chunk on disk, header included.
    pub fn chunk_len(&self) -> u64 {
        crate::header::HEADER_LEN as u64 + u64::from(self.compressed_len)
    }

    /// The first header field that differs from this entry, if any.
    pub(crate) fn mismatch(&self, header: &ChunkHeader) -> Option<CorruptionKind> {
        let fields = [
            ("crc32", self.crc32, header.crc32),
            ("compressor", self.compressor.id(), header.compressor.id()),
            ("size", self.compressed_len, header.compressed_len),
            ("records", self.records, header.records),
        ];
        fields
            .into_iter()
            .find(|&(_, expected, found)| expected != found)
            .map(|(field, expected, found)| CorruptionKind::IndexMismatch {
                field,
                expected: expected.into(),
                found: found.into(),
            })
    }
}

/// The chunks of one file.
#[derive(Clone, Debug)]
pub struct ChunkIndex {
    /// The indexed file.
    pub path: PathBuf,
    /// Its length when indexed.
    pub file_len: u64,
    /// Its chunks, in file order.
    pub chunks: Vec<ChunkMeta>,
}

impl ChunkIndex {
    /// Indexes the file at `path` by walking its chunk headers, seeking over the payloads
    /// (which are neither read nor checked). A bad magic number, an unknown compressor,
    /// a payload running past the end of the file or a torn header is an
    /// [`Error::Corruption`]; [`Error::is_truncated_tail`] tells a torn tail apart.
    pub fn build(path: impl AsRef<Path>) -> Result<ChunkIndex> {
        let path = path.as_ref();
        // Unbuffered: each header is a seek and a 20-byte read.
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        ChunkIndex::from_reader(file, path.to_path_buf())
    }

    /// Indexes a stream; `path` names it in errors and in the index.
    pub fn from_reader<R: Read + Seek>(reader: R, path: PathBuf) -> Result<ChunkIndex> {
        let mut reader = ChunkReader::new(reader, path, ReadOptions::strict());
        let mut chunks = Vec::new();
        while let Some(meta) = reader.next_meta()? {
            chunks.push(meta);
        }
        Ok(ChunkIndex {
            file_len: reader.position(),
            path: reader.path().to_path_buf(),
            chunks,
        })
    }

    /// Total number of records.
    pub fn records(&self) -> u64 {
        self.chunks.iter().map(|c| u64::from(c.records)).sum()
    }

    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether the file has no chunks.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Consecutive ranges of at most `chunks_per_range` chunks covering the whole file
    /// (a `chunks_per_range` of 0 is taken as 1).
    pub fn ranges(&self, chunks_per_range: usize) -> impl Iterator<Item = Range<usize>> + '_ {
        let step = chunks_per_range.max(1);
        (0..self.chunks.len())
            .step_by(step)
            .map(move |start| start..(start.saturating_add(step)).min(self.chunks.len()))
    }

    /// Consecutive ranges of chunks covering the whole file, each the fewest chunks that
    /// hold at least `min_records` records (the last may hold fewer; a chunk holding
    /// more is a range alone).
    pub fn ranges_of_records(&self, min_records: u64) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let (mut start, mut held) = (0, 0u64);
        for (i, c) in self.chunks.iter().enumerate() {
            held += u64::from(c.records);
            if held >= min_records.max(1) {
                out.push(start..i + 1);
                (start, held) = (i + 1, 0);
            }
        }
        if start < self.chunks.len() {
            out.push(start..self.chunks.len());
        }
        out
    }

    /// Number of records in the chunks `range` (chunks outside the index count nothing).
    pub fn records_in(&self, range: Range<usize>) -> u64 {
        self.chunks
            .get(range)
            .unwrap_or_default()
            .iter()
            .map(|c| u64::from(c.records))
            .sum()
    }
}
