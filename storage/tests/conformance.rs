//! One suite, two backends: the local file system and a real S3 server
//! (`edl-s3-server` on loopback, reached with object_store's S3 client through
//! [`Location::open_with`] and the variables a user sets). Each backend: objects are
//! written whole and read back, in byte ranges too; listings and globs find exactly
//! what matches; a missing object is `NotFound` with its URL; deleting twice is fine.
//! S3 alone: wrong credentials are refused, missing ones are one error before any
//! request, and a server killed and started again on its data serves the same objects;
//! a RecordIO object reads through `blocking::ObjectReader` as its file does.

use bytes::Bytes;
use edl_storage::{Error, Location, Store};
use edl_testkit::s3::S3Server;

/// The store and the key of `root` (a folder or prefix) on one backend.
fn open(root: &str, vars: Vec<(String, String)>) -> (Store, String) {
    Location::parse(root)
        .expect("a location")
        .open_with(vars)
        .expect("open the store")
}

/// The suite, on the store and folder `(store, base)`.
async fn conformance(store: &Store, base: &str) {
    let key = |name: &str| format!("{base}/{name}");
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    store
        .put(
            &key("mnist/train-00000.recordio"),
            Bytes::from(data.clone()),
        )
        .await
        .expect("put");
    store
        .put(
            &key("mnist/train-00001.recordio"),
            Bytes::from_static(b"one"),
        )
        .await
        .expect("put");
    store
        .put(
            &key("mnist/test-00000.recordio"),
            Bytes::from_static(b"test"),
        )
        .await
        .expect("put");
    store
        .put(
            &key("mnist/deeper/train-9.recordio"),
            Bytes::from_static(b"deep"),
        )
        .await
        .expect("put");

    let whole = store
        .get(&key("mnist/train-00000.recordio"))
        .await
        .expect("get");
    assert_eq!(whole.as_ref(), data.as_slice());
    let range = store
        .get_range(&key("mnist/train-00000.recordio"), 70_000..70_020)
        .await
        .expect("a range");
    assert_eq!(range.as_ref(), &data[70_000..70_020]);
    // A range of several parts, fetched in parallel, joined in order.
    let long: Vec<u8> = (0..(2 * edl_storage::PART + 12_345))
        .map(|i| (i % 253) as u8)
        .collect();
    store
        .put(&key("long.bin"), Bytes::from(long.clone()))
        .await
        .expect("put");
    let end = long.len() as u64 - 7;
    let parts = store
        .get_range_parallel(&key("long.bin"), 5..end)
        .await
        .expect("a long range");
    assert_eq!(parts.as_ref(), &long[5..end as usize]);
    // Into a buffer that held other bytes: exactly the range's.
    let mut buf = vec![7u8; 3 * edl_storage::PART as usize];
    store
        .read_range_into(&key("long.bin"), 1000..end - 1000, &mut buf)
        .await
        .expect("a long range into a used buffer");
    assert_eq!(buf, &long[1000..(end - 1000) as usize]);
    // Past the object's end: an error naming it, not fewer bytes; also when a part
    // lies wholly past the end.
    let len = long.len() as u64;
    let wholly = store
        .read_range_into(&key("long.bin"), 5..len + edl_storage::PART + 10, &mut buf)
        .await
        .expect_err("a part wholly past the end");
    assert!(
        matches!(wholly, edl_storage::Error::Truncated { ends, .. } if ends == len),
        "{wholly}"
    );
    let past = store
        .read_range_into(&key("long.bin"), 5..len + 10, &mut buf)
        .await
        .expect_err("a range past the end");
    assert!(
        matches!(past, edl_storage::Error::Truncated { ends, .. } if ends == len),
        "{past}"
    );
    assert!(past.to_string().contains("long.bin"), "{past}");
    store.delete(&key("long.bin")).await.expect("delete");
    assert_eq!(
        store
            .size(&key("mnist/train-00000.recordio"))
            .await
            .expect("size"),
        100_000
    );
    // A write replaces the object whole.
    store
        .put(
            &key("mnist/train-00001.recordio"),
            Bytes::from_static(b"uno"),
        )
        .await
        .expect("overwrite");
    assert_eq!(
        store
            .get(&key("mnist/train-00001.recordio"))
            .await
            .expect("get")
            .as_ref(),
        b"uno"
    );

    let names = |found: Vec<edl_storage::ObjectInfo>| -> Vec<String> {
        found
            .into_iter()
            .map(|o| o.key.trim_start_matches(&format!("{base}/")).to_owned())
            .collect()
    };
    assert_eq!(
        names(
            store
                .glob(&key("mnist/train-*.recordio"))
                .await
                .expect("glob")
        ),
        ["mnist/train-00000.recordio", "mnist/train-00001.recordio"],
        "`*` stays within a segment"
    );
    assert_eq!(
        names(
            store
                .glob(&key("mnist/**/train-*.recordio"))
                .await
                .expect("glob")
        ),
        [
            "mnist/deeper/train-9.recordio",
            "mnist/train-00000.recordio",
            "mnist/train-00001.recordio"
        ]
    );
    assert_eq!(
        names(store.list(&key("mnist/")).await.expect("list")).len(),
        4
    );
    assert!(
        store
            .glob(&key("nothing-*"))
            .await
            .expect("glob")
            .is_empty()
    );
    let sizes: Vec<u64> = store
        .glob(&key("mnist/train-0000?.recordio"))
        .await
        .expect("glob")
        .into_iter()
        .map(|o| o.size)
        .collect();
    assert_eq!(sizes, [100_000, 3]);

    let missing = store.get(&key("mnist/missing")).await;
    match missing {
        Err(Error::NotFound { url }) => assert!(url.ends_with("mnist/missing"), "{url}"),
        other => panic!("a missing object must be NotFound: {other:?}"),
    }
    // Past an object's end, however far: `Truncated`, naming the object and where it
    // ends, never fewer bytes and never an outage to retry; on every store.
    let small = key("mnist/train-00001.recordio");
    for range in [0..1000u64, 2..4, 3..4, 5..10] {
        let got = store.get_range(&small, range.clone()).await;
        match &got {
            Err(Error::Truncated {
                url,
                start,
                end,
                ends: 3,
            }) if (*start, *end) == (range.start, range.end)
                && url.ends_with("train-00001.recordio") => {}
            other => panic!("{range:?} of a 3-byte object: {other:?}"),
        }
        let e = got.expect_err("truncated");
        assert!(!e.is_transient(), "{range:?}: {e}");
        assert!(matches!(
            store.get_range_parallel(&small, range.clone()).await,
            Err(Error::Truncated { ends: 3, .. })
        ));
    }
    // Witness: ranges within it read.
    assert_eq!(
        store
            .get_range(&small, 2..3)
            .await
            .expect("its last byte")
            .len(),
        1
    );
    assert_eq!(
        store
            .get_range(&small, 0..3)
            .await
            .expect("all of it")
            .len(),
        3
    );

    store
        .delete(&key("mnist/test-00000.recordio"))
        .await
        .expect("delete");
    store
        .delete(&key("mnist/test-00000.recordio"))
        .await
        .expect("delete again");
    assert!(matches!(
        store.get(&key("mnist/test-00000.recordio")).await,
        Err(Error::NotFound { .. })
    ));
}

#[tokio::test]
async fn the_local_file_system_conforms() {
    let dir = tempfile::tempdir().expect("temp dir");
    let base = dir.path().display().to_string();
    let (store, key) = open(&base, Vec::new());
    conformance(&store, &key).await;
    // Written as files, where a path says.
    assert!(
        dir.path()
            .join("mnist/train-00000.recordio")
            .try_exists()
            .expect("stat")
    );
}

#[tokio::test]
async fn an_s3_server_conforms_refuses_bad_credentials_and_keeps_its_objects_through_a_kill() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut server = S3Server::start(&dir.path().join("s3")).expect("the S3 server");
    server.create_bucket("edl").expect("bucket");
    let (store, key) = open("s3://edl/jobs/j1", server.env());
    assert_eq!(key, "jobs/j1");
    conformance(&store, &key).await;
    // The objects are on the server's disk (a positive witness that S3 served them).
    assert!(
        dir.path()
            .join("s3/edl/jobs/j1/mnist/train-00000.recordio")
            .try_exists()
            .expect("stat")
    );

    // No credentials: one error, before any request, saying what to set.
    let none: Vec<(String, String)> = server
        .env()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("AWS_ACCESS") && !k.starts_with("AWS_SECRET"))
        .collect();
    let e = Location::parse("s3://edl/x")
        .expect("url")
        .open_with(none)
        .expect_err("no credentials");
    assert!(
        matches!(e, Error::Credentials { .. }) && e.to_string().contains("AWS_ACCESS_KEY_ID"),
        "{e}"
    );
    // Wrong ones: refused by the server, not retried as an outage.
    let wrong: Vec<(String, String)> = server
        .env()
        .into_iter()
        .map(|(k, v)| {
            if k == "AWS_SECRET_ACCESS_KEY" {
                (k, "wrong".to_owned())
            } else {
                (k, v)
            }
        })
        .collect();
    let (bad, key) = open("s3://edl/jobs/j1", wrong);
    let r = bad.get(&format!("{key}/mnist/train-00001.recordio")).await;
    assert!(matches!(r, Err(Error::Refused { .. })), "{r:?}");

    // The server killed and back on its data: the same objects.
    server.restart().expect("restart the server");
    let again = store
        .get(&format!("{key}/mnist/train-00001.recordio"))
        .await
        .expect("the object after a restart");
    assert_eq!(again.as_ref(), b"uno");
}

/// A RecordIO file put on the S3 server reads through [`ObjectReader`] as it does from
/// disk: the same chunk index from its headers, the same records from a chunk reader
/// started at a chunk's offset; a damaged chunk is a corruption naming the object's URL
/// and the chunk's byte offset.
#[test]
fn a_recordio_object_reads_as_its_file_and_damage_names_the_url_and_offset() {
    use edl_recordio::{ChunkIndex, ChunkReader, Error as RecordIoError, FileWriter, ReadOptions};
    use edl_storage::blocking::ObjectReader;
    let dir = tempfile::tempdir().expect("temp dir");
    let server = S3Server::start(&dir.path().join("s3")).expect("the S3 server");
    server.create_bucket("edl").expect("bucket");
    let file = dir.path().join("part-0.recordio");
    let mut w = FileWriter::create(
        &file,
        edl_recordio::WriterOptions {
            max_chunk_bytes: 4096,
            ..edl_recordio::WriterOptions::default()
        },
    )
    .expect("writer");
    for i in 0..2000u32 {
        w.write(format!("record {i}").as_bytes()).expect("write");
    }
    w.finish().expect("finish");
    let bytes = std::fs::read(&file).expect("read");
    // The S3 client needs a runtime of its own here (a plain test thread).
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (store, key) = Location::parse("s3://edl/data/part-0.recordio")
        .expect("url")
        .open_with(server.env())
        .expect("store");
    rt.block_on(store.put(&key, Bytes::from(bytes.clone())))
        .expect("put");
    let url = "s3://edl/data/part-0.recordio";
    // ObjectReader takes its credentials from the process environment: open it through
    // a store made from the server's variables instead.
    let local = ChunkIndex::build(&file).expect("index the file");
    assert!(local.len() > 3, "several chunks");
    let reader = ObjectReader::with_store(store.clone(), &key)
        .expect("open the object")
        .with_block_size(1000);
    let remote = ChunkIndex::from_reader(reader, url.into()).expect("index the object");
    assert_eq!(remote.chunks, local.chunks);
    assert_eq!(remote.file_len, local.file_len);
    // Chunk 2 onwards, prefetched in one read.
    let c = local.chunks[2];
    let mut reader = ObjectReader::with_store(store.clone(), &key).expect("open");
    reader
        .prefetch(c.offset..local.file_len)
        .expect("one ranged read");
    let mut chunks =
        ChunkReader::new(reader, url.into(), ReadOptions::default()).starting_at(c.offset, 2);
    let first = chunks.next_chunk().expect("read").expect("chunk 2");
    assert_eq!(first.meta(), Some(c));

    // A byte of chunk 3's payload flipped on the server.
    let bad = local.chunks[3];
    let mut damaged = bytes.clone();
    damaged[(bad.offset + 30) as usize] ^= 0xff;
    rt.block_on(store.put(&key, Bytes::from(damaged)))
        .expect("put the damaged object");
    let reader = ObjectReader::with_store(store, &key).expect("open");
    let mut chunks =
        ChunkReader::new(reader, url.into(), ReadOptions::default()).starting_at(bad.offset, 3);
    match chunks.next_chunk() {
        Err(e @ RecordIoError::Corruption { offset, .. }) => {
            assert_eq!(offset, bad.offset);
            let said = e.to_string();
            assert!(said.contains(url), "{said}");
        }
        other => panic!("a damaged chunk must be a corruption: {other:?}"),
    }
}
