//! `edl data stat`, `verify` and `cat`: read RecordIO files and objects (`s3://...`).

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use edl_proto::sample::{self, sample::Label};
use edl_recordio::ReadStats;
use serde_json::json;

use super::{CatArgs, PathsArgs, StatArgs, chunk_index, expand, scanner};

/// Totals of one file for `stat`.
#[derive(Debug, Default, Clone)]
struct FileStat {
    path: PathBuf,
    chunks: u64,
    records: u64,
    /// Bytes on disk.
    bytes: u64,
    /// Record bytes after decompression.
    uncompressed_bytes: u64,
}

fn stat_file(path: PathBuf) -> anyhow::Result<FileStat> {
    let index = chunk_index(&path)?;
    let mut records = scanner(vec![path.clone()], false);
    while records.next_record()?.is_some() {}
    let s: ReadStats = records.stats();
    Ok(FileStat {
        chunks: index.chunks.len() as u64,
        records: index.records(),
        bytes: index.file_len,
        uncompressed_bytes: s.bytes,
        path,
    })
}

fn ratio(uncompressed: u64, bytes: u64) -> f64 {
    if bytes == 0 {
        1.0
    } else {
        uncompressed as f64 / bytes as f64
    }
}

/// Runs `edl data stat`.
pub fn stat(args: &StatArgs) -> anyhow::Result<()> {
    let files = expand(&args.paths)?;
    let stats = files
        .into_iter()
        .map(stat_file)
        .collect::<anyhow::Result<Vec<_>>>()?;
    let total = stats.iter().fold(FileStat::default(), |mut t, s| {
        t.chunks += s.chunks;
        t.records += s.records;
        t.bytes += s.bytes;
        t.uncompressed_bytes += s.uncompressed_bytes;
        t
    });
    if args.json {
        let per_file: Vec<_> = stats
            .iter()
            .map(|s| {
                json!({
                    "path": s.path.display().to_string(),
                    "chunks": s.chunks,
                    "records": s.records,
                    "bytes": s.bytes,
                    "uncompressed_bytes": s.uncompressed_bytes,
                })
            })
            .collect();
        let obj = json!({
            "files": stats.len(),
            "chunks": total.chunks,
            "records": total.records,
            "bytes": total.bytes,
            "uncompressed_bytes": total.uncompressed_bytes,
            "compression_ratio": ratio(total.uncompressed_bytes, total.bytes),
            "per_file": per_file,
        });
        println!("{obj}");
    } else {
        println!("files              {}", stats.len());
        println!("chunks             {}", total.chunks);
        println!("records            {}", total.records);
        println!("bytes              {}", total.bytes);
        println!("uncompressed bytes {}", total.uncompressed_bytes);
        println!(
            "compression ratio  {:.2}",
            ratio(total.uncompressed_bytes, total.bytes)
        );
    }
    Ok(())
}

/// Runs `edl data verify`: every file is read to the end; each bad one is named with the
/// first bad offset and how much a lenient read would skip.
pub fn verify(args: &PathsArgs) -> anyhow::Result<ExitCode> {
    let files = expand(&args.paths)?;
    let mut bad = 0usize;
    for path in &files {
        let mut strict = scanner(vec![path.clone()], false);
        let first_error = loop {
            match strict.next_record() {
                Ok(Some(_)) => {}
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        match first_error {
            None => {
                let s = strict.stats();
                println!(
                    "ok   {}: {} chunks, {} records",
                    path.display(),
                    s.chunks,
                    s.records
                );
            }
            Some(err) => {
                bad += 1;
                let mut lenient = scanner(vec![path.clone()], true);
                // A lenient read never fails on corruption; an I/O error ends it early.
                while let Ok(Some(_)) = lenient.next_record() {}
                let s = lenient.stats();
                println!(
                    "BAD  {err}; a lenient read keeps {} chunks ({} records) and skips {} chunks ({} bytes)",
                    s.chunks, s.records, s.skipped_chunks, s.skipped_bytes
                );
            }
        }
    }
    if bad > 0 {
        eprintln!("error: {bad} of {} file(s) are corrupt", files.len());
        return Ok(ExitCode::FAILURE);
    }
    println!("all {} file(s) ok", files.len());
    Ok(ExitCode::SUCCESS)
}

/// A sample as `edl data cat --decode` prints it: `f32`s serialised as `f32`s so they
/// print in their shortest form (`0.00632`, not `0.006320000160485506`).
#[derive(serde::Serialize)]
struct DecodedSample<'a> {
    #[serde(skip_serializing_if = "<[f32]>::is_empty")]
    dense: &'a [f32],
    #[serde(skip_serializing_if = "<[u64]>::is_empty")]
    sparse_ids: &'a [u64],
    #[serde(skip_serializing_if = "<[f32]>::is_empty")]
    sparse_values: &'a [f32],
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    class_id: Option<u32>,
}

impl<'a> From<&'a sample::Sample> for DecodedSample<'a> {
    fn from(s: &'a sample::Sample) -> Self {
        DecodedSample {
            dense: &s.dense,
            sparse_ids: &s.sparse_ids,
            sparse_values: &s.sparse_values,
            value: match s.label {
                Some(Label::Value(v)) => Some(v),
                _ => None,
            },
            class_id: match s.label {
                Some(Label::ClassId(c)) => Some(c),
                _ => None,
            },
        }
    }
}

/// Runs `edl data cat`.
pub fn cat(args: &CatArgs) -> anyhow::Result<()> {
    let files = expand(&args.paths)?;
    let mut records = scanner(files, false);
    let stdout = std::io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let mut n = 0u64;
    let result = (|| -> anyhow::Result<()> {
        while args.limit.is_none_or(|l| n < l) {
            let Some(record) = records.next_record()? else {
                break;
            };
            n += 1;
            if args.decode {
                let s = sample::decode(record).with_context(|| format!("record {n}"))?;
                serde_json::to_writer(&mut out, &DecodedSample::from(&s))?;
                writeln!(out)?;
            } else {
                out.write_all(record)?;
                out.write_all(b"\n")?;
            }
        }
        out.flush()?;
        Ok(())
    })();
    match result {
        // `edl data cat | head` closes the pipe: that is not an error.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            Ok(())
        }
        other => other,
    }
}
