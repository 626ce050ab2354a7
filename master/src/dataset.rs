//! The dataset: RecordIO files indexed into deterministic tasks.
//!
//! `SetDataset(globs, chunks_per_task, passes)` expands the globs, walks every file's chunk
//! headers and cuts each file into tasks of `chunks_per_task` consecutive chunks (a task
//! never spans files). Task ids come from the file's position in the sorted file list and
//! the chunk range, so the same dataset always gives the same tasks.

use std::path::PathBuf;

use edl_recordio::ChunkIndex;
use serde::{Deserialize, Serialize};

use crate::queue::TaskSpec;

/// What defines a dataset: the first `SetDataset` fixes it, later ones must match.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetSpec {
    /// RecordIO files or glob patterns.
    pub globs: Vec<String>,
    /// Consecutive chunks of one file per task.
    pub chunks_per_task: u32,
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
    /// A different dataset is already defined for this job.
    #[error(
        "the job already has another dataset (globs {existing:?}, {chunks} chunks per task, {passes} passes)"
    )]
    Conflict {
        /// The existing globs.
        existing: Vec<String>,
        /// The existing chunks per task.
        chunks: u32,
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
                chunks: existing.chunks_per_task,
                passes: existing.passes,
            })
        }
    }
}

/// Expands and indexes the dataset: blocking file I/O (run it off the async runtime).
pub fn index(spec: &DatasetSpec) -> Result<(Dataset, Vec<TaskSpec>), DatasetError> {
    spec.validate()?;
    let paths: Vec<PathBuf> = edl_recordio::expand_globs(&spec.globs)?;
    let mut files = Vec::with_capacity(paths.len());
    let mut tasks = Vec::new();
    let per = spec.chunks_per_task as usize;
    for (fi, path) in paths.iter().enumerate() {
        let file =
            u32::try_from(fi).map_err(|_| DatasetError::Invalid("more than 2^32 files".into()))?;
        let idx = ChunkIndex::build(path)?;
        let chunks = u32::try_from(idx.chunks.len()).map_err(|_| {
            DatasetError::Invalid(format!("{} has too many chunks", path.display()))
        })?;
        for range in idx.ranges(per) {
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

    #[test]
    fn bad_specs_and_missing_files_are_clear_errors() {
        let bad = DatasetSpec {
            globs: vec![],
            chunks_per_task: 1,
            passes: 1,
        };
        assert!(matches!(index(&bad), Err(DatasetError::Invalid(_))));
        let missing = DatasetSpec {
            globs: vec!["/nonexistent/edl/*.recordio".into()],
            chunks_per_task: 1,
            passes: 1,
        };
        let err = index(&missing).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/edl/*.recordio"), "{err}");
        let a = DatasetSpec {
            globs: vec!["x".into()],
            chunks_per_task: 2,
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
