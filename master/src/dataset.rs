//! The dataset: RecordIO files indexed into deterministic tasks.
//!
//! `SetDataset(globs, chunks_per_task | records_per_task, passes)` expands the globs,
//! walks every file's chunk headers and cuts each file into tasks of consecutive chunks
//! (a task never spans files): `chunks_per_task` chunks each, or, sized by samples, the
//! fewest chunks holding `records_per_task` records, lowered (to at most a 32nd of the
//! pass, and then to the largest target that still makes them) so that a pass has at
//! least [`MIN_TASKS_PER_PASS`] tasks, or every task is one chunk (work for every
//! trainer of an elastic job to the end of a pass) — but never below
//! `min_records_per_task`, the job's batch: a task holding fewer records than a batch
//! would make the trainer's steps smaller than the batch the job asked for. Task ids come from the file's position in the sorted file list and the chunk
//! range, so the same dataset always gives the same tasks.

use std::ops::Range;
use std::path::PathBuf;

use edl_recordio::ChunkIndex;
use serde::{Deserialize, Serialize};

use crate::queue::TaskSpec;

/// Tasks sized by records are made smaller than asked, down to a chunk, so that a pass
/// has at least this many.
pub const MIN_TASKS_PER_PASS: u64 = 32;

/// What defines a dataset: the first `SetDataset` fixes it, later ones must match.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetSpec {
    /// RecordIO files or glob patterns.
    pub globs: Vec<String>,
    /// Consecutive chunks of one file per task (when `records_per_task` is 0).
    pub chunks_per_task: u32,
    /// Records per task: tasks are the fewest consecutive chunks holding this many (see
    /// the module docs); 0: `chunks_per_task` chunks.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub records_per_task: u64,
    /// Tasks sized by records are never lowered below this many (the job's batch size,
    /// so that no step is smaller than the batch for want of records; 0: 1).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub min_records_per_task: u64,
    /// Passes over the dataset.
    pub passes: u32,
}

/// One file of the dataset.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetFile {
    /// The path as the master opened it.
    pub path: String,
    /// Chunks in the file.
    pub chunks: u32,
    /// Records in the file.
    pub records: u64,
    /// File length in bytes.
    pub bytes: u64,
}

/// The indexed dataset: stored as `job/dataset` (without the file list) and the file
/// list's parts `job/files/<n>`, written after every task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dataset {
    /// What the dataset was defined with.
    pub spec: DatasetSpec,
    /// Its files, sorted by path.
    pub files: Vec<DatasetFile>,
    /// Tasks per pass.
    pub tasks: u64,
    /// Records per pass.
    pub records: u64,
}

/// Why a dataset could not be defined.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The request is malformed.
    #[error("invalid dataset: {0}")]
    Invalid(String),
    /// A file could not be listed or indexed (missing, unreadable, corrupt headers).
    #[error("cannot index the dataset: {0}")]
    Index(edl_recordio::Error),
    /// Objects could not be listed or read (a bad URL, missing credentials, a store
    /// that is down: [`edl_storage::Error::is_transient`]).
    #[error("cannot list or read the dataset: {0}")]
    Storage(edl_storage::Error),
    /// A different dataset is already defined for this job.
    #[error(
        "the job already has another dataset (globs {existing:?}, {size} per task, {passes} passes)"
    )]
    Conflict {
        /// The existing globs.
        existing: Vec<String>,
        /// The existing task size ("2 chunks", "4096 records").
        size: String,
        /// The existing pass count.
        passes: u32,
    },
}

// The message includes the cause's text, so the cause is not also its `source()`
// (a report of the chain would say it twice).
impl From<edl_recordio::Error> for DatasetError {
    fn from(e: edl_recordio::Error) -> Self {
        DatasetError::Index(e)
    }
}

impl DatasetSpec {
    /// Each file's task ranges of chunks (see the module docs).
    fn task_ranges(&self, files: &[ChunkIndex]) -> Vec<Vec<Range<usize>>> {
        let by_records = |target: u64| -> Vec<Vec<Range<usize>>> {
            files.iter().map(|f| f.ranges_of_records(target)).collect()
        };
        if self.records_per_task == 0 {
            let per = self.chunks_per_task as usize;
            return files.iter().map(|f| f.ranges(per).collect()).collect();
        }
        // The largest target at most the one asked for (and a 32nd of the pass) that
        // still makes MIN_TASKS_PER_PASS tasks (or a task per chunk, at 1), but never
        // below the floor: the task count falls as the target grows, so a binary search
        // finds it.
        let records: u64 = files.iter().map(ChunkIndex::records).sum();
        let count = |t: u64| -> u64 {
            files
                .iter()
                .map(|f| f.ranges_of_records(t).len() as u64)
                .sum()
        };
        let floor = self.min_records_per_task.max(1);
        let (mut lo, mut hi) = (
            floor,
            self.records_per_task
                .min(records / MIN_TASKS_PER_PASS)
                .max(floor),
        );
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if count(mid) >= MIN_TASKS_PER_PASS {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        by_records(lo)
    }

    /// Checks the request's fields.
    pub fn validate(&self) -> Result<(), DatasetError> {
        if self.globs.is_empty() || self.globs.iter().any(|g| g.trim().is_empty()) {
            return Err(DatasetError::Invalid("no file or glob given".into()));
        }
        if self.chunks_per_task == 0 {
            return Err(DatasetError::Invalid(
                "chunks_per_task must be at least 1".into(),
            ));
        }
        if self.passes == 0 {
            return Err(DatasetError::Invalid("passes must be at least 1".into()));
        }
        Ok(())
    }

    /// An error when `self` is not the same dataset as `existing`.
    pub fn check_same(&self, existing: &DatasetSpec) -> Result<(), DatasetError> {
        if self == existing {
            Ok(())
        } else {
            Err(DatasetError::Conflict {
                existing: existing.globs.clone(),
                size: match existing.records_per_task {
                    0 => format!("{} chunks", existing.chunks_per_task),
                    n => format!("{n} records"),
                },
                passes: existing.passes,
            })
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The bytes fetched at a time while an object's chunk headers are walked.
const INDEX_BLOCK: u64 = 256 << 10;

/// Expands and indexes the dataset: blocking I/O (run it off the async runtime). Local
/// files first (the globs that are paths), then objects (the globs that are object
/// URLs, in order), each indexed from its chunk headers alone: with ranged reads for an
/// object, never a whole download.
pub fn index(spec: &DatasetSpec) -> Result<(Dataset, Vec<TaskSpec>), DatasetError> {
    spec.validate()?;
    let (urls, local): (Vec<String>, Vec<String>) = spec
        .globs
        .iter()
        .cloned()
        .partition(|g| edl_storage::blocking::is_object_url(g));
    let mut paths: Vec<PathBuf> = if local.is_empty() {
        Vec::new()
    } else {
        edl_recordio::expand_globs(&local)?
    };
    let mut indexes = paths
        .iter()
        .map(ChunkIndex::build)
        .collect::<Result<Vec<_>, _>>()?;
    if !urls.is_empty() {
        for object in edl_storage::blocking::expand(&urls).map_err(DatasetError::Storage)? {
            let reader = edl_storage::blocking::ObjectReader::open(&object.url)
                .map_err(DatasetError::Storage)?
                .with_block_size(INDEX_BLOCK);
            indexes.push(ChunkIndex::from_reader(reader, PathBuf::from(&object.url))?);
            paths.push(PathBuf::from(object.url));
        }
    }
    let mut files = Vec::with_capacity(paths.len());
    let mut tasks = Vec::new();
    let ranges = spec.task_ranges(&indexes);
    for (fi, ((path, idx), ranges)) in paths.iter().zip(&indexes).zip(ranges).enumerate() {
        let file =
            u32::try_from(fi).map_err(|_| DatasetError::Invalid("more than 2^32 files".into()))?;
        let chunks = u32::try_from(idx.chunks.len()).map_err(|_| {
            DatasetError::Invalid(format!("{} has too many chunks", path.display()))
        })?;
        for range in ranges {
            let (begin, end) = (range.start as u32, range.end as u32);
            let first = &idx.chunks[range.start];
            let last = &idx.chunks[range.end - 1];
            tasks.push(TaskSpec {
                id: TaskSpec::make_id(file, begin, end),
                file,
                chunk_begin: begin,
                chunk_end: end,
                records: idx.records_in(range.clone()),
                offset_begin: first.offset,
                offset_end: last.offset + last.chunk_len(),
            });
        }
        files.push(DatasetFile {
            path: path.display().to_string(),
            chunks,
            records: idx.records(),
            bytes: idx.file_len,
        });
    }
    let dataset = Dataset {
        spec: spec.clone(),
        tasks: tasks.len() as u64,
        records: files.iter().map(|f| f.records).sum(),
        files,
    };
    Ok((dataset, tasks))
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_recordio::{FileWriter, WriterOptions};

    fn write_file(path: &std::path::Path, records: usize, per_chunk: usize) {
        let mut w = FileWriter::create(
            path,
            WriterOptions {
                max_chunk_bytes: per_chunk * 12,
                ..WriterOptions::default()
            },
        )
        .unwrap();
        for i in 0..records {
            w.write(format!("record-{i:04}").as_bytes()).unwrap();
        }
        w.finish().unwrap();
    }

    #[test]
    fn files_are_cut_into_deterministic_tasks() {
        let dir = tempfile::tempdir().unwrap();
        write_file(&dir.path().join("b.recordio"), 25, 4);
        write_file(&dir.path().join("a.recordio"), 9, 4);
        let spec = DatasetSpec {
            globs: vec![format!("{}/*.recordio", dir.path().display())],
            chunks_per_task: 2,
            records_per_task: 0,
            min_records_per_task: 0,
            passes: 1,
        };
        let (ds, tasks) = index(&spec).unwrap();
        assert_eq!(ds.files.len(), 2);
        assert!(ds.files[0].path.ends_with("a.recordio"));
        assert_eq!(ds.records, 34);
        assert_eq!(tasks.iter().map(|t| t.records).sum::<u64>(), 34);
        assert_eq!(ds.tasks, tasks.len() as u64);
        // Tasks do not span files and cover each file's chunks exactly.
        for (fi, f) in ds.files.iter().enumerate() {
            let mine: Vec<_> = tasks.iter().filter(|t| t.file == fi as u32).collect();
            assert_eq!(mine.first().unwrap().chunk_begin, 0);
            assert_eq!(mine.last().unwrap().chunk_end, f.chunks);
            assert!(mine.windows(2).all(|w| w[0].chunk_end == w[1].chunk_begin));
            assert!(mine.iter().all(|t| t.chunk_end - t.chunk_begin <= 2));
            assert_eq!(mine.last().unwrap().offset_end, f.bytes);
        }
        let (_, again) = index(&spec).unwrap();
        assert_eq!(tasks, again);
    }

    /// Sized by records: each task the fewest chunks holding the records asked for (the
    /// last of a file may hold fewer), lowered so that a pass has enough tasks.
    #[test]
    fn tasks_sized_by_records_hold_the_records_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        write_file(&dir.path().join("a.recordio"), 4000, 10);
        write_file(&dir.path().join("b.recordio"), 1003, 10);
        let spec = |records_per_task| DatasetSpec {
            globs: vec![format!("{}/*.recordio", dir.path().display())],
            chunks_per_task: 1,
            records_per_task,
            min_records_per_task: 0,
            passes: 1,
        };
        let (ds, tasks) = index(&spec(95)).unwrap();
        assert!(
            ds.files[0].chunks >= 400,
            "chunks of about 10: {:?}",
            ds.files
        );
        assert_eq!(tasks.iter().map(|t| t.records).sum::<u64>(), 5003);
        for (fi, f) in ds.files.iter().enumerate() {
            let mine: Vec<_> = tasks.iter().filter(|t| t.file == fi as u32).collect();
            assert_eq!(mine.last().unwrap().chunk_end, f.chunks);
            assert!(mine.windows(2).all(|w| w[0].chunk_end == w[1].chunk_begin));
            // Every task but a file's last holds at least 95 records, and one chunk
            // less would not.
            for t in &mine[..mine.len() - 1] {
                assert!(t.records >= 95, "{t:?}");
                assert!(t.records < 95 + 10 + 1, "{t:?}");
            }
        }
        // Asked for 4,096 per task, 5,003 records still make at least
        // MIN_TASKS_PER_PASS tasks, each at most a 32nd of them and a chunk.
        let (ds, tasks) = index(&spec(4096)).unwrap();
        assert!(ds.tasks >= MIN_TASKS_PER_PASS, "{} tasks", ds.tasks);
        assert!(
            tasks.iter().all(|t| t.records <= 5003 / 32 + 10),
            "{tasks:?}"
        );
        // And as large as that allows: not cut finer than needed (about 32, plus a
        // short last task per file).
        assert!(ds.tasks <= MIN_TASKS_PER_PASS + 3, "{} tasks", ds.tasks);
        // Fewer chunks than that: a task per chunk.
        let dir2 = tempfile::tempdir().unwrap();
        write_file(&dir2.path().join("c.recordio"), 200, 10);
        let few = DatasetSpec {
            globs: vec![format!("{}/*.recordio", dir2.path().display())],
            ..spec(4096)
        };
        let (ds, _) = index(&few).unwrap();
        assert_eq!(ds.tasks, u64::from(ds.files[0].chunks), "one chunk each");
        // A batch of 300: no task is lowered below it, though a pass then has fewer than
        // MIN_TASKS_PER_PASS tasks, nor below it when fewer records were asked for.
        for asked in [4096, 95] {
            let batch = DatasetSpec {
                min_records_per_task: 300,
                ..spec(asked)
            };
            let (ds, tasks) = index(&batch).unwrap();
            assert!(ds.tasks < MIN_TASKS_PER_PASS, "{} tasks", ds.tasks);
            for (fi, f) in ds.files.iter().enumerate() {
                let mine: Vec<_> = tasks.iter().filter(|t| t.file == fi as u32).collect();
                assert_eq!(mine.last().unwrap().chunk_end, f.chunks);
                for t in &mine[..mine.len() - 1] {
                    assert!((300..300 + 10).contains(&t.records), "{t:?}");
                }
            }
        }
    }

    #[test]
    fn bad_specs_and_missing_files_are_clear_errors() {
        let bad = DatasetSpec {
            globs: vec![],
            chunks_per_task: 1,
            records_per_task: 0,
            min_records_per_task: 0,
            passes: 1,
        };
        assert!(matches!(index(&bad), Err(DatasetError::Invalid(_))));
        let missing = DatasetSpec {
            globs: vec!["/nonexistent/edl/*.recordio".into()],
            chunks_per_task: 1,
            records_per_task: 0,
            min_records_per_task: 0,
            passes: 1,
        };
        let err = index(&missing).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/edl/*.recordio"), "{err}");
        let a = DatasetSpec {
            globs: vec!["x".into()],
            chunks_per_task: 2,
            records_per_task: 0,
            min_records_per_task: 0,
            passes: 1,
        };
        let mut b = a.clone();
        assert!(b.check_same(&a).is_ok());
        b.passes = 2;
        assert!(matches!(
            b.check_same(&a),
            Err(DatasetError::Conflict { .. })
        ));
    }
}
