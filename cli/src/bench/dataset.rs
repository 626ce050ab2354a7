//! The load's dataset: `files` RecordIO files of `tasks_per_file` one-chunk tasks of
//! `records_per_task` records; a record is its number in the dataset (8 bytes,
//! little-endian), so a reader can tell which record it read.

use std::path::{Path, PathBuf};

use anyhow::Context;
use edl_recordio::{FileWriter, WriterOptions};

/// The dataset's shape.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Files.
    pub files: u64,
    /// One-chunk tasks per file.
    pub tasks_per_file: u64,
    /// Records per task.
    pub records_per_task: u64,
}

impl Shape {
    /// Tasks per pass.
    pub fn tasks(&self) -> u64 {
        self.files * self.tasks_per_file
    }

    /// Records per pass.
    pub fn records(&self) -> u64 {
        self.tasks() * self.records_per_task
    }
}

/// The glob of the dataset written under `dir`.
pub fn glob(dir: &Path) -> String {
    format!("{}/part-*.recordio", dir.display())
}

fn file(dir: &Path, i: u64) -> PathBuf {
    dir.join(format!("part-{i:07}.recordio"))
}

/// Writes the dataset under `dir` on `threads` threads.
pub fn write(dir: &Path, shape: Shape, threads: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let threads = threads.max(1) as u64;
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || -> anyhow::Result<()> {
                    let mut i = t;
                    while i < shape.files {
                        write_file(dir, i, shape)?;
                        i += threads;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("a dataset writer panicked"))
    })
}

fn write_file(dir: &Path, i: u64, shape: Shape) -> anyhow::Result<()> {
    let path = file(dir, i);
    let mut w = FileWriter::create(&path, WriterOptions::default())
        .with_context(|| format!("create {}", path.display()))?;
    let first = i * shape.tasks_per_file * shape.records_per_task;
    for t in 0..shape.tasks_per_file {
        for r in 0..shape.records_per_task {
            let n: u64 = first + t * shape.records_per_task + r;
            w.write(&n.to_le_bytes())?;
        }
        w.flush_chunk()?;
    }
    w.finish()
        .with_context(|| format!("write {}", path.display()))?;
    Ok(())
}
