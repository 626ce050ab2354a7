//! [`FileWriter`]: a RecordIO file that appears under its name only once complete.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::writer::{WriteStats, Writer, WriterOptions};

/// Distinguishes the temporary files of one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A RecordIO file written atomically.
///
/// Data goes to a temporary file in the same directory, named `.NAME.tmp-<pid>-<n>`.
/// [`FileWriter::finish`] writes the last chunk, fsyncs the file, renames it to its final
/// name (replacing any file there) and fsyncs the directory, so the final name only ever
/// holds a complete file. Dropping a `FileWriter` without finishing removes the temporary
/// file, as does a failed `finish`.
#[derive(Debug)]
pub struct FileWriter {
    /// `None` once `finish` has taken it.
    writer: Option<Writer<File>>,
    path: PathBuf,
    temp_path: PathBuf,
    /// Set once the temporary file has been renamed to `path`.
    renamed: bool,
}

impl FileWriter {
    /// Starts writing the file `path`. Its directory must exist.
    pub fn create(path: impl AsRef<Path>, opts: WriterOptions) -> Result<FileWriter> {
        let path = path.as_ref();
        let Some(name) = path.file_name() else {
            return Err(Error::io(
                path,
                io::Error::new(io::ErrorKind::InvalidInput, "not a file path"),
            ));
        };
        let mut temp_name = OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(
            ".tmp-{}-{}",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let temp_path = path.with_file_name(temp_name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp_path)
            .map_err(|e| Error::io(&temp_path, e))?;
        Ok(FileWriter {
            writer: Some(Writer::new(file, opts).with_name(&temp_path)),
            path: path.to_path_buf(),
            temp_path,
            renamed: false,
        })
    }

    /// Appends a record.
    pub fn write(&mut self, record: &[u8]) -> Result<()> {
        self.writer()?.write(record)
    }

    /// Writes the buffered records as a chunk.
    pub fn flush_chunk(&mut self) -> Result<()> {
        self.writer()?.flush_chunk()
    }

    /// Writes the buffered records as a chunk and fsyncs the temporary file, so that what
    /// was written so far survives a crash (under the temporary name).
    pub fn sync(&mut self) -> Result<()> {
        let temp_path = self.temp_path.clone();
        let writer = self.writer()?;
        writer.flush_chunk()?;
        writer
            .get_mut()
            .sync_data()
            .map_err(|e| Error::io(temp_path, e))
    }

    /// What has been written so far.
    pub fn stats(&self) -> WriteStats {
        self.writer.as_ref().map(Writer::stats).unwrap_or_default()
    }

    /// The final name.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The temporary name written to until `finish`.
    pub fn temp_path(&self) -> &Path {
        &self.temp_path
    }

    /// Writes the last chunk, fsyncs the file, renames it to its final name and fsyncs
    /// the directory. An error after the rename (from the directory fsync) leaves the
    /// complete file in place, though possibly not yet durable.
    pub fn finish(mut self) -> Result<WriteStats> {
        let writer = self.writer.take().ok_or_else(|| Error::WriterFailed {
            path: self.temp_path.clone(),
        })?;
        // On any error before the rename, dropping `self` removes the temporary file.
        let (file, stats) = writer.into_inner()?;
        file.sync_all().map_err(|e| Error::io(&self.temp_path, e))?;
        drop(file);
        fs::rename(&self.temp_path, &self.path).map_err(|e| Error::io(&self.path, e))?;
        self.renamed = true;
        sync_dir(&self.path)?;
        Ok(stats)
    }

    fn writer(&mut self) -> Result<&mut Writer<File>> {
        self.writer.as_mut().ok_or_else(|| Error::WriterFailed {
            path: self.temp_path.clone(),
        })
    }
}

impl Drop for FileWriter {
    fn drop(&mut self) {
        if self.renamed {
            return;
        }
        // Close the file before removing it.
        self.writer = None;
        match fs::remove_file(&self.temp_path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(
                path = %self.temp_path.display(),
                error = %e,
                "could not remove unfinished recordio file"
            ),
        }
    }
}

/// Fsyncs the directory holding `path`, making a rename into it durable.
#[cfg(unix)]
fn sync_dir(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

/// Directories cannot be fsynced portably outside unix; the rename is left to the OS.
#[cfg(not(unix))]
fn sync_dir(_path: &Path) -> Result<()> {
    Ok(())
}
