//! `edl data` end to end: the real binary on the bundled data sets and on bad input.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn edl() -> Command {
    Command::new(env!("CARGO_BIN_EXE_edl"))
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/data")
        .join(name)
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("spawn edl")
}

fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "command failed: {:?}\nstdout: {}\nstderr: {}",
        cmd,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Data commands are quiet: on success nothing on stderr (no INFO lines without -v).
    assert!(
        out.stderr.is_empty(),
        "{cmd:?} succeeded but wrote to stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn fails(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        !out.status.success(),
        "command should have failed: {cmd:?}\nstdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !stderr.contains("panicked"),
        "edl panicked on bad input: {stderr}"
    );
    format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr)
}

fn stat_json(pattern: &str) -> serde_json::Value {
    let text = ok(edl().args(["data", "stat", "--json", pattern]));
    serde_json::from_str(text.trim()).expect("stat --json prints one JSON object")
}

fn recordio_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn housing_csv_converts_into_shards_that_stat_verify_and_decode() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    ok(edl()
        .args([
            "data", "convert", "--format", "csv", "--shards", "4", "--prefix", "housing",
        ])
        .args(["--chunk-size", "4KiB", "--out"])
        .arg(out)
        .arg(data("boston_housing.csv")));
    assert_eq!(
        recordio_files(out),
        (0..4)
            .map(|i| format!("housing-{i:05}-of-00004.recordio"))
            .collect::<Vec<_>>()
    );
    let pattern = format!("{}/housing-*.recordio", out.display());
    let stat = stat_json(&pattern);
    assert_eq!(stat["files"], 4);
    assert_eq!(stat["records"], 506);
    assert!(
        stat["chunks"].as_u64().unwrap() > 4,
        "4KiB chunks give several per shard"
    );
    assert!(stat["bytes"].as_u64().unwrap() > 0);

    let verify = ok(edl().args(["data", "verify", &pattern]));
    assert_eq!(verify.lines().filter(|l| l.starts_with("ok ")).count(), 4);

    // Round-robin sharding: the first record of shard 0 is the first CSV row.
    let first = ok(edl()
        .args(["data", "cat", "--decode", "--limit", "1"])
        .arg(out.join("housing-00000-of-00004.recordio")));
    let sample: serde_json::Value = serde_json::from_str(first.trim()).unwrap();
    let dense = sample["dense"].as_array().unwrap();
    assert_eq!(dense.len(), 13);
    assert!((dense[0].as_f64().unwrap() - 0.00632).abs() < 1e-6);
    assert!((sample["value"].as_f64().unwrap() - 24.0).abs() < 1e-6);

    // Every row of the CSV is in the shards exactly once.
    let all = ok(edl().args(["data", "cat", "--decode", &pattern]));
    let mut targets: Vec<f32> = all
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["value"]
                .as_f64()
                .unwrap() as f32
        })
        .collect();
    let csv = std::fs::read_to_string(data("boston_housing.csv")).unwrap();
    let mut expected: Vec<f32> = csv
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.rsplit(',').next().unwrap().trim().parse().unwrap())
        .collect();
    targets.sort_by(f32::total_cmp);
    expected.sort_by(f32::total_cmp);
    assert_eq!(targets, expected);
}

#[test]
fn mnist_converts_with_scaled_pixels_and_class_labels() {
    let dir = tempfile::tempdir().unwrap();
    ok(edl()
        .args([
            "data",
            "convert",
            "--format",
            "mnist-csv",
            "--shards",
            "3",
            "--prefix",
            "mnist",
        ])
        .args(["--compressor", "gzip", "--chunk-size", "256KiB", "--out"])
        .arg(dir.path())
        .arg(data("mnist_5k.csv.gz")));
    let pattern = format!("{}/mnist-*.recordio", dir.path().display());
    let stat = stat_json(&pattern);
    assert_eq!(stat["files"], 3);
    assert_eq!(stat["records"], 5000);
    assert!(stat["compression_ratio"].as_f64().unwrap() > 1.5);
    let all = ok(edl().args(["data", "cat", "--decode", &pattern]));
    let mut per_class: BTreeMap<u64, u64> = BTreeMap::new();
    for line in all.lines() {
        let s: serde_json::Value = serde_json::from_str(line).unwrap();
        let pixels = s["dense"].as_array().unwrap();
        assert_eq!(pixels.len(), 784);
        assert!(
            pixels
                .iter()
                .all(|p| (0.0..=1.0).contains(&p.as_f64().unwrap()))
        );
        *per_class
            .entry(s["class_id"].as_u64().unwrap())
            .or_default() += 1;
    }
    assert_eq!(per_class, (0..10).map(|c| (c, 500)).collect());
}

#[test]
fn text_converts_to_word_ids_with_a_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("corpus.txt");
    std::fs::write(&input, "the cat sat\n\nthe dog sat down\nthe end\n").unwrap();
    let out = dir.path().join("out");
    ok(edl()
        .args([
            "data",
            "convert",
            "--format",
            "text",
            "--prefix",
            "ptb",
            "--min-word-freq",
            "2",
            "--out",
        ])
        .arg(&out)
        .arg(&input));
    let vocab: Vec<String> = std::fs::read_to_string(out.join("ptb.vocab"))
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    // <s>, <e> and "the" appear 3 times, "sat" twice; the rest fall under <unk>.
    assert_eq!(vocab, ["<e>", "<s>", "the", "sat", "<unk>"]);
    let text = ok(edl()
        .args(["data", "cat", "--decode"])
        .arg(out.join("ptb-00000-of-00001.recordio")));
    let ids: Vec<Vec<u64>> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["sparse_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(
        ids,
        vec![
            vec![1, 2, 4, 3, 0],
            vec![1, 2, 4, 3, 4, 0],
            vec![1, 2, 4, 0]
        ]
    );

    // A test split converted with the training vocabulary uses the same ids.
    let test_input = dir.path().join("test.txt");
    std::fs::write(&test_input, "the sat zebra\n").unwrap();
    ok(edl()
        .args([
            "data", "convert", "--format", "text", "--prefix", "ptb-test", "--vocab",
        ])
        .arg(out.join("ptb.vocab"))
        .arg("--out")
        .arg(&out)
        .arg(&test_input));
    let text = ok(edl()
        .args(["data", "cat", "--decode"])
        .arg(out.join("ptb-test-00000-of-00001.recordio")));
    assert!(text.contains("[1,2,3,4,0]"), "{text}");
}

#[test]
fn split_reshards_without_losing_or_changing_records() {
    let dir = tempfile::tempdir().unwrap();
    ok(edl()
        .args([
            "data", "convert", "--format", "csv", "--shards", "4", "--prefix", "h", "--out",
        ])
        .arg(dir.path())
        .arg(data("boston_housing.csv")));
    let pattern = format!("{}/h-*.recordio", dir.path().display());
    let out = dir.path().join("resharded");
    ok(edl()
        .args([
            "data",
            "split",
            "--shards",
            "2",
            "--prefix",
            "r",
            "--compressor",
            "zstd",
            "--out",
        ])
        .arg(&out)
        .arg(&pattern));
    let resharded = format!("{}/r-*.recordio", out.display());
    assert_eq!(stat_json(&resharded)["files"], 2);
    let mut before: Vec<String> = ok(edl().args(["data", "cat", "--decode", &pattern]))
        .lines()
        .map(str::to_owned)
        .collect();
    let mut after: Vec<String> = ok(edl().args(["data", "cat", "--decode", &resharded]))
        .lines()
        .map(str::to_owned)
        .collect();
    before.sort();
    after.sort();
    assert_eq!(before.len(), 506);
    assert_eq!(before, after);
}

#[test]
fn verify_names_a_corrupt_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    ok(edl()
        .args([
            "data",
            "convert",
            "--format",
            "csv",
            "--shards",
            "2",
            "--prefix",
            "h",
            "--chunk-size",
            "2KiB",
            "--out",
        ])
        .arg(dir.path())
        .arg(data("boston_housing.csv")));
    let bad = dir.path().join("h-00001-of-00002.recordio");
    let mut bytes = std::fs::read(&bad).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&bad, &bytes).unwrap();
    let text = fails(
        edl()
            .args(["data", "verify"])
            .arg(dir.path().join("h-*.recordio")),
    );
    assert!(
        text.contains("ok   ") && text.contains("h-00000-of-00002.recordio"),
        "{text}"
    );
    let bad_line = text
        .lines()
        .find(|l| l.starts_with("BAD"))
        .expect("a BAD line");
    assert!(bad_line.contains("h-00001-of-00002.recordio"), "{bad_line}");
    assert!(bad_line.contains("at byte"), "{bad_line}");
    assert!(text.contains("1 of 2 file(s) are corrupt"), "{text}");

    // stat and cat refuse the corrupt file with the same kind of message.
    let text = fails(edl().args(["data", "stat"]).arg(&bad));
    assert!(
        text.contains("corrupt") && text.contains("h-00001-of-00002.recordio"),
        "{text}"
    );
}

#[test]
fn bad_input_is_one_clear_error_and_leaves_no_shards() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");

    let text = fails(
        edl()
            .args([
                "data", "convert", "--format", "csv", "--prefix", "x", "--out",
            ])
            .arg(&out)
            .arg(dir.path().join("missing.csv")),
    );
    assert!(text.contains("missing.csv"), "{text}");

    let ragged = dir.path().join("ragged.csv");
    std::fs::write(&ragged, "1,2,3\n4,5,6\n7,8\n").unwrap();
    let text = fails(
        edl()
            .args([
                "data", "convert", "--format", "csv", "--prefix", "x", "--out",
            ])
            .arg(&out)
            .arg(&ragged),
    );
    assert!(
        text.contains("ragged.csv:3: expected 3 columns, found 2"),
        "{text}"
    );

    let nan = dir.path().join("words.csv");
    std::fs::write(&nan, "1,2,3\n4,five,6\n").unwrap();
    let text = fails(
        edl()
            .args([
                "data", "convert", "--format", "csv", "--prefix", "x", "--out",
            ])
            .arg(&out)
            .arg(&nan),
    );
    assert!(
        text.contains("words.csv:2: column 2: \"five\" is not a number"),
        "{text}"
    );

    let text = fails(
        edl()
            .args([
                "data", "convert", "--format", "csv", "--label", "class", "--prefix", "x", "--out",
            ])
            .arg(&out)
            .arg(data("boston_housing.csv")),
    );
    assert!(text.contains("is not a non-negative integer"), "{text}");

    // A failed conversion leaves nothing under the final shard names.
    let leftovers: Vec<_> = std::fs::read_dir(&out)
        .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");

    // An output "directory" that is a file.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let text = fails(
        edl()
            .args([
                "data", "convert", "--format", "csv", "--prefix", "x", "--out",
            ])
            .arg(&file)
            .arg(data("boston_housing.csv")),
    );
    assert!(text.contains("a-file"), "{text}");

    // Globs that match nothing, and files that are not RecordIO.
    let text = fails(
        edl()
            .args(["data", "stat"])
            .arg(dir.path().join("nothing-*.recordio")),
    );
    assert!(text.contains("nothing-*.recordio"), "{text}");
    let text = fails(edl().args(["data", "verify"]).arg(&ragged));
    assert!(
        text.contains("ragged.csv") && text.contains("BAD"),
        "{text}"
    );
}

/// Paddle's MultiSlot text (CTR-DNN's layout) becomes samples of features, ids and a
/// class; a bad line is named by file, line and slot, and nothing is written.
#[test]
fn multislot_converts_paddles_ctr_lines() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("ctr.txt");
    std::fs::write(
        &input,
        "2 0.5 -1 1 7 1 1040000 1 1\n\n2 0 0.25 1 3 1 9 1 0\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let convert = |input: &std::path::Path, out: &std::path::Path| {
        let mut c = edl();
        c.args([
            "data",
            "convert",
            "--format",
            "multislot",
            "--slots",
            "dense,sparse*2,label",
            "--label",
            "class",
            "--prefix",
            "ctr",
            "--out",
        ])
        .arg(out)
        .arg(input);
        c
    };
    ok(&mut convert(&input, &out));
    let text = ok(edl()
        .args(["data", "cat", "--decode"])
        .arg(out.join("ctr-00000-of-00001.recordio")));
    let samples: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(samples.len(), 2, "{text}");
    assert_eq!(samples[0]["dense"], serde_json::json!([0.5, -1.0]));
    assert_eq!(samples[0]["sparse_ids"], serde_json::json!([7, 1040000]));
    assert_eq!(samples[1]["sparse_ids"], serde_json::json!([3, 9]));
    assert_eq!(samples[0]["class_id"], serde_json::json!(1));
    assert_eq!(samples[1]["class_id"], serde_json::json!(0));
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, "2 0.5 -1 1 7 1 8 1 1\n2 0.5 -1 1 7 1 x 1 1\n").unwrap();
    let out2 = dir.path().join("out2");
    let err = fails(&mut convert(&bad, &out2));
    assert!(
        err.contains("bad.txt:2") && err.contains("slot 3: \"x\" is not a non-negative integer id"),
        "{err}"
    );
    let left = std::fs::read_dir(&out2).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "a failed conversion leaves no shard behind");
}
