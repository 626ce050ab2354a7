//! A shard's checkpoint directory, `<root>/<job>/ps-<shard>/`: durable writes of
//! checkpoint files, reads verified against the [`ShardEntry`] a manifest names,
//! listing, and cleanup of temporaries.
//!
//! A file is written to a temporary name, fsynced, renamed into place and its directory
//! fsynced, so a crash or a full disk leaves either the complete file or none (and
//! earlier checkpoints untouched). A reader takes only the file name from the manifest
//! (which comes from etcd) and reads that file in its own directory, a regular file of
//! the manifest's size, checked before reading ([`CheckpointError::Refused`] otherwise);
//! then it checks the checksum, the trailer, and parses with bounds checks: a bad file
//! is a [`CheckpointError::Corrupt`], never a panic.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read};
use std::path::{Path, PathBuf};

use edl_job::JobName;
use serde::{Deserialize, Serialize};

use super::format::{Snapshot, TRAILER_LEN, decode, encode_to};

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// File system error (a full disk is `io::ErrorKind::StorageFull`).
    #[error("checkpoint I/O on {path}: {error}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error (in the message, so not a `source()` too).
        error: io::Error,
    },
    /// The file is not a valid checkpoint (bad checksum, truncated, malformed).
    #[error("checkpoint {path} is corrupt: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The file is valid but not the one the manifest names (other shard, uuid, step).
    #[error("checkpoint {path} does not match its manifest: {reason}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// The manifest names a file this shard does not read: not a checkpoint file of the
    /// shard's own directory (a path elsewhere, a link, not a regular file). Nothing was
    /// read.
    #[error("checkpoint {path} refused: {reason}")]
    Refused {
        /// The path the manifest names.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
    move |error| CheckpointError::Io {
        path: path.to_owned(),
        error,
    }
}

/// One shard's file in a manifest (also the value of `checkpoints/parts/<step>/<shard>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// Shard index.
    pub shard: u32,
    /// Absolute path of the file (on the pserver's host).
    pub path: String,
    /// File size in bytes.
    pub size: u64,
    /// crc32c of the file up to its trailer (also stored in the trailer).
    pub crc32c: u32,
    /// Random id of this file, stored in its header.
    pub uuid: String,
}

/// The checkpoint directory of one shard: `<root>/<job>/ps-<shard>/`.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    dir: PathBuf,
    quota: Option<u64>,
}

/// Whether `name` is `step-<20 digits>-<uuid>.ckpt`, the name [`CheckpointDir::write`]
/// gives a file of id `uuid` (32 hexadecimal digits).
fn is_checkpoint_name(name: &str, uuid: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("step-")
        .and_then(|r| r.strip_suffix(".ckpt"))
    else {
        return false;
    };
    let Some((step, id)) = rest.split_once('-') else {
        return false;
    };
    step.len() == 20
        && step.bytes().all(|b| b.is_ascii_digit())
        && id.len() == 32
        && id.bytes().all(|b| b.is_ascii_hexdigit())
        && id == uuid
}

/// A random id for a checkpoint file.
pub fn new_uuid() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl CheckpointDir {
    /// The directory of `shard` of `job` under `root` (created on first write). A
    /// [`JobName`] is one path segment, never `.` or `..`: the directory stays under `root`.
    pub fn new(root: impl AsRef<Path>, job: &JobName, shard: u32) -> Self {
        CheckpointDir {
            dir: root.as_ref().join(job.as_str()).join(format!("ps-{shard}")),
            quota: None,
        }
    }

    /// Fails writes past `bytes` with `StorageFull` (a full disk, for tests).
    #[doc(hidden)]
    pub fn with_quota(mut self, bytes: u64) -> Self {
        self.quota = Some(bytes);
        self
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn file_name(step: u64, uuid: &str) -> String {
        format!("step-{step:020}-{uuid}.ckpt")
    }

    /// Writes `snap` durably: temporary file, fsync, rename, directory fsync. On error
    /// the temporary file is removed and no other file is touched.
    pub fn write(&self, snap: &Snapshot) -> Result<ShardEntry, CheckpointError> {
        fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        let uuid = new_uuid();
        let name = Self::file_name(snap.step, &uuid);
        let path = self.dir.join(&name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        let result = (|| {
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(io_err(&tmp))?;
            let mut w = BufWriter::with_capacity(1 << 20, file);
            let (size, crc) = encode_to(snap, &uuid, &mut w, self.quota).map_err(io_err(&tmp))?;
            let file = w.into_inner().map_err(|e| CheckpointError::Io {
                path: tmp.clone(),
                error: e.into_error(),
            })?;
            file.sync_all().map_err(io_err(&tmp))?;
            drop(file);
            fs::rename(&tmp, &path).map_err(io_err(&path))?;
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(io_err(&self.dir))?;
            Ok((size, crc))
        })();
        match result {
            Ok((size, crc32c)) => Ok(ShardEntry {
                shard: snap.shard,
                path: path.display().to_string(),
                size,
                crc32c,
                uuid,
            }),
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Reads and verifies the file of `entry` (size, checksum, uuid, shard) for a shard
    /// laid out as `shard` of `shards`.
    ///
    /// The manifest comes from etcd, so its path is not trusted: only its file name is
    /// used, which must be a checkpoint file name with the entry's uuid, and the file is
    /// read from this directory. It must be a regular file (not a link) of the size the
    /// manifest says, checked before anything is read; no more than that is read.
    pub fn read(
        &self,
        entry: &ShardEntry,
        shard: u32,
        shards: u32,
    ) -> Result<Snapshot, CheckpointError> {
        let named = PathBuf::from(&entry.path);
        let refused = |reason: String| CheckpointError::Refused {
            path: named.clone(),
            reason,
        };
        let name = named
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| is_checkpoint_name(n, &entry.uuid))
            .ok_or_else(|| {
                refused(format!(
                    "not a checkpoint file name with uuid {:?} (step-<step>-<uuid>.ckpt)",
                    entry.uuid
                ))
            })?;
        let path = self.dir.join(name);
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: path.clone(),
            reason,
        };
        let meta = fs::symlink_metadata(&path).map_err(io_err(&path))?;
        if !meta.file_type().is_file() {
            return Err(refused(format!(
                "{} in this shard's directory is not a regular file",
                path.display()
            )));
        }
        if meta.len() != entry.size {
            return Err(corrupt(format!(
                "size {} but the manifest says {}",
                meta.len(),
                entry.size
            )));
        }
        let mut bytes = Vec::new();
        File::open(&path)
            .and_then(|f| f.take(entry.size).read_to_end(&mut bytes))
            .map_err(io_err(&path))?;
        if bytes.len() as u64 != entry.size {
            return Err(corrupt(format!(
                "size {} but the manifest says {}",
                bytes.len(),
                entry.size
            )));
        }
        let (snap, uuid) = decode(&bytes).map_err(corrupt)?;
        let body_end = bytes.len() - TRAILER_LEN;
        let crc = crc32c::crc32c(&bytes[..body_end]);
        let mismatch = |reason: String| CheckpointError::Mismatch {
            path: path.clone(),
            reason,
        };
        if crc != entry.crc32c {
            return Err(mismatch(format!(
                "crc32c {crc:08x}, the manifest says {:08x}",
                entry.crc32c
            )));
        }
        if uuid != entry.uuid {
            return Err(mismatch(format!(
                "uuid {uuid}, the manifest says {}",
                entry.uuid
            )));
        }
        if snap.shard != shard || snap.shards != shards {
            return Err(mismatch(format!(
                "holds shard {} of {}, wanted {shard} of {shards}",
                snap.shard, snap.shards
            )));
        }
        Ok(snap)
    }

    /// The checkpoint files in the directory, with their step, oldest first.
    pub fn files(&self) -> io::Result<Vec<(u64, PathBuf)>> {
        let rd = match fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(rest) = name.strip_prefix("step-") else {
                continue;
            };
            if !name.ends_with(".ckpt") {
                continue;
            }
            if let Some(step) = rest.get(..20).and_then(|s| s.parse().ok()) {
                out.push((step, entry.path()));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Removes leftover temporary files (of a write cut short by a crash).
    pub fn remove_temporaries(&self) {
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in rd.flatten() {
            let name = entry.file_name();
            if name
                .to_str()
                .is_some_and(|n| n.starts_with('.') && n.ends_with(".tmp"))
            {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::format::tests::sample;

    #[test]
    fn write_read_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let d = CheckpointDir::new(dir.path(), &JobName::new("job").unwrap(), 1);
        let snap = sample(4, 3, 5);
        let e = d.write(&snap).unwrap();
        assert_eq!(e.size, fs::metadata(&e.path).unwrap().len());
        assert_eq!(d.read(&e, 1, 2).unwrap(), snap);
        assert_eq!(d.files().unwrap().len(), 1);
        assert_eq!(d.files().unwrap()[0].0, 4);
        // Wrong shard, wrong uuid.
        assert!(matches!(
            d.read(&e, 0, 2),
            Err(CheckpointError::Mismatch { .. })
        ));
        // Another uuid than the file's name: not this entry's file.
        let mut other = e.clone();
        other.uuid = new_uuid();
        assert!(matches!(
            d.read(&other, 1, 2),
            Err(CheckpointError::Refused { .. })
        ));
    }

    /// A manifest comes from etcd, which another process may have written: only a
    /// checkpoint file of the shard's own directory is read.
    #[test]
    fn a_hostile_manifest_is_refused_without_reading() {
        let dir = tempfile::tempdir().unwrap();
        let job = JobName::new("job").unwrap();
        let d = CheckpointDir::new(dir.path(), &job, 1);
        let e = d.write(&sample(2, 2, 2)).unwrap();
        let refused = |entry: &ShardEntry| match d.read(entry, 1, 2) {
            Err(CheckpointError::Refused { reason, .. }) => reason,
            other => panic!("{entry:?}: {other:?}"),
        };
        // Not a checkpoint file name: /dev/zero, a directory escape, another uuid's name.
        for path in ["/dev/zero", "/etc/passwd", "..", "../ps-0/.."] {
            let hostile = ShardEntry {
                path: path.into(),
                ..e.clone()
            };
            assert!(refused(&hostile).contains("not a checkpoint file name"));
        }
        let mut other_uuid = e.clone();
        other_uuid.uuid = new_uuid();
        refused(&other_uuid);
        // A checkpoint file of another directory (another job's) is looked up in this
        // one, where it does not exist: the other file is never opened.
        let other = CheckpointDir::new(dir.path(), &JobName::new("other").unwrap(), 1);
        let theirs = other.write(&sample(4, 2, 2)).unwrap();
        assert!(matches!(
            d.read(&theirs, 1, 2),
            Err(CheckpointError::Io { error, .. }) if error.kind() == io::ErrorKind::NotFound
        ));
        // A link with a checkpoint's name, to /dev/zero: not a regular file.
        let link_name = format!("step-{:020}-{}.ckpt", 9, e.uuid);
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/dev/zero", d.path().join(&link_name)).unwrap();
            let link = ShardEntry {
                path: d.path().join(&link_name).display().to_string(),
                size: 1 << 40,
                ..e.clone()
            };
            assert!(refused(&link).contains("not a regular file"));
            fs::remove_file(d.path().join(&link_name)).unwrap();
        }
        // A sparse 1 TiB file named as the manifest says, whose size differs from the
        // manifest's: refused from its size alone, nothing read (reading it whole, as
        // before the check, would ask for a terabyte of memory and abort the test).
        let huge = d.path().join(&link_name);
        File::create(&huge).unwrap().set_len(1 << 40).unwrap();
        let entry = ShardEntry {
            path: huge.display().to_string(),
            ..e.clone()
        };
        let err = d.read(&entry, 1, 2).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::Corrupt { reason, .. } if reason.contains("manifest says")),
            "{err}"
        );
        // The positive witness: the manifest's own entry still reads.
        assert_eq!(d.read(&e, 1, 2).unwrap(), sample(2, 2, 2));
    }

    #[test]
    fn a_flipped_byte_is_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let d = CheckpointDir::new(dir.path(), &JobName::new("job").unwrap(), 1);
        let e = d.write(&sample(2, 2, 2)).unwrap();
        let mut bytes = fs::read(&e.path).unwrap();
        let n = bytes.len();
        bytes[n / 2] ^= 0x40;
        fs::write(&e.path, &bytes).unwrap();
        let err = d.read(&e, 1, 2).unwrap_err();
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("crc32c mismatch"), "{err}");
        // Truncated.
        fs::write(&e.path, &bytes[..n - 5]).unwrap();
        assert!(matches!(
            d.read(&e, 1, 2),
            Err(CheckpointError::Corrupt { .. })
        ));
    }

    #[test]
    fn a_full_disk_leaves_no_file_and_earlier_checkpoints_intact() {
        let dir = tempfile::tempdir().unwrap();
        let d = CheckpointDir::new(dir.path(), &JobName::new("job").unwrap(), 1);
        let first = d.write(&sample(2, 4, 4)).unwrap();
        let full = d.clone().with_quota(100);
        let err = full.write(&sample(4, 4, 4)).unwrap_err();
        match &err {
            CheckpointError::Io { error, .. } => {
                assert_eq!(error.kind(), io::ErrorKind::StorageFull)
            }
            other => panic!("{other}"),
        }
        let names: Vec<_> = fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary left behind: {names:?}");
        assert_eq!(d.read(&first, 1, 2).unwrap(), sample(2, 4, 4));
    }
}
