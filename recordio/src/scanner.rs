//! Record-by-record reading: [`Scanner`] over whole files in order, [`RangeScanner`] over
//! a run of chunks of one file (what a task reads).
//!
//! Both hand out records as slices borrowed from the scanner (a lending API): the slice
//! is valid until the next call.
//!
//! Layout: one private record cursor ([`Cursor`]: the current chunk, the position in it,
//! and moving to the next chunk) over a [`ChunkSource`], which says where the next chunk
//! comes from: [`Files`] (whole files in order) for a [`Scanner`], [`IndexedRun`]
//! (indexed chunks of one file) for a [`RangeScanner`].

use std::fs::{self, File};
use std::io::BufReader;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::chunk::Chunk;
use crate::error::{Error, Result};
use crate::index::{ChunkIndex, ChunkMeta};
use crate::reader::{ChunkReader, ReadOptions, ReadStats};

type FileReader = ChunkReader<BufReader<File>>;

/// Bytes a [`Scanner`] reads: a file, or whatever an [`Opener`] gives (an object in a
/// store, read with ranged requests).
pub trait Source: std::io::Read + std::io::Seek + Send + std::fmt::Debug {}
impl<T: std::io::Read + std::io::Seek + Send + std::fmt::Debug> Source for T {}

/// Opens a source of a [`Scanner`] by the name it was given.
pub type Opener = fn(&Path) -> Result<Box<dyn Source>>;

/// The file at `path`, buffered as [`ChunkReader::open`] does.
fn open_file(path: &Path) -> Result<Box<dyn Source>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    Ok(Box::new(BufReader::with_capacity(
        crate::reader::READ_BUFFER_BYTES,
        file,
    )))
}

/// Where a [`Cursor`]'s chunks come from.
trait ChunkSource {
    /// Loads the next chunk into `chunk`; `false` at the end (`chunk` is then left as
    /// it is: the cursor empties it).
    fn load_next(&mut self, chunk: &mut Chunk) -> Result<bool>;
}

/// The record cursor of both scanners: the current chunk, the next record of it, and
/// moving on to the source's next chunk when it is used up.
///
/// Invariant: `pos <= chunk.len()` after every call that returned; at the end the chunk
/// is empty, so later calls keep returning `None`.
#[derive(Debug)]
struct Cursor<S> {
    source: S,
    chunk: Chunk,
    /// Next record of `chunk`.
    pos: usize,
}

impl<S: ChunkSource> Cursor<S> {
    fn new(source: S) -> Self {
        Cursor {
            source,
            chunk: Chunk::default(),
            pos: 0,
        }
    }

    /// The next record, or `None` at the end of the source.
    fn next_record(&mut self) -> Result<Option<&[u8]>> {
        loop {
            if self.pos < self.chunk.len() {
                let i = self.pos;
                self.pos += 1;
                return Ok(self.chunk.get(i));
            }
            if !self.advance()? {
                return Ok(None);
            }
        }
    }

    /// The next whole chunk (the records of the current chunk not yet returned are
    /// skipped), or `None` at the end of the source.
    fn next_chunk(&mut self) -> Result<Option<&Chunk>> {
        if !self.advance()? {
            return Ok(None);
        }
        self.pos = self.chunk.len();
        Ok(Some(&self.chunk))
    }

    /// Loads the source's next chunk; `false` (and an empty chunk) at the end.
    fn advance(&mut self) -> Result<bool> {
        self.pos = 0;
        if self.source.load_next(&mut self.chunk)? {
            return Ok(true);
        }
        self.chunk.reset();
        Ok(false)
    }
}

/// Reads the records of many files, in the order given.
///
/// In strict mode the first error ends the scan: later calls return `Ok(None)`. In
/// lenient mode corrupt chunks are skipped and counted; I/O errors (a missing file, say)
/// still end the scan.
#[derive(Debug)]
pub struct Scanner {
    cursor: Cursor<Files>,
}

/// The chunks of whole files, in order: the source of a [`Scanner`].
#[derive(Debug)]
struct Files {
    paths: Vec<PathBuf>,
    /// Index in `paths` of the next file to open.
    next_file: usize,
    opts: ReadOptions,
    open: Opener,
    reader: Option<ChunkReader<Box<dyn Source>>>,
    /// Stats of the files already finished.
    finished: ReadStats,
    done: bool,
}

impl Scanner {
    /// A scanner over `paths`. Checks up front that each path is there, so a missing file
    /// is reported before anything is read.
    pub fn open(paths: Vec<PathBuf>, opts: ReadOptions) -> Result<Scanner> {
        for path in &paths {
            fs::metadata(path).map_err(|e| Error::io(path, e))?;
        }
        Ok(Self::open_with(paths, opts, open_file))
    }

    /// A scanner over the sources `names`, each opened by `open` when its turn comes (a
    /// missing one is an error then).
    pub fn open_with(names: Vec<PathBuf>, opts: ReadOptions, open: Opener) -> Scanner {
        Scanner {
            cursor: Cursor::new(Files {
                paths: names,
                next_file: 0,
                opts,
                open,
                reader: None,
                finished: ReadStats::default(),
                done: false,
            }),
        }
    }

    /// The next record, or `None` when every file has been read.
    pub fn next_record(&mut self) -> Result<Option<&[u8]>> {
        self.cursor.next_record()
    }

    /// The next whole chunk (the records of the current chunk not yet returned by
    /// [`Scanner::next_record`] are skipped), or `None` when every file has been read.
    pub fn next_chunk(&mut self) -> Result<Option<&Chunk>> {
        self.cursor.next_chunk()
    }

    /// What has been read so far, over all files.
    pub fn stats(&self) -> ReadStats {
        let files = &self.cursor.source;
        let mut stats = files.finished;
        if let Some(reader) = &files.reader {
            stats += reader.stats();
        }
        stats
    }

    /// The file being read, if any.
    pub fn current_path(&self) -> Option<&Path> {
        self.cursor.source.reader.as_ref().map(ChunkReader::path)
    }
}

impl ChunkSource for Files {
    /// Loads the next chunk of any file.
    fn load_next(&mut self, chunk: &mut Chunk) -> Result<bool> {
        loop {
            if self.done {
                return Ok(false);
            }
            let reader = match &mut self.reader {
                Some(reader) => reader,
                None => {
                    let Some(path) = self.paths.get(self.next_file) else {
                        self.done = true;
                        continue;
                    };
                    self.next_file += 1;
                    match (self.open)(path) {
                        Ok(source) => {
                            self.reader
                                .insert(ChunkReader::new(source, path.clone(), self.opts))
                        }
                        Err(e) => {
                            self.done = true;
                            return Err(e);
                        }
                    }
                }
            };
            match reader.next_chunk_into(chunk) {
                Ok(true) => return Ok(true),
                Ok(false) => {
                    self.finished += reader.stats();
                    self.reader = None;
                }
                Err(e) => {
                    self.finished += reader.stats();
                    self.reader = None;
                    self.done = true;
                    return Err(e);
                }
            }
        }
    }
}

/// Reads the records of a run of chunks of one file, through its [`ChunkIndex`].
///
/// Each chunk header is checked against its index entry; a difference is an
/// [`Error::Corruption`] with [`CorruptionKind::IndexMismatch`](crate::CorruptionKind).
/// In lenient mode a bad chunk is skipped (the index says where the next one starts) and
/// counted. In strict mode the first error ends the scan.
#[derive(Debug)]
pub struct RangeScanner {
    cursor: Cursor<IndexedRun>,
}

/// A run of indexed chunks of one file: the source of a [`RangeScanner`].
#[derive(Debug)]
struct IndexedRun {
    reader: FileReader,
    /// The index entries of the range.
    chunks: Vec<ChunkMeta>,
    /// Ordinal (in the file) of `chunks[0]`.
    first: usize,
    /// Next entry of `chunks` to read.
    next: usize,
    lenient: bool,
    done: bool,
}

impl RangeScanner {
    /// Opens `index.path` to read the chunks `range` (ordinals in `index.chunks`).
    pub fn open(index: &ChunkIndex, range: Range<usize>, opts: ReadOptions) -> Result<Self> {
        let Some(chunks) = index.chunks.get(range.clone()) else {
            return Err(Error::InvalidRange {
                path: index.path.clone(),
                start: range.start,
                end: range.end,
                chunks: index.chunks.len(),
            });
        };
        Ok(RangeScanner {
            cursor: Cursor::new(IndexedRun {
                reader: ChunkReader::open(&index.path, opts)?,
                chunks: chunks.to_vec(),
                first: range.start,
                next: 0,
                lenient: opts.lenient,
                done: false,
            }),
        })
    }

    /// The next record of the range, or `None` at its end.
    pub fn next_record(&mut self) -> Result<Option<&[u8]>> {
        self.cursor.next_record()
    }

    /// The next whole chunk of the range (skipping any records of the current chunk not
    /// yet returned), or `None` at its end.
    pub fn next_chunk(&mut self) -> Result<Option<&Chunk>> {
        self.cursor.next_chunk()
    }

    /// What has been read so far.
    pub fn stats(&self) -> ReadStats {
        self.cursor.source.reader.stats()
    }

    /// The file being read.
    pub fn path(&self) -> &Path {
        self.cursor.source.reader.path()
    }
}

impl ChunkSource for IndexedRun {
    /// Loads the next chunk of the run that is whole and matches its index entry,
    /// skipping (lenient) or stopping at (strict) those that do not.
    fn load_next(&mut self, chunk: &mut Chunk) -> Result<bool> {
        while !self.done {
            let Some(meta) = self.chunks.get(self.next).copied() else {
                self.done = true;
                break;
            };
            let ordinal = (self.first + self.next) as u64;
            self.next += 1;
            let kind = match self.reader.read_indexed(&meta, ordinal, chunk) {
                Ok(Ok(())) => return Ok(true),
                Ok(Err(kind)) => kind,
                Err(e) => {
                    self.done = true;
                    return Err(e);
                }
            };
            if !self.lenient {
                self.done = true;
                return Err(self.reader.corruption(meta.offset, ordinal, kind));
            }
            tracing::warn!(
                path = %self.reader.path().display(),
                offset = meta.offset,
                chunk = ordinal,
                error = %kind,
                "skipping corrupt recordio chunk"
            );
            self.reader.count_skipped(meta.chunk_len());
        }
        Ok(false)
    }
}
