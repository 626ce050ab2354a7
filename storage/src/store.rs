//! The operations on a store: read an object or a byte range of it, write one whole,
//! list, expand a glob, delete.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};

use crate::error::{Error, Result};
use crate::location::Scheme;

/// The bytes of one request of [`Store::get_range_parallel`].
pub const PART: u64 = 1 << 20;
/// The requests of [`Store::get_range_parallel`] in flight at once.
pub const PARALLEL: usize = 8;

/// The bytes of each part an [`ObjectWriter`] uploads (S3's smallest part is 5 MiB).
const WRITER_PART: usize = 8 << 20;
/// The parts an [`ObjectWriter`] has in flight at once: what it holds in memory is at
/// most this many parts.
const WRITER_PARALLEL: usize = 4;

/// An object (or file) found by a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Its URL (a local file: its absolute path).
    pub url: String,
    /// Its key in the store.
    pub key: String,
    /// Its size in bytes.
    pub size: u64,
}

/// A store: the file system, or one bucket of an object store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    scheme: Scheme,
    bucket: String,
}

impl Store {
    pub(crate) fn new(inner: Arc<dyn ObjectStore>, scheme: Scheme, bucket: String) -> Store {
        Store {
            inner,
            scheme,
            bucket,
        }
    }

    /// The URL of `key` in this store.
    pub fn url(&self, key: &str) -> String {
        match self.scheme {
            Scheme::Local => format!("/{key}"),
            _ => crate::Location {
                scheme: self.scheme,
                bucket: self.bucket.clone(),
                key: key.to_owned(),
            }
            .url(),
        }
    }

    fn path(&self, key: &str) -> Result<ObjectPath> {
        ObjectPath::parse(key).map_err(|e| Error::BadUrl {
            url: self.url(key),
            why: e.to_string(),
        })
    }

    /// The whole object `key`.
    pub async fn get(&self, key: &str) -> Result<Bytes> {
        let path = self.path(key)?;
        let got = self
            .inner
            .get(&path)
            .await
            .map_err(|e| Error::from_store(&self.url(key), e))?;
        got.bytes()
            .await
            .map_err(|e| Error::from_store(&self.url(key), e))
    }

    /// Bytes `range` of object `key`, all of them: a range that goes past the object's
    /// end is [`Error::Truncated`] (never fewer bytes), on every store.
    pub async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        let mut body = self.get_part(key, range).await?;
        Ok(match body.len() {
            1 => body.pop().unwrap_or_default(),
            _ => Bytes::from(body.concat()),
        })
    }

    /// Bytes `range` of object `key` as [`Store::get_range`] gives them, fetched as
    /// parts of [`PART`] bytes, up to [`PARALLEL`] at once, and joined in order. One
    /// stream from an object store is slower than several (S3 serves about 100 MB/s per
    /// connection, and recommends parallel ranged reads); a range of one part is one
    /// request.
    pub async fn get_range_parallel(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        if range.end.saturating_sub(range.start) <= PART {
            return self.get_range(key, range).await;
        }
        let mut joined = Vec::new();
        self.read_range_into(key, range, &mut joined).await?;
        Ok(Bytes::from(joined))
    }

    /// [`Store::get_range_parallel`] into `buf` (its bytes replaced, its allocation
    /// reused): each byte is copied once, from the response bodies into `buf` (a part
    /// that arrives before its turn keeps its body's buffers until then). An object
    /// that ends before `range` does is [`Error::Truncated`], whichever part finds it.
    pub async fn read_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        buf: &mut Vec<u8>,
    ) -> Result<()> {
        buf.clear();
        buf.reserve(range.end.saturating_sub(range.start) as usize);
        let parts = (range.start..range.end)
            .step_by(PART as usize)
            .map(|start| start..(start + PART).min(range.end));
        let mut bodies = futures::stream::iter(parts)
            .map(|part| self.get_part(key, part))
            .buffered(PARALLEL);
        while let Some(body) = bodies.try_next().await? {
            for piece in body {
                buf.extend_from_slice(&piece);
            }
        }
        Ok(())
    }

    /// The body of one ranged read, as the buffers it arrived in (not joined); a range
    /// past the object's end is [`Error::Truncated`].
    async fn get_part(&self, key: &str, range: Range<u64>) -> Result<Vec<Bytes>> {
        let path = self.path(key)?;
        let truncated = |ends: u64| Error::Truncated {
            url: self.url(key),
            start: range.start,
            end: range.end,
            ends,
        };
        let options = object_store::GetOptions::new().with_range(Some(range.clone()));
        let got = match self.inner.get_opts(&path, options).await {
            Ok(got) => got,
            Err(e @ object_store::Error::NotFound { .. }) => {
                return Err(Error::from_store(&self.url(key), e));
            }
            Err(e) => {
                // A range that starts at or past the end is refused by every store
                // (object_store's invalid range, HTTP 416), as a generic error: said as
                // what it is, not as an outage to retry.
                if let Ok(size) = self.size(key).await
                    && range.end > size
                {
                    return Err(truncated(size));
                }
                return Err(Error::from_store(&self.url(key), e));
            }
        };
        // A store clips a range to the object's end: refused before reading the body.
        if got.range != range {
            return Err(truncated(got.meta.size));
        }
        let body: Vec<Bytes> = got
            .into_stream()
            .try_collect()
            .await
            .map_err(|e| Error::from_store(&self.url(key), e))?;
        let len: u64 = body.iter().map(|b| b.len() as u64).sum();
        if len != range.end - range.start {
            // A body that does not match the range its response said.
            return Err(truncated(range.start + len));
        }
        Ok(body)
    }

    /// The size of object `key`.
    pub async fn size(&self, key: &str) -> Result<u64> {
        let path = self.path(key)?;
        let meta = self
            .inner
            .head(&path)
            .await
            .map_err(|e| Error::from_store(&self.url(key), e))?;
        Ok(meta.size)
    }

    /// Writes object `key` whole: readers see its old bytes or `bytes`, never a mix (a
    /// single PUT in an object store; a file written aside and renamed locally).
    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<()> {
        let path = self.path(key)?;
        self.inner
            .put(&path, PutPayload::from(bytes))
            .await
            .map(|_| ())
            .map_err(|e| Error::from_store(&self.url(key), e))
    }

    /// A writer of object `key` in parts, for what is too large to hold in memory (a
    /// multipart upload; a file written aside locally): the object appears whole when
    /// [`ObjectWriter::finish`] returns, and never if the writer is aborted or dropped
    /// before, so readers see the old object or the new one, never a part.
    pub async fn writer(&self, key: &str) -> Result<ObjectWriter> {
        let path = self.path(key)?;
        let url = self.url(key);
        let upload = self
            .inner
            .put_multipart(&path)
            .await
            .map_err(|e| Error::from_store(&url, e))?;
        Ok(ObjectWriter {
            upload: WriteMultipart::new_with_chunk_size(upload, WRITER_PART),
            url,
            written: 0,
        })
    }

    /// Deletes object `key`; one that is not there is fine.
    pub async fn delete(&self, key: &str) -> Result<()> {
        let path = self.path(key)?;
        match self.inner.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(Error::from_store(&self.url(key), e)),
        }
    }

    /// The objects whose keys start with `prefix` (a folder: `prefix/`), sorted by key.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let path = self.path(prefix.trim_end_matches('/'))?;
        let mut found: Vec<ObjectInfo> = self
            .inner
            .list(Some(&path))
            .map_ok(|m| ObjectInfo {
                url: self.url(m.location.as_ref()),
                key: m.location.to_string(),
                size: m.size,
            })
            .try_collect()
            .await
            .map_err(|e| Error::from_store(&self.url(prefix), e))?;
        found.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(found)
    }

    /// The objects whose keys match `pattern` (`*`, `?`, `[...]` within a segment, as
    /// shell globs; `**` across segments), sorted by key: one listing of the longest
    /// prefix without a wildcard. A pattern without wildcards is the object itself
    /// (`Error::NotFound` if missing).
    pub async fn glob(&self, pattern: &str) -> Result<Vec<ObjectInfo>> {
        let Some(first) = pattern.find(['*', '?', '[']) else {
            let size = self.size(pattern).await?;
            return Ok(vec![ObjectInfo {
                url: self.url(pattern),
                key: pattern.to_owned(),
                size,
            }]);
        };
        let glob = glob::Pattern::new(pattern).map_err(|e| Error::BadUrl {
            url: self.url(pattern),
            why: format!("not a glob: {e}"),
        })?;
        let prefix = &pattern[..pattern[..first].rfind('/').map_or(0, |i| i + 1)];
        let options = glob::MatchOptions {
            case_sensitive: true,
            require_literal_separator: true,
            require_literal_leading_dot: false,
        };
        Ok(self
            .list(prefix)
            .await?
            .into_iter()
            .filter(|o| glob.matches_with(&o.key, options))
            .collect())
    }
}

/// An object being written in parts ([`Store::writer`]).
#[derive(Debug)]
pub struct ObjectWriter {
    upload: WriteMultipart,
    url: String,
    written: u64,
}

impl ObjectWriter {
    /// Appends `bytes`; waits while four parts (of 8 MiB) are in flight.
    pub async fn write(&mut self, bytes: Bytes) -> Result<()> {
        self.upload
            .wait_for_capacity(WRITER_PARALLEL)
            .await
            .map_err(|e| Error::from_store(&self.url, e))?;
        self.written += bytes.len() as u64;
        self.upload.put(bytes);
        Ok(())
    }

    /// Makes the object whole, with every byte written; returns their count.
    pub async fn finish(self) -> Result<u64> {
        let ObjectWriter {
            upload,
            url,
            written,
        } = self;
        upload
            .finish()
            .await
            .map_err(|e| Error::from_store(&url, e))?;
        Ok(written)
    }

    /// Drops what was written: the object stays as it was.
    pub async fn abort(self) -> Result<()> {
        self.upload
            .abort()
            .await
            .map_err(|e| Error::from_store(&self.url, e))
    }
}
