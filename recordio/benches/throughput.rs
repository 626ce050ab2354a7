//! RecordIO write and sequential read throughput, 1 KiB records, for every compressor,
//! against a raw read of the same uncompressed file from the page cache.
//!
//! Run with `cargo bench -p edl-recordio --bench throughput`. After the criterion
//! groups a summary table prints MB/s per case (best of a few runs) and each read's
//! ratio to the raw read.

use std::fs::File;
use std::hint::black_box;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput};
use edl_recordio::{Compressor, ReadOptions, Scanner, Writer, WriterOptions};

const RECORD_BYTES: usize = 1024;
/// Record bytes per case; gzip is slow to write, so it gets less data.
const TOTAL_BYTES: usize = 64 << 20;
const GZIP_TOTAL_BYTES: usize = 16 << 20;

/// Text-like data (words from a small vocabulary), so compressors have work to do
/// without it being trivial.
fn dataset(total: usize) -> Vec<u8> {
    const WORDS: [&str; 16] = [
        "elastic", "trainer", "master", "pserver", "gradient", "chunk", "record", "task", "lease",
        "etcd", "shard", "step", "loss", "0.0317", "1e-4", "batch",
    ];
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut out = Vec::with_capacity(total + 16);
    while out.len() < total {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(WORDS[(state % 16) as usize].as_bytes());
        out.push(if state & 0x100 == 0 { b' ' } else { b'\n' });
        if state & 0x3000 == 0 {
            out.extend_from_slice(&state.to_le_bytes());
        }
    }
    out.truncate(total);
    out
}

fn total_for(compressor: Compressor) -> usize {
    if compressor == Compressor::Gzip {
        GZIP_TOTAL_BYTES
    } else {
        TOTAL_BYTES
    }
}

fn write_file(path: &Path, data: &[u8], compressor: Compressor) -> u64 {
    let file = File::create(path).expect("create bench file");
    let opts = WriterOptions {
        compressor,
        ..WriterOptions::default()
    };
    let mut writer = Writer::new(file, opts);
    for record in data.chunks(RECORD_BYTES) {
        writer.write(record).expect("write record");
    }
    let (_, stats) = writer.into_inner().expect("finish");
    stats.file_bytes
}

fn read_file(path: &Path) -> u64 {
    let mut scanner =
        Scanner::open(vec![path.to_path_buf()], ReadOptions::default()).expect("open");
    let mut bytes = 0u64;
    while let Some(record) = scanner.next_record().expect("read record") {
        bytes += black_box(record).len() as u64;
    }
    bytes
}

/// The baseline: the whole uncompressed file read into a reused buffer.
fn raw_read(path: &Path, buf: &mut Vec<u8>) -> u64 {
    buf.clear();
    File::open(path)
        .and_then(|mut f| f.read_to_end(buf))
        .expect("raw read") as u64
}

/// A second baseline: the file read in 1 MiB blocks into one reused (cache-resident)
/// buffer, as the reader reads chunks.
fn raw_read_blocks(path: &Path, block: &mut [u8]) -> u64 {
    let mut file = File::open(path).expect("open");
    let mut total = 0u64;
    loop {
        match file.read(block).expect("raw read") {
            0 => return total,
            n => total += n as u64,
        }
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    data: Vec<u8>,
    /// The file of each compressor, for reading.
    files: Vec<(Compressor, PathBuf)>,
    /// Scratch file for the write benches.
    scratch: PathBuf,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dataset(TOTAL_BYTES);
        let files = Compressor::ALL
            .into_iter()
            .map(|c| {
                let path = dir.path().join(format!("data-{c}.recordio"));
                let file_bytes = write_file(&path, &data[..total_for(c)], c);
                eprintln!(
                    "{c:>6}: {} MiB of records -> {:.1} MiB on disk",
                    total_for(c) >> 20,
                    file_bytes as f64 / f64::from(1 << 20)
                );
                (c, path)
            })
            .collect();
        Fixture {
            scratch: dir.path().join("scratch.recordio"),
            _dir: dir,
            data,
            files,
        }
    }

    fn uncompressed(&self) -> &Path {
        &self.files[0].1
    }
}

fn benches(c: &mut Criterion, fx: &Fixture) {
    let mut group = c.benchmark_group("write");
    group.sampling_mode(SamplingMode::Flat);
    for &(compressor, _) in &fx.files {
        let data = &fx.data[..total_for(compressor)];
        group.throughput(Throughput::Bytes(data.len() as u64));
        group.bench_function(compressor.name(), |b| {
            b.iter(|| write_file(&fx.scratch, data, compressor))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("read");
    group.sampling_mode(SamplingMode::Flat);
    let mut buf = Vec::new();
    group.throughput(Throughput::Bytes(TOTAL_BYTES as u64));
    group.bench_function("raw", |b| b.iter(|| raw_read(fx.uncompressed(), &mut buf)));
    let mut block = vec![0u8; 1 << 20];
    group.bench_function("raw-1m-blocks", |b| {
        b.iter(|| raw_read_blocks(fx.uncompressed(), &mut block))
    });
    for (compressor, path) in &fx.files {
        group.throughput(Throughput::Bytes(total_for(*compressor) as u64));
        group.bench_function(compressor.name(), |b| b.iter(|| read_file(path)));
    }
    group.finish();
}

/// Best MB/s (10^6 bytes per second) of `runs` runs of `f`, which handles `bytes` bytes.
fn best_mbps(runs: usize, bytes: usize, mut f: impl FnMut()) -> f64 {
    let best = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .min()
        .unwrap_or(Duration::MAX);
    bytes as f64 / best.as_secs_f64() / 1e6
}

fn summary(fx: &Fixture) {
    const RUNS: usize = 5;
    let mut buf = Vec::new();
    let raw = best_mbps(RUNS, TOTAL_BYTES, || {
        black_box(raw_read(fx.uncompressed(), &mut buf));
    });
    println!();
    println!("summary: 1 KiB records, best of {RUNS} runs, MB/s = 10^6 record bytes/s");
    println!(
        "{:<14} {:>12} {:>12} {:>14}",
        "case", "write MB/s", "read MB/s", "read vs raw"
    );
    let mut block = vec![0u8; 1 << 20];
    let raw_blocks = best_mbps(RUNS, TOTAL_BYTES, || {
        black_box(raw_read_blocks(fx.uncompressed(), &mut block));
    });
    println!("{:<14} {:>12} {:>12.0} {:>13.0}%", "raw", "-", raw, 100.0);
    println!(
        "{:<14} {:>12} {:>12.0} {:>13.0}%",
        "raw-1m-blocks",
        "-",
        raw_blocks,
        100.0 * raw_blocks / raw
    );
    for (compressor, path) in &fx.files {
        let total = total_for(*compressor);
        let data = &fx.data[..total];
        let write = best_mbps(RUNS, total, || {
            black_box(write_file(&fx.scratch, data, *compressor));
        });
        let read = best_mbps(RUNS, total, || {
            black_box(read_file(path));
        });
        println!(
            "{:<14} {:>12.0} {:>12.0} {:>13.0}%",
            compressor.name(),
            write,
            read,
            100.0 * read / raw
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--test" || a == "--list");
    let fx = Fixture::new();
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    benches(&mut c, &fx);
    c.final_summary();
    if !quick {
        summary(&fx);
    }
}
