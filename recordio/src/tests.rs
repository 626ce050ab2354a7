//! End-to-end tests of the crate: round trips, the golden byte layout, corruption
//! handling in strict and lenient mode, and property tests.

use std::fs;
use std::io::{self, Cursor, Write};
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use crate::*;

type RecordSet = Vec<Vec<u8>>;

/// A decoded chunk: its index entry and records.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Decoded {
    meta: ChunkMeta,
    records: RecordSet,
}

fn opts(max_chunk_bytes: usize, compressor: Compressor) -> WriterOptions {
    WriterOptions {
        max_chunk_bytes,
        compressor,
    }
}

fn write_vec(records: &[Vec<u8>], opts: WriterOptions) -> (Vec<u8>, WriteStats) {
    let mut w = Writer::new(Vec::new(), opts);
    for r in records {
        w.write(r).unwrap();
    }
    w.into_inner().unwrap()
}

/// Reads every chunk of `bytes`; the error (if any) that ended the read.
fn read_chunks(bytes: &[u8], opts: ReadOptions) -> (Vec<Decoded>, Option<Error>, ReadStats) {
    let mut reader = ChunkReader::new(Cursor::new(bytes), PathBuf::from("mem"), opts);
    let mut chunks = Vec::new();
    let mut chunk = Chunk::default();
    let err = loop {
        match reader.next_chunk_into(&mut chunk) {
            Ok(true) => chunks.push(Decoded {
                meta: chunk.meta().unwrap(),
                records: chunk.to_vecs(),
            }),
            Ok(false) => break None,
            Err(e) => break Some(e),
        }
    };
    // A finished reader stays finished.
    assert!(!reader.next_chunk_into(&mut chunk).unwrap());
    (chunks, err, reader.stats())
}

fn flatten(chunks: &[Decoded]) -> RecordSet {
    chunks.iter().flat_map(|c| c.records.clone()).collect()
}

fn is_subsequence(sub: &[Decoded], of: &[Decoded]) -> bool {
    let mut it = of.iter();
    sub.iter().all(|c| it.any(|o| o == c))
}

/// RecordSet of assorted sizes: empty, small, and larger than `chunk` bytes.
fn assorted_records(n: usize, chunk: usize) -> RecordSet {
    (0..n)
        .map(|i| match i % 7 {
            0 => Vec::new(),
            3 => (0..chunk * 2 + i).map(|j| (j * 31 + i) as u8).collect(),
            _ => format!("record {i} {}", "x".repeat(i % 50)).into_bytes(),
        })
        .collect()
}

fn scan_all(paths: Vec<PathBuf>, opts: ReadOptions) -> (RecordSet, ReadStats) {
    let mut scanner = Scanner::open(paths, opts).unwrap();
    let mut out = Vec::new();
    while let Some(r) = scanner.next_record().unwrap() {
        out.push(r.to_vec());
    }
    (out, scanner.stats())
}

fn range_records(
    index: &ChunkIndex,
    range: std::ops::Range<usize>,
    opts: ReadOptions,
) -> Result<RecordSet> {
    let mut scanner = RangeScanner::open(index, range, opts)?;
    let mut out = Vec::new();
    while let Some(r) = scanner.next_record()? {
        out.push(r.to_vec());
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Format and round trips

#[test]
fn golden_two_record_uncompressed_chunk() {
    let (bytes, stats) = write_vec(
        &[b"ab".to_vec(), Vec::new()],
        opts(1 << 20, Compressor::None),
    );
    #[rustfmt::skip]
    let expected: Vec<u8> = vec![
        0x04, 0x03, 0x02, 0x01, // magic 0x01020304, little-endian
        0x99, 0x40, 0x25, 0xc7, // CRC32 (IEEE) of the payload: 0xc7254099
        0x00, 0x00, 0x00, 0x00, // compressor: none
        0x0a, 0x00, 0x00, 0x00, // payload size: 10
        0x02, 0x00, 0x00, 0x00, // records: 2
        0x02, 0x00, 0x00, 0x00, b'a', b'b', // record "ab"
        0x00, 0x00, 0x00, 0x00, // record ""
    ];
    assert_eq!(bytes, expected);
    assert_eq!(
        stats,
        WriteStats {
            records: 2,
            chunks: 1,
            uncompressed_bytes: 2,
            file_bytes: 30
        }
    );
    let (chunks, err, _) = read_chunks(&bytes, ReadOptions::strict());
    assert!(err.is_none());
    assert_eq!(flatten(&chunks), vec![b"ab".to_vec(), Vec::new()]);
}

#[test]
fn round_trip_every_compressor() {
    let records = assorted_records(300, 512);
    for compressor in Compressor::ALL {
        let (bytes, wstats) = write_vec(&records, opts(512, compressor));
        assert_eq!(wstats.file_bytes, bytes.len() as u64);
        let (chunks, err, rstats) = read_chunks(&bytes, ReadOptions::strict());
        assert!(err.is_none(), "{compressor}: {err:?}");
        assert_eq!(flatten(&chunks), records, "{compressor}");
        assert!(chunks.len() > 10, "{compressor}: {} chunks", chunks.len());
        for c in &chunks {
            assert_eq!(c.meta.compressor, compressor);
            let framed: usize = c.records.iter().map(|r| r.len() + 4).sum();
            assert!(
                framed <= 512 || c.records.len() == 1,
                "{compressor}: chunk of {framed}"
            );
        }
        assert_eq!(rstats.records, wstats.records);
        assert_eq!(rstats.bytes, wstats.uncompressed_bytes);
        assert_eq!(rstats.chunks, wstats.chunks);
        assert_eq!(
            rstats.compressed_bytes + 20 * rstats.chunks,
            wstats.file_bytes
        );
        assert_eq!((rstats.skipped_chunks, rstats.skipped_bytes), (0, 0));
        let index = ChunkIndex::from_reader(Cursor::new(&bytes), "mem".into()).unwrap();
        assert_eq!(index.records(), records.len() as u64);
        assert_eq!(index.file_len, bytes.len() as u64);
        let metas: Vec<_> = chunks.iter().map(|c| c.meta).collect();
        assert_eq!(index.chunks, metas);
    }
}

#[test]
fn empty_stream_and_empty_records() {
    let (bytes, stats) = write_vec(&[], WriterOptions::default());
    assert!(bytes.is_empty());
    assert_eq!(stats, WriteStats::default());
    let (chunks, err, rstats) = read_chunks(&bytes, ReadOptions::strict());
    assert!(chunks.is_empty() && err.is_none());
    assert_eq!(rstats, ReadStats::default());
    assert!(
        ChunkIndex::from_reader(Cursor::new(&bytes), "mem".into())
            .unwrap()
            .is_empty()
    );

    for compressor in Compressor::ALL {
        let records = vec![Vec::new(); 1000];
        let (bytes, _) = write_vec(&records, opts(1 << 20, compressor));
        let (chunks, err, _) = read_chunks(&bytes, ReadOptions::strict());
        assert!(err.is_none());
        assert_eq!(flatten(&chunks), records);
    }
}

#[test]
fn large_record_gets_its_own_chunk() {
    let records = vec![vec![1u8; 10], vec![2u8; 500], vec![3u8; 10], vec![4u8; 10]];
    let (bytes, stats) = write_vec(&records, opts(100, Compressor::None));
    let (chunks, _, _) = read_chunks(&bytes, ReadOptions::strict());
    let shape: Vec<usize> = chunks.iter().map(|c| c.records.len()).collect();
    assert_eq!(shape, vec![1, 1, 2]);
    assert_eq!(stats.chunks, 3);
    // Uncompressed: the file is the records, their prefixes and the headers.
    assert_eq!(stats.file_bytes, 530 + 4 * 4 + 3 * 20);
}

#[test]
fn zero_chunk_size_writes_one_record_per_chunk() {
    let records = assorted_records(20, 8);
    let (bytes, stats) = write_vec(&records, opts(0, Compressor::Snappy));
    assert_eq!(stats.chunks, 20);
    let (chunks, _, _) = read_chunks(&bytes, ReadOptions::strict());
    assert!(chunks.iter().all(|c| c.records.len() == 1));
    assert_eq!(flatten(&chunks), records);
}

#[test]
fn flush_chunk_and_stats() {
    let mut w = Writer::new(Vec::new(), opts(1 << 20, Compressor::None));
    w.write(b"abc").unwrap();
    assert_eq!(w.buffered_records(), 1);
    assert_eq!(w.stats().records, 1);
    assert_eq!(w.stats().chunks, 0);
    w.flush_chunk().unwrap();
    w.flush_chunk().unwrap(); // nothing buffered: no empty chunk
    assert_eq!(w.stats().chunks, 1);
    assert_eq!(w.get_ref().len(), 20 + 4 + 3);
    w.write(b"de").unwrap();
    let (bytes, stats) = w.into_inner().unwrap();
    assert_eq!(stats.chunks, 2);
    let (chunks, _, _) = read_chunks(&bytes, ReadOptions::strict());
    assert_eq!(flatten(&chunks), vec![b"abc".to_vec(), b"de".to_vec()]);
    assert_eq!(chunks[1].meta.offset, 27);
}

/// A sink that fails once more than `room` bytes were written to it.
struct FailingSink {
    room: usize,
    written: Vec<u8>,
}

impl Write for FailingSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.written.len() + buf.len() > self.room {
            return Err(io::Error::other("disk full"));
        }
        self.written.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn writer_refuses_use_after_a_failed_write() {
    let sink = FailingSink {
        room: 50,
        written: Vec::new(),
    };
    let mut w = Writer::new(sink, opts(16, Compressor::None)).with_name("/data/out");
    w.write(&[7; 12]).unwrap(); // 36-byte chunk written
    let err = w.write(&[8; 12]).unwrap_err();
    assert!(
        matches!(&err, Error::Io { path, .. } if path == Path::new("/data/out")),
        "{err}"
    );
    assert!(matches!(
        w.write(b"x").unwrap_err(),
        Error::WriterFailed { .. }
    ));
    assert!(matches!(
        w.flush_chunk().unwrap_err(),
        Error::WriterFailed { .. }
    ));
    assert!(w.into_inner().is_err());
}

#[test]
fn scanner_reads_many_files_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut paths = Vec::new();
    let mut all = Vec::new();
    for (i, compressor) in Compressor::ALL.into_iter().cycle().take(9).enumerate() {
        let records = assorted_records(i * 13, 256);
        let path = dir.path().join(format!("part-{i:05}"));
        let mut w = FileWriter::create(&path, opts(256, compressor)).unwrap();
        for r in &records {
            w.write(r).unwrap();
        }
        w.finish().unwrap();
        all.extend(records);
        paths.push(path);
    }
    let pattern = dir.path().join("part-*").to_str().unwrap().to_owned();
    let expanded = expand_globs(&[pattern]).unwrap();
    assert_eq!(expanded, paths);
    let (got, stats) = scan_all(expanded, ReadOptions::strict());
    assert_eq!(got, all);
    assert_eq!(stats.records, all.len() as u64);
    assert_eq!(stats.bytes, all.iter().map(|r| r.len() as u64).sum::<u64>());

    // Whole chunks, too.
    let mut scanner = Scanner::open(paths.clone(), ReadOptions::strict()).unwrap();
    let mut n = 0;
    while let Some(chunk) = scanner.next_chunk().unwrap() {
        n += chunk.len();
    }
    assert_eq!(n, all.len());

    let err = Scanner::open(vec![dir.path().join("absent")], ReadOptions::strict()).unwrap_err();
    assert!(matches!(&err, Error::Io { path, .. } if path.ends_with("absent")));
}

#[test]
fn scanner_skips_a_corrupt_file_only_when_lenient() {
    let dir = tempfile::tempdir().unwrap();
    let records = assorted_records(30, 128);
    let (good, _) = write_vec(&records, opts(128, Compressor::Snappy));
    let paths: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("f{i}"))).collect();
    fs::write(&paths[0], &good).unwrap();
    fs::write(&paths[1], b"this is not a recordio file at all").unwrap();
    fs::write(&paths[2], &good).unwrap();

    let (got, stats) = scan_all(paths.clone(), ReadOptions::lenient());
    assert_eq!(got, [records.clone(), records.clone()].concat());
    assert_eq!(stats.skipped_chunks, 1);
    assert_eq!(stats.skipped_bytes, 34);

    let mut scanner = Scanner::open(paths.clone(), ReadOptions::strict()).unwrap();
    let mut n = 0;
    let err = loop {
        match scanner.next_record() {
            Ok(Some(_)) => n += 1,
            Ok(None) => panic!("corruption not reported"),
            Err(e) => break e,
        }
    };
    assert_eq!(n, records.len());
    assert!(
        matches!(&err, Error::Corruption { path, offset: 0, chunk: 0, .. } if *path == paths[1]),
        "{err}"
    );
    // The scan has ended.
    assert!(scanner.next_record().unwrap().is_none());
}

#[test]
fn range_scanner_reads_exactly_its_chunks() {
    let dir = tempfile::tempdir().unwrap();
    for compressor in Compressor::ALL {
        let records = assorted_records(120, 300);
        let path = dir.path().join(format!("data-{compressor}"));
        let (bytes, _) = write_vec(&records, opts(300, compressor));
        fs::write(&path, &bytes).unwrap();
        let (chunks, _, _) = read_chunks(&bytes, ReadOptions::strict());
        let index = ChunkIndex::build(&path).unwrap();
        assert_eq!(index.len(), chunks.len());
        assert!(index.len() > 5);
        for start in 0..=index.len() {
            for end in start..=index.len() {
                let got = range_records(&index, start..end, ReadOptions::strict()).unwrap();
                assert_eq!(
                    got,
                    flatten(&chunks[start..end]),
                    "{compressor} {start}..{end}"
                );
                assert_eq!(index.records_in(start..end), got.len() as u64);
            }
        }
        let ranges: Vec<_> = index.ranges(4).collect();
        assert_eq!(ranges.first().map(|r| r.start), Some(0));
        assert_eq!(ranges.last().map(|r| r.end), Some(index.len()));
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));

        let len = index.len();
        let backwards = std::ops::Range { start: 3, end: 2 };
        for bad in [0..len + 1, backwards, len + 1..len + 2] {
            let err = RangeScanner::open(&index, bad, ReadOptions::strict()).unwrap_err();
            assert!(matches!(err, Error::InvalidRange { .. }), "{err}");
        }
    }
}

#[test]
fn range_scanner_checks_headers_against_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    let records = assorted_records(60, 200);
    let (bytes, _) = write_vec(&records, opts(200, Compressor::None));
    fs::write(&path, &bytes).unwrap();
    let index = ChunkIndex::build(&path).unwrap();
    // Rewrite the file with different contents.
    let mut other = records.clone();
    other[1][0] ^= 1;
    let (bytes2, _) = write_vec(&other, opts(200, Compressor::None));
    fs::write(&path, &bytes2).unwrap();
    let err = range_records(&index, 0..index.len(), ReadOptions::strict()).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Corruption {
                chunk: 0,
                offset: 0,
                kind: CorruptionKind::IndexMismatch { field: "crc32", .. },
                ..
            }
        ),
        "{err}"
    );
    // Lenient: the changed chunk is skipped, everything else read.
    let mut scanner = RangeScanner::open(&index, 0..index.len(), ReadOptions::lenient()).unwrap();
    let mut got = Vec::new();
    while let Some(r) = scanner.next_record().unwrap() {
        got.push(r.to_vec());
    }
    let first_chunk = index.chunks[0].records as usize;
    assert_eq!(got, records[first_chunk..]);
    assert_eq!(scanner.stats().skipped_chunks, 1);
    assert_eq!(scanner.stats().skipped_bytes, index.chunks[0].chunk_len());
}

// ---------------------------------------------------------------------------------------
// File writer

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn file_writer_drop_without_finish_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("part-0");
    let mut w = FileWriter::create(&path, WriterOptions::default()).unwrap();
    w.write(b"hello").unwrap();
    w.sync().unwrap();
    let temp_name = w
        .temp_path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(temp_name.starts_with(".part-0.tmp-"), "{temp_name}");
    assert_eq!(dir_entries(dir.path()), vec![temp_name]);
    drop(w);
    assert!(dir_entries(dir.path()).is_empty());
    assert!(!fs::exists(&path).unwrap());
}

#[test]
fn file_writer_finish_produces_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("part-1");
    let mut w = FileWriter::create(&path, opts(64, Compressor::Gzip)).unwrap();
    assert_eq!(w.path(), path.as_path());
    let records = assorted_records(40, 64);
    for r in &records {
        w.write(r).unwrap();
    }
    w.flush_chunk().unwrap();
    let stats = w.finish().unwrap();
    assert_eq!(dir_entries(dir.path()), vec!["part-1".to_owned()]);
    assert_eq!(fs::metadata(&path).unwrap().len(), stats.file_bytes);
    let (got, _) = scan_all(vec![path.clone()], ReadOptions::strict());
    assert_eq!(got, records);

    // An empty file is a valid, empty dataset file; finishing replaces the old file.
    FileWriter::create(&path, WriterOptions::default())
        .unwrap()
        .finish()
        .unwrap();
    assert_eq!(fs::metadata(&path).unwrap().len(), 0);
    assert_eq!(
        scan_all(vec![path], ReadOptions::strict()).0,
        RecordSet::new()
    );

    let err =
        FileWriter::create(dir.path().join("no-such-dir/x"), WriterOptions::default()).unwrap_err();
    assert!(err.to_string().contains("no-such-dir"), "{err}");
}

// ---------------------------------------------------------------------------------------
// Corruption

/// A small file of several chunks, and its chunks.
fn small_file(compressor: Compressor) -> (Vec<u8>, Vec<Decoded>) {
    let records: RecordSet = (0..9)
        .map(|i| format!("rec-{i}-{}", "z".repeat(i)).into_bytes())
        .collect();
    let (bytes, _) = write_vec(&records, opts(40, compressor));
    let (chunks, err, _) = read_chunks(&bytes, ReadOptions::strict());
    assert!(err.is_none());
    assert!(chunks.len() >= 3);
    (bytes, chunks)
}

/// Index of the chunk holding byte `pos`.
fn chunk_at(chunks: &[Decoded], pos: u64) -> usize {
    chunks.iter().rposition(|c| c.meta.offset <= pos).unwrap()
}

#[test]
fn every_bit_flip_is_detected_at_its_chunk() {
    for compressor in [Compressor::None, Compressor::Snappy] {
        let (bytes, chunks) = small_file(compressor);
        let last = chunks.len() - 1;
        for bit in 0..bytes.len() * 8 {
            let mut bad = bytes.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let k = chunk_at(&chunks, (bit / 8) as u64);
            let ctx = format!("{compressor} bit {bit} (chunk {k})");

            let (got, err, _) = read_chunks(&bad, ReadOptions::strict());
            let err = err.unwrap_or_else(|| panic!("{ctx}: not detected"));
            assert_eq!(got, chunks[..k], "{ctx}");
            match &err {
                Error::Corruption {
                    path,
                    offset,
                    chunk,
                    kind,
                } => {
                    assert_eq!(path, Path::new("mem"), "{ctx}");
                    assert_eq!(*offset, chunks[k].meta.offset, "{ctx}");
                    assert_eq!(*chunk, k as u64, "{ctx}");
                    // Only the last chunk's size field can read as a torn tail.
                    let in_size_field = (12..16).contains(&(bit / 8 - *offset as usize));
                    if kind.is_truncation() {
                        assert!(k == last && in_size_field, "{ctx}: {kind}");
                    }
                    if matches!(kind, CorruptionKind::ImpossibleSize { .. }) {
                        assert!(k < last && in_size_field, "{ctx}: {kind}");
                    }
                }
                other => panic!("{ctx}: {other}"),
            }
            assert!(
                err.to_string()
                    .starts_with("corrupt recordio file mem at byte "),
                "{err}"
            );

            let (got, err, stats) = read_chunks(&bad, ReadOptions::lenient());
            assert!(err.is_none(), "{ctx}: {err:?}");
            let mut expected = chunks.clone();
            let skipped = expected.remove(k);
            let got_metas: Vec<_> = got
                .iter()
                .map(|c| (c.meta.offset, c.records.clone()))
                .collect();
            let exp_metas: Vec<_> = expected
                .iter()
                .map(|c| (c.meta.offset, c.records.clone()))
                .collect();
            assert_eq!(got_metas, exp_metas, "{ctx}");
            assert_eq!(stats.skipped_chunks, 1, "{ctx}");
            assert_eq!(stats.skipped_bytes, skipped.meta.chunk_len(), "{ctx}");
            assert_eq!(stats.chunks, chunks.len() as u64 - 1, "{ctx}");
        }
    }
}

#[test]
fn truncation_at_every_byte_is_a_torn_tail() {
    for compressor in [Compressor::None, Compressor::Zstd] {
        let (bytes, chunks) = small_file(compressor);
        let boundaries: Vec<u64> = chunks.iter().map(|c| c.meta.offset).collect();
        for cut in 0..bytes.len() {
            let bad = &bytes[..cut];
            let complete = chunks
                .iter()
                .filter(|c| c.meta.offset + c.meta.chunk_len() <= cut as u64)
                .count();
            let ctx = format!("{compressor} cut at {cut}");
            let at_boundary = boundaries.contains(&(cut as u64));
            let torn_from = boundaries.get(complete).copied().unwrap_or(cut as u64);

            let (got, err, _) = read_chunks(bad, ReadOptions::strict());
            assert_eq!(got, chunks[..complete], "{ctx}");
            let index = ChunkIndex::from_reader(Cursor::new(bad), "mem".into());
            if at_boundary {
                assert!(err.is_none(), "{ctx}: {err:?}");
                assert_eq!(index.unwrap().len(), complete, "{ctx}");
            } else {
                for err in [err.unwrap(), index.unwrap_err()] {
                    assert!(err.is_truncated_tail(), "{ctx}: {err}");
                    assert!(
                        matches!(err, Error::Corruption { offset, chunk, .. }
                            if offset == torn_from && chunk == complete as u64),
                        "{ctx}: {err}"
                    );
                }
            }

            let (got, err, stats) = read_chunks(bad, ReadOptions::lenient());
            assert!(err.is_none(), "{ctx}");
            assert_eq!(got, chunks[..complete], "{ctx}");
            assert_eq!(stats.skipped_chunks, u64::from(!at_boundary), "{ctx}");
            assert_eq!(stats.skipped_bytes, cut as u64 - torn_from, "{ctx}");
        }
    }
}

#[test]
fn damaged_size_field_is_told_apart_from_a_torn_tail() {
    let (bytes, chunks) = small_file(Compressor::None);
    let set_size = |k: usize| {
        let mut bad = bytes.clone();
        let at = chunks[k].meta.offset as usize + 12;
        bad[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        bad
    };
    let (_, err, _) = read_chunks(&set_size(0), ReadOptions::strict());
    let err = err.unwrap();
    assert!(!err.is_truncated_tail());
    assert!(matches!(
        err.corruption_kind(),
        Some(CorruptionKind::ImpossibleSize { size, .. }) if *size == u64::from(u32::MAX)
    ));
    let index_err = ChunkIndex::from_reader(Cursor::new(set_size(0)), "mem".into()).unwrap_err();
    assert!(matches!(
        index_err.corruption_kind(),
        Some(CorruptionKind::ImpossibleSize { .. })
    ));

    let last = chunks.len() - 1;
    let (_, err, _) = read_chunks(&set_size(last), ReadOptions::strict());
    assert!(err.unwrap().is_truncated_tail());
}

#[test]
fn lenient_reader_skips_garbage_between_and_before_chunks() {
    let (bytes, chunks) = small_file(Compressor::Gzip);
    let garbage: Vec<u8> = (0..333u32).map(|i| (i * 7 + 1) as u8).collect();
    for at in [0usize, chunks[2].meta.offset as usize, bytes.len()] {
        let mut bad = bytes[..at].to_vec();
        bad.extend_from_slice(&garbage);
        // A false magic number inside the garbage must not fool the resync.
        bad.extend_from_slice(&[4, 3, 2, 1, 0, 0]);
        bad.extend_from_slice(&bytes[at..]);
        let (got, err, stats) = read_chunks(&bad, ReadOptions::lenient());
        assert!(err.is_none());
        assert_eq!(flatten(&got), flatten(&chunks), "garbage at {at}");
        assert_eq!(stats.skipped_chunks, 1);
        assert_eq!(stats.skipped_bytes, garbage.len() as u64 + 6);
        let (_, err, _) = read_chunks(&bad, ReadOptions::strict());
        let err = err.unwrap();
        assert!(
            matches!(
                err,
                Error::Corruption { offset, kind: CorruptionKind::BadMagic { .. }, .. } if offset == at as u64
            ),
            "{err}"
        );
    }
}

#[test]
fn strict_reader_reports_record_framing_errors() {
    // A chunk whose header claims 3 records but whose payload holds 2.
    let payload = [2u8, 0, 0, 0, b'a', b'b', 0, 0, 0, 0];
    let header = ChunkHeader {
        crc32: crc32fast::hash(&payload),
        compressor: Compressor::None,
        compressed_len: payload.len() as u32,
        records: 3,
    };
    let mut bytes = header.encode().to_vec();
    bytes.extend_from_slice(&payload);
    let (_, err, _) = read_chunks(&bytes, ReadOptions::strict());
    assert_eq!(
        err.unwrap().corruption_kind(),
        Some(&CorruptionKind::RecordCountMismatch {
            header: 3,
            found: 2
        })
    );
    // A record length running past the payload.
    let payload = [9u8, 0, 0, 0, b'a'];
    let header = ChunkHeader {
        crc32: crc32fast::hash(&payload),
        compressor: Compressor::None,
        compressed_len: payload.len() as u32,
        records: 1,
    };
    let mut bytes = header.encode().to_vec();
    bytes.extend_from_slice(&payload);
    let (_, err, _) = read_chunks(&bytes, ReadOptions::strict());
    assert!(matches!(
        err.unwrap().corruption_kind(),
        Some(CorruptionKind::BadRecordFraming(_))
    ));
}

// ---------------------------------------------------------------------------------------
// Property tests

fn compressor_strategy() -> impl Strategy<Value = Compressor> {
    prop::sample::select(Compressor::ALL.to_vec())
}

fn records_strategy() -> impl Strategy<Value = RecordSet> {
    prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..60)
}

/// Byte-level damage to a file: xor masks at positions (taken modulo the length) and an
/// optional truncation point (modulo the length plus one).
#[derive(Clone, Debug)]
struct Damage {
    flips: Vec<(usize, u8)>,
    truncate: Option<usize>,
}

fn damage_strategy() -> impl Strategy<Value = Damage> {
    (
        prop::collection::vec((any::<usize>(), 1u8..=255), 0..4),
        prop::option::of(any::<usize>()),
    )
        .prop_map(|(flips, truncate)| Damage { flips, truncate })
}

impl Damage {
    fn apply(&self, bytes: &[u8]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        if !out.is_empty() {
            for &(pos, mask) in &self.flips {
                let len = out.len();
                out[pos % len] ^= mask;
            }
        }
        if let Some(t) = self.truncate {
            out.truncate(t % (bytes.len() + 1));
        }
        out
    }
}

fn exercise_readers_on(bytes: &[u8]) {
    let _ = ChunkIndex::from_reader(Cursor::new(bytes), "mem".into());
    let _ = read_chunks(bytes, ReadOptions::strict());
    let (_, err, stats) = read_chunks(bytes, ReadOptions::lenient());
    assert!(err.is_none() || matches!(err, Some(Error::Io { .. })));
    assert!(stats.skipped_bytes <= bytes.len() as u64);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2000)) {
        exercise_readers_on(&bytes);
    }

    #[test]
    fn random_payloads_behind_valid_headers_never_panic(
        compressor in compressor_strategy(),
        records in any::<u32>(),
        payload in prop::collection::vec(any::<u8>(), 0..600),
        tail in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        // A header whose CRC matches random bytes gets past the checksum, exercising
        // decompression and record framing on garbage.
        let header = ChunkHeader {
            crc32: crc32fast::hash(&payload),
            compressor,
            compressed_len: payload.len() as u32,
            records: records % 50,
        };
        let mut bytes = header.encode().to_vec();
        bytes.extend_from_slice(&payload);
        bytes.extend_from_slice(&tail);
        exercise_readers_on(&bytes);
    }

    #[test]
    fn round_trip(
        records in records_strategy(),
        max_chunk_bytes in 0usize..2048,
        compressor in compressor_strategy(),
    ) {
        let (bytes, wstats) = write_vec(&records, opts(max_chunk_bytes, compressor));
        prop_assert_eq!(wstats.file_bytes, bytes.len() as u64);
        let (chunks, err, rstats) = read_chunks(&bytes, ReadOptions::strict());
        prop_assert!(err.is_none());
        prop_assert_eq!(flatten(&chunks), records.clone());
        prop_assert_eq!(rstats.records, wstats.records);
        prop_assert_eq!(rstats.bytes, wstats.uncompressed_bytes);
        prop_assert_eq!(rstats.chunks, wstats.chunks);
        let index = ChunkIndex::from_reader(Cursor::new(&bytes), "mem".into()).unwrap();
        prop_assert_eq!(index.records(), records.len() as u64);
        prop_assert_eq!(index.chunks, chunks.iter().map(|c| c.meta).collect::<Vec<_>>());
    }

    #[test]
    fn damaged_files_never_panic_and_only_yield_intact_chunks(
        records in records_strategy(),
        max_chunk_bytes in 0usize..1024,
        compressor in compressor_strategy(),
        damage in damage_strategy(),
    ) {
        let (bytes, _) = write_vec(&records, opts(max_chunk_bytes, compressor));
        let (chunks, _, _) = read_chunks(&bytes, ReadOptions::strict());
        let bad = damage.apply(&bytes);
        exercise_readers_on(&bad);
        let (strict, _, _) = read_chunks(&bad, ReadOptions::strict());
        prop_assert!(chunks.starts_with(&strict));
        let (lenient, err, _) = read_chunks(&bad, ReadOptions::lenient());
        prop_assert!(err.is_none());
        prop_assert!(is_subsequence(&lenient, &chunks));
    }

}

proptest! {
    // These touch the file system: fewer cases.
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn reopen_and_read_ranges(
        records in records_strategy(),
        max_chunk_bytes in 0usize..2048,
        compressor in compressor_strategy(),
        range in (0usize..64, 0usize..64),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("part");
        let mut w = FileWriter::create(&path, opts(max_chunk_bytes, compressor)).unwrap();
        for r in &records {
            w.write(r).unwrap();
        }
        let wstats = w.finish().unwrap();
        let (got, rstats) = scan_all(vec![path.clone()], ReadOptions::strict());
        prop_assert_eq!(&got, &records);
        prop_assert_eq!(rstats.records, wstats.records);

        let index = ChunkIndex::build(&path).unwrap();
        prop_assert_eq!(index.file_len, wstats.file_bytes);
        let bytes = fs::read(&path).unwrap();
        let (chunks, _, _) = read_chunks(&bytes, ReadOptions::strict());
        let n = index.len();
        let (a, b) = (range.0 % (n + 1), range.1 % (n + 1));
        let (start, end) = (a.min(b), a.max(b));
        let got = range_records(&index, start..end, ReadOptions::strict()).unwrap();
        prop_assert_eq!(got, flatten(&chunks[start..end]));
    }

    #[test]
    fn range_scanner_on_damaged_file_never_panics(
        records in records_strategy(),
        max_chunk_bytes in 0usize..1024,
        compressor in compressor_strategy(),
        damage in damage_strategy(),
        range in (0usize..64, 0usize..64),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("part");
        let (bytes, _) = write_vec(&records, opts(max_chunk_bytes, compressor));
        fs::write(&path, &bytes).unwrap();
        let index = ChunkIndex::build(&path).unwrap();
        let (chunks, _, _) = read_chunks(&bytes, ReadOptions::strict());
        fs::write(&path, damage.apply(&bytes)).unwrap();
        let n = index.len();
        let (a, b) = (range.0 % (n + 1), range.1 % (n + 1));
        let (start, end) = (a.min(b), a.max(b));
        let wanted = &chunks[start..end];
        for opts in [ReadOptions::strict(), ReadOptions::lenient()] {
            let mut scanner = RangeScanner::open(&index, start..end, opts).unwrap();
            let mut got = Vec::new();
            loop {
                match scanner.next_chunk() {
                    Ok(Some(chunk)) => got.push(Decoded {
                        meta: chunk.meta().unwrap(),
                        records: chunk.to_vecs(),
                    }),
                    Ok(None) => break,
                    Err(e) => {
                        prop_assert!(!opts.lenient && e.is_corruption(), "{}", e);
                        break;
                    }
                }
            }
            if opts.lenient {
                prop_assert!(is_subsequence(&got, wanted));
            } else {
                prop_assert!(wanted.starts_with(&got));
            }
        }
    }
}
