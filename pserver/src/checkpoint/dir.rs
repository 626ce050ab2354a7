//! A shard's checkpoint directory, `<root>/<job>/ps-<shard>/`, where `<root>` is a local
//! path or an object URL (`s3://`, `gs://`, `az://`, through `edl-storage`): durable
//! writes of checkpoint files, reads verified against the [`ShardEntry`] a manifest
//! names, listing, deletion, and cleanup of temporaries.
//!
//! Locally a file is written to a temporary name, fsynced, renamed into place and its
//! directory fsynced, so a crash or a full disk leaves either the complete file or none
//! (and earlier checkpoints untouched). In an object store a file is one PUT of the
//! whole object, which readers see whole or not at all. Either way a file is used only
//! once a manifest in etcd names it (the commit), so a file whose write was cut short is
//! never read.
//!
//! A reader takes only the file name from the manifest (which comes from etcd) and reads
//! that file in its own directory: locally a regular file (not a link), in a store the
//! object under its own prefix, of the manifest's size, checked before reading
//! ([`CheckpointError::Refused`] or [`CheckpointError::Corrupt`] otherwise); then it
//! checks the checksum, the trailer, and parses with bounds checks: a bad file is a
//! [`CheckpointError::Corrupt`], never a panic.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read};
use std::path::{Path, PathBuf};

use edl_job::JobName;
use edl_storage::Location;
use edl_storage::blocking::BlockingStore;
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
    /// An object store's error (it names the object's URL); requests were retried
    /// already where a retry could help.
    #[error("checkpoint storage: {0}")]
    Storage(edl_storage::Error),
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

impl CheckpointError {
    /// Whether the file is not there (deleted, or never written where this shard looks).
    pub fn is_not_found(&self) -> bool {
        match self {
            CheckpointError::Io { error, .. } => error.kind() == io::ErrorKind::NotFound,
            CheckpointError::Storage(e) => matches!(e, edl_storage::Error::NotFound { .. }),
            _ => false,
        }
    }
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
    /// Where the file is: an absolute path on the pserver's host, or an object URL.
    pub path: String,
    /// File size in bytes.
    pub size: u64,
    /// crc32c of the file up to its trailer (also stored in the trailer).
    pub crc32c: u32,
    /// Random id of this file, stored in its header.
    pub uuid: String,
}

/// Where a shard's files are.
#[derive(Debug, Clone)]
enum Root {
    /// A local directory.
    Local(PathBuf),
    /// The objects under `prefix/` in a store.
    Object {
        store: BlockingStore,
        prefix: String,
    },
}

/// The checkpoint directory of one shard: `<root>/<job>/ps-<shard>/`, local or in an
/// object store.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    root: Root,
    quota: Option<u64>,
}

/// Whether `name` is `step-<20 digits>-<uuid>.ckpt`, the name [`CheckpointDir::write`]
/// gives a file of id `uuid` (32 hexadecimal digits).
fn is_checkpoint_name(name: &str, uuid: &str) -> bool {
    checkpoint_step(name).is_some_and(|(_, id)| id == uuid)
}

/// The step and uuid of a checkpoint file name (`step-<20 digits>-<32 hex>.ckpt`).
fn checkpoint_step(name: &str) -> Option<(u64, &str)> {
    let rest = name.strip_prefix("step-")?.strip_suffix(".ckpt")?;
    let (step, id) = rest.split_once('-')?;
    let well_formed = step.len() == 20
        && step.bytes().all(|b| b.is_ascii_digit())
        && id.len() == 32
        && id.bytes().all(|b| b.is_ascii_hexdigit());
    well_formed.then(|| step.parse().ok().map(|s| (s, id)))?
}

/// A random id for a checkpoint file.
pub fn new_uuid() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl CheckpointDir {
    /// The local directory of `shard` of `job` under `root` (created on first write). A
    /// [`JobName`] is one path segment, never `.` or `..`: the directory stays under `root`.
    pub fn new(root: impl AsRef<Path>, job: &JobName, shard: u32) -> Self {
        CheckpointDir {
            root: Root::Local(root.as_ref().join(job.as_str()).join(format!("ps-{shard}"))),
            quota: None,
        }
    }

    /// The directory of `shard` of `job` under `root`, a local path or an object URL
    /// (`s3://bucket/prefix`). Opening a store checks that the environment has its
    /// credentials (no request is made yet).
    pub fn open(root: &str, job: &JobName, shard: u32) -> Result<Self, CheckpointError> {
        let location = Location::parse(root).map_err(CheckpointError::Storage)?;
        if !location.is_object() {
            return Ok(Self::new(&location.key, job, shard));
        }
        let (store, key) =
            BlockingStore::open(&location.url()).map_err(CheckpointError::Storage)?;
        Ok(Self::in_store(store, &key, job, shard))
    }

    /// The directory of `shard` of `job` under key `root` of `store`.
    pub fn in_store(store: BlockingStore, root: &str, job: &JobName, shard: u32) -> Self {
        let root = root.trim_matches('/');
        let sep = if root.is_empty() { "" } else { "/" };
        CheckpointDir {
            root: Root::Object {
                store,
                prefix: format!("{root}{sep}{job}/ps-{shard}", job = job.as_str()),
            },
            quota: None,
        }
    }

    /// Fails writes past `bytes` with `StorageFull` (a full disk, for tests).
    #[doc(hidden)]
    pub fn with_quota(mut self, bytes: u64) -> Self {
        self.quota = Some(bytes);
        self
    }

    /// The directory: a local path, or the URL of the objects' prefix.
    pub fn location(&self) -> String {
        match &self.root {
            Root::Local(dir) => dir.display().to_string(),
            Root::Object { store, prefix } => store.url(prefix),
        }
    }

    /// The local directory (`None` in an object store).
    pub fn local_path(&self) -> Option<&Path> {
        match &self.root {
            Root::Local(dir) => Some(dir),
            Root::Object { .. } => None,
        }
    }

    fn file_name(step: u64, uuid: &str) -> String {
        format!("step-{step:020}-{uuid}.ckpt")
    }

    /// Writes `snap` durably (see the module's header). On error no other file is
    /// touched, and locally the temporary file is removed.
    pub fn write(&self, snap: &Snapshot) -> Result<ShardEntry, CheckpointError> {
        let uuid = new_uuid();
        let name = Self::file_name(snap.step, &uuid);
        let (path, (size, crc32c)) = match &self.root {
            Root::Local(dir) => (
                dir.join(&name).display().to_string(),
                self.write_file(dir, &name, snap, &uuid)?,
            ),
            Root::Object { store, prefix } => {
                let key = format!("{prefix}/{name}");
                let mut bytes = Vec::new();
                let (size, crc) = encode_to(snap, &uuid, &mut bytes, self.quota)
                    .map_err(io_err(Path::new(&store.url(&key))))?;
                store
                    .put(&key, bytes.into())
                    .map_err(CheckpointError::Storage)?;
                (store.url(&key), (size, crc))
            }
        };
        Ok(ShardEntry {
            shard: snap.shard,
            path,
            size,
            crc32c,
            uuid,
        })
    }

    /// Writes file `name` in local directory `dir`: temporary file, fsync, rename,
    /// directory fsync. Returns its size and checksum.
    fn write_file(
        &self,
        dir: &Path,
        name: &str,
        snap: &Snapshot,
        uuid: &str,
    ) -> Result<(u64, u32), CheckpointError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        let result = (|| {
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(io_err(&tmp))?;
            let mut w = BufWriter::with_capacity(1 << 20, file);
            let (size, crc) = encode_to(snap, uuid, &mut w, self.quota).map_err(io_err(&tmp))?;
            let file = w.into_inner().map_err(|e| CheckpointError::Io {
                path: tmp.clone(),
                error: e.into_error(),
            })?;
            file.sync_all().map_err(io_err(&tmp))?;
            drop(file);
            fs::rename(&tmp, &path).map_err(io_err(&path))?;
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io_err(dir))?;
            Ok((size, crc))
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// Reads and verifies the file of `entry` (size, checksum, uuid, shard) for a shard
    /// laid out as `shard` of `shards`.
    ///
    /// The manifest comes from etcd, so its path is not trusted: only its file name is
    /// used, which must be a checkpoint file name with the entry's uuid, and the file is
    /// read from this directory. It must be a regular file (not a link) or an object of
    /// the size the manifest says, checked before anything is read; no more than that
    /// is read.
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
        let (path, bytes) = match &self.root {
            Root::Local(dir) => {
                let path = dir.join(name);
                let meta = fs::symlink_metadata(&path).map_err(io_err(&path))?;
                if !meta.file_type().is_file() {
                    return Err(refused(format!(
                        "{} in this shard's directory is not a regular file",
                        path.display()
                    )));
                }
                check_size(&path, meta.len(), entry.size)?;
                let mut bytes = Vec::new();
                File::open(&path)
                    .and_then(|f| f.take(entry.size).read_to_end(&mut bytes))
                    .map_err(io_err(&path))?;
                (path, bytes)
            }
            Root::Object { store, prefix } => {
                let key = format!("{prefix}/{name}");
                let path = PathBuf::from(store.url(&key));
                let size = store.size(&key).map_err(CheckpointError::Storage)?;
                check_size(&path, size, entry.size)?;
                let bytes = store
                    .get_range(&key, 0..entry.size)
                    .map_err(CheckpointError::Storage)?;
                (path, bytes.to_vec())
            }
        };
        check_size(&path, bytes.len() as u64, entry.size)?;
        verify(&path, &bytes, entry, shard, shards)
    }

    /// The checkpoint files in the directory, with their step, oldest first: each file's
    /// name (what [`CheckpointDir::remove`] takes) and where it is.
    pub fn files(&self) -> Result<Vec<(u64, String, String)>, CheckpointError> {
        let mut out = Vec::new();
        match &self.root {
            Root::Local(dir) => {
                let rd = match fs::read_dir(dir) {
                    Ok(rd) => rd,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
                    Err(e) => return Err(io_err(dir)(e)),
                };
                for entry in rd {
                    let entry = entry.map_err(io_err(dir))?;
                    let name = entry.file_name();
                    let Some(name) = name.to_str() else { continue };
                    if let Some((step, _)) = checkpoint_step(name) {
                        out.push((step, name.to_owned(), entry.path().display().to_string()));
                    }
                }
            }
            Root::Object { store, prefix } => {
                let listed = store
                    .list(&format!("{prefix}/"))
                    .map_err(CheckpointError::Storage)?;
                for object in listed {
                    let Some(name) = object.key.strip_prefix(&format!("{prefix}/")) else {
                        continue;
                    };
                    if let Some((step, _)) = checkpoint_step(name) {
                        out.push((step, name.to_owned(), object.url));
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// Deletes file `name` of this directory (one that is not there is fine).
    pub fn remove(&self, name: &str) -> Result<(), CheckpointError> {
        match &self.root {
            Root::Local(dir) => match fs::remove_file(dir.join(name)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(dir)(e)),
                _ => Ok(()),
            },
            Root::Object { store, prefix } => store
                .delete(&format!("{prefix}/{name}"))
                .map_err(CheckpointError::Storage),
        }
    }

    /// Removes leftover temporary files (of a local write cut short by a crash; an
    /// object store has none).
    pub fn remove_temporaries(&self) {
        let Root::Local(dir) = &self.root else {
            return;
        };
        let Ok(rd) = fs::read_dir(dir) else {
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

/// The file at `path` is `got` bytes long; the manifest says `want`.
fn check_size(path: &Path, got: u64, want: u64) -> Result<(), CheckpointError> {
    if got == want {
        return Ok(());
    }
    Err(CheckpointError::Corrupt {
        path: path.to_owned(),
        reason: format!("size {got} but the manifest says {want}"),
    })
}

/// Parses the bytes of the file at `path` and checks them against `entry` and the
/// shard that reads them.
fn verify(
    path: &Path,
    bytes: &[u8],
    entry: &ShardEntry,
    shard: u32,
    shards: u32,
) -> Result<Snapshot, CheckpointError> {
    let (snap, uuid) = decode(bytes).map_err(|reason| CheckpointError::Corrupt {
        path: path.to_owned(),
        reason,
    })?;
    let body_end = bytes.len() - TRAILER_LEN;
    let crc = crc32c::crc32c(&bytes[..body_end]);
    let mismatch = |reason: String| CheckpointError::Mismatch {
        path: path.to_owned(),
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
            std::os::unix::fs::symlink("/dev/zero", d.local_path().unwrap().join(&link_name))
                .unwrap();
            let link = ShardEntry {
                path: d
                    .local_path()
                    .unwrap()
                    .join(&link_name)
                    .display()
                    .to_string(),
                size: 1 << 40,
                ..e.clone()
            };
            assert!(refused(&link).contains("not a regular file"));
            fs::remove_file(d.local_path().unwrap().join(&link_name)).unwrap();
        }
        // A sparse 1 TiB file named as the manifest says, whose size differs from the
        // manifest's: refused from its size alone, nothing read (reading it whole, as
        // before the check, would ask for a terabyte of memory and abort the test).
        let huge = d.local_path().unwrap().join(&link_name);
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
        let names: Vec<_> = fs::read_dir(d.local_path().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary left behind: {names:?}");
        assert_eq!(d.read(&first, 1, 2).unwrap(), sample(2, 4, 4));
    }

    /// The same directory in an object store (the real S3 server of the tests): files
    /// are objects under `<root>/<job>/ps-<shard>/`, listed, read back verified and
    /// deleted; a manifest naming anything but this shard's own object is refused or
    /// not found, and a damaged or resized object is never loaded.
    #[test]
    fn an_object_store_directory_writes_reads_lists_deletes_and_refuses_what_is_not_its_own() {
        use edl_storage::Location;
        use edl_testkit::s3::S3Server;
        let tmp = tempfile::tempdir().unwrap();
        let server = S3Server::start(&tmp.path().join("s3")).expect("the S3 server");
        server.create_bucket("ckpt").unwrap();
        let (store, root) = Location::parse("s3://ckpt/runs")
            .unwrap()
            .open_with(server.env())
            .unwrap();
        let store = BlockingStore::new(store);
        let job = JobName::new("job").unwrap();
        let d = CheckpointDir::in_store(store.clone(), &root, &job, 1);
        assert_eq!(d.location(), "s3://ckpt/runs/job/ps-1");
        assert!(d.files().unwrap().is_empty(), "nothing yet");

        let first = d.write(&sample(2, 3, 5)).unwrap();
        let e = d.write(&sample(4, 3, 5)).unwrap();
        assert!(
            e.path
                .starts_with("s3://ckpt/runs/job/ps-1/step-00000000000000000004-")
        );
        assert_eq!(d.read(&e, 1, 2).unwrap(), sample(4, 3, 5));
        let files = d.files().unwrap();
        let steps: Vec<u64> = files.iter().map(|f| f.0).collect();
        assert_eq!(steps, [2, 4]);
        assert_eq!(files[1].2, e.path);

        // Hostile names are refused before any request.
        for path in ["/dev/zero", "..", "s3://ckpt/runs/job/ps-1/.."] {
            let hostile = ShardEntry {
                path: path.into(),
                ..e.clone()
            };
            assert!(matches!(
                d.read(&hostile, 1, 2),
                Err(CheckpointError::Refused { .. })
            ));
        }
        // Another job's object, named with its full URL, is looked up under this
        // shard's prefix, where it is not: never read. It reads from its own directory.
        let other =
            CheckpointDir::in_store(store.clone(), &root, &JobName::new("other").unwrap(), 1);
        let theirs = other.write(&sample(6, 3, 5)).unwrap();
        let err = d.read(&theirs, 1, 2).unwrap_err();
        assert!(err.is_not_found(), "{err}");
        assert!(
            err.to_string().contains("s3://ckpt/runs/job/ps-1/"),
            "{err}"
        );
        assert_eq!(other.read(&theirs, 1, 2).unwrap(), sample(6, 3, 5));

        // An object of another size than the manifest's: refused from its size alone.
        let key = |entry: &ShardEntry| entry.path.strip_prefix("s3://ckpt/").unwrap().to_owned();
        let bytes = store.get_range(&key(&e), 0..e.size).unwrap().to_vec();
        store
            .put(&key(&e), bytes[..bytes.len() - 5].to_vec().into())
            .unwrap();
        let err = d.read(&e, 1, 2).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::Corrupt { reason, .. } if reason.contains("manifest says")),
            "{err}"
        );
        // A flipped byte: a checksum mismatch.
        let mut damaged = bytes.clone();
        damaged[bytes.len() / 2] ^= 0x40;
        store.put(&key(&e), damaged.into()).unwrap();
        let err = d.read(&e, 1, 2).unwrap_err();
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
        // The first file still reads (the positive witness), then goes.
        assert_eq!(d.read(&first, 1, 2).unwrap(), sample(2, 3, 5));
        let name = |entry: &ShardEntry| entry.path.rsplit('/').next().unwrap().to_owned();
        d.remove(&name(&first)).unwrap();
        d.remove(&name(&first)).unwrap();
        let steps: Vec<u64> = d.files().unwrap().iter().map(|f| f.0).collect();
        assert_eq!(steps, [4]);
        assert!(d.read(&first, 1, 2).unwrap_err().is_not_found());
    }
}
