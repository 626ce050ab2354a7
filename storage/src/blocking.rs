//! Blocking access to objects, for code that reads through `std::io` (RecordIO's
//! readers and indexes): [`ObjectReader`] is a `Read + Seek` over one object that fetches
//! it in blocks with ranged reads, and [`expand`] lists what data globs match. They may
//! be called from any thread, an async task's included (they block it as file I/O
//! would): the requests run on a small runtime of this module's own.

use std::collections::HashMap;
use std::future::Future;
use std::io::{self, Read, Seek, SeekFrom};
use std::ops::Range;
use std::sync::{Mutex, OnceLock};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::location::Location;
use crate::store::{ObjectInfo, Store};

/// Runs `f` on this module's runtime and waits for it, blocking the calling thread.
fn block_on<F>(f: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    static OWN: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let runtime = OWN.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("edl-storage")
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start the storage runtime: {e}"))
    });
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    runtime.spawn(async move {
        let _ = tx.send(f.await);
    });
    rx.recv()
        .unwrap_or_else(|_| panic!("the storage runtime dropped a request"))
}

/// The store and key of `url`: one store (its client and connections) per bucket for
/// the process, made from the environment the first time.
fn open(url: &str) -> Result<(Store, String)> {
    static STORES: OnceLock<Mutex<HashMap<String, Store>>> = OnceLock::new();
    let location = Location::parse(url)?;
    if !location.is_object() {
        return location.open();
    }
    let bucket = format!("{:?}/{}", location.scheme, location.bucket);
    let stores = STORES.get_or_init(Mutex::default);
    if let Some(store) = stores
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&bucket)
    {
        return Ok((store.clone(), location.key));
    }
    let (store, key) = location.open()?;
    stores
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(bucket, store.clone());
    Ok((store, key))
}

/// Whether `text` names an object in a store (a URL other than `file://`), not a path.
pub fn is_object_url(text: &str) -> bool {
    Location::parse(text).is_ok_and(|l| l.is_object())
}

/// The objects each of `patterns` (object URLs, globs allowed) matches, in order,
/// each pattern's sorted by key; a pattern that matches nothing is an error naming it.
pub fn expand(patterns: &[String]) -> Result<Vec<ObjectInfo>> {
    let mut out = Vec::new();
    for p in patterns {
        let (store, key) = open(p)?;
        let found = block_on(async move { store.glob(&key).await })?;
        if found.is_empty() {
            return Err(Error::NotFound {
                url: format!("{p} (no object matches)"),
            });
        }
        out.extend(found);
    }
    Ok(out)
}

/// A store for blocking code: each call waits for its request (retried as
/// [`Store`]'s are). Cheap to clone.
#[derive(Debug, Clone)]
pub struct BlockingStore {
    store: Store,
}

impl BlockingStore {
    /// Blocking calls to `store`.
    pub fn new(store: Store) -> BlockingStore {
        BlockingStore { store }
    }

    /// The store of `url` (one per bucket for the process) and the key `url` names.
    pub fn open(url: &str) -> Result<(BlockingStore, String)> {
        let (store, key) = open(url)?;
        Ok((BlockingStore { store }, key))
    }

    /// The URL of `key`.
    pub fn url(&self, key: &str) -> String {
        self.store.url(key)
    }

    /// The size of object `key`.
    pub fn size(&self, key: &str) -> Result<u64> {
        let (store, key) = (self.store.clone(), key.to_owned());
        block_on(async move { store.size(&key).await })
    }

    /// Bytes `range` of object `key`.
    pub fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        let (store, key) = (self.store.clone(), key.to_owned());
        block_on(async move { store.get_range(&key, range).await })
    }

    /// Writes object `key` whole ([`Store::put`]).
    pub fn put(&self, key: &str, bytes: Bytes) -> Result<()> {
        let (store, key) = (self.store.clone(), key.to_owned());
        block_on(async move { store.put(&key, bytes).await })
    }

    /// Deletes object `key` (one that is not there is fine).
    pub fn delete(&self, key: &str) -> Result<()> {
        let (store, key) = (self.store.clone(), key.to_owned());
        block_on(async move { store.delete(&key).await })
    }

    /// The objects under `prefix` ([`Store::list`]).
    pub fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let (store, prefix) = (self.store.clone(), prefix.to_owned());
        block_on(async move { store.list(&prefix).await })
    }
}

/// A `Read + Seek` over one object, fetched with ranged reads a block at a time (and a
/// range given to [`ObjectReader::prefetch`] in one read).
#[derive(Debug)]
pub struct ObjectReader {
    store: Store,
    key: String,
    url: String,
    len: u64,
    pos: u64,
    /// The bytes held (the allocation reused by each fetch), and the offset of their
    /// first.
    block: Vec<u8>,
    block_start: u64,
    block_size: u64,
}

/// The bytes fetched at a time when nothing was prefetched.
const BLOCK: u64 = 1 << 20;

impl ObjectReader {
    /// Opens the object at `url` (its size is read now: a missing object fails here).
    pub fn open(url: &str) -> Result<ObjectReader> {
        let (store, key) = open(url)?;
        Self::with_store(store, &key)
    }

    /// Opens object `key` of `store` (its size is read now).
    pub fn with_store(store: Store, key: &str) -> Result<ObjectReader> {
        let len = {
            let (store, key) = (store.clone(), key.to_owned());
            block_on(async move { store.size(&key).await })?
        };
        Ok(ObjectReader {
            url: store.url(key),
            store,
            key: key.to_owned(),
            len,
            pos: 0,
            block: Vec::new(),
            block_start: 0,
            block_size: BLOCK,
        })
    }

    /// Reads of `size` bytes at a time (at least 1).
    pub fn with_block_size(mut self, size: u64) -> ObjectReader {
        self.block_size = size.max(1);
        self
    }

    /// The object's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The object's size.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the object is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Fetches `range` (clipped to the object) and holds it, so reading within it needs
    /// no more requests: one ranged read, or parallel ones for a long range
    /// ([`Store::get_range_parallel`]).
    pub fn prefetch(&mut self, range: Range<u64>) -> Result<()> {
        let range = range.start.min(self.len)..range.end.min(self.len);
        let (store, key, r) = (self.store.clone(), self.key.clone(), range.clone());
        let mut block = std::mem::take(&mut self.block);
        let (block, read) = block_on(async move {
            let read = store.read_range_into(&key, r, &mut block).await;
            (block, read)
        });
        self.block = block;
        self.block_start = range.start;
        if let Err(e) = read {
            self.block.clear();
            return Err(e);
        }
        Ok(())
    }

    fn held(&self) -> Range<u64> {
        self.block_start..self.block_start + self.block.len() as u64
    }
}

impl Read for ObjectReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() || self.pos >= self.len {
            return Ok(0);
        }
        if !self.held().contains(&self.pos) {
            let end = (self.pos + self.block_size.max(buf.len() as u64)).min(self.len);
            self.prefetch(self.pos..end).map_err(io::Error::other)?;
        }
        let from = (self.pos - self.block_start) as usize;
        let n = buf.len().min(self.block.len() - from);
        buf[..n].copy_from_slice(&self.block[from..from + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for ObjectReader {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let target = match to {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        let Some(target) = target else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek before the start of the object",
            ));
        };
        self.pos = target;
        Ok(target)
    }
}
