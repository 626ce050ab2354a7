//! The real data sets of the tests and the benchmark, parsed into samples the way
//! `edl data convert` encodes them (csv: features then the label last; mnist-csv: pixels
//! scaled to [0, 1]; text: word ids with `<s>`/`<e>`, vocabulary by descending
//! frequency then `<unk>`). Shared by the unit tests and `benches/` (`#[path]`), so it
//! uses public APIs only.
#![allow(dead_code)]

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

use edl_proto::sample::Sample;

/// Finds a data file: `$EDL_DATA_DIR`, the workspace's `examples/data`, this crate's
/// `testdata`, then `../shared/data` next to the workspace.
pub fn data_file(name: &str) -> PathBuf {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut dirs: Vec<PathBuf> = std::env::var_os("EDL_DATA_DIR")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    dirs.push(crate_dir.join("../examples/data"));
    dirs.push(crate_dir.join("testdata"));
    dirs.push(crate_dir.join("../../shared/data"));
    for dir in &dirs {
        let path = dir.join(name);
        if std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            return path;
        }
    }
    panic!("data file {name} not found in any of {dirs:?}");
}

fn lines(name: &str) -> Vec<String> {
    let path = data_file(name);
    let file = File::open(&path).expect("open data file");
    let reader: Box<dyn BufRead> = if name.ends_with(".gz") {
        Box::new(BufReader::new(flate2::read::GzDecoder::new(file)))
    } else {
        Box::new(BufReader::new(file))
    };
    reader
        .lines()
        .map(|l| l.expect("read data file"))
        .filter(|l| !l.trim().is_empty())
        .collect()
}

fn floats(line: &str) -> Vec<f32> {
    line.split(',')
        .map(|f| f.trim().parse::<f32>().expect("a number"))
        .collect()
}

/// UCI Housing: 506 samples of 13 features, target the median value.
pub fn boston() -> Vec<Sample> {
    lines("boston_housing.csv")
        .iter()
        .map(|l| {
            let mut v = floats(l);
            let y = v.pop().expect("a label column");
            Sample::regression(v, y)
        })
        .collect()
}

/// mnist_5k: 5000 digits (500 per class, sorted by class), pixels scaled to [0, 1].
pub fn mnist() -> Vec<Sample> {
    lines("mnist_5k.csv.gz")
        .iter()
        .map(|l| {
            let mut v = floats(l);
            let y = v.pop().expect("a label column");
            for p in &mut v {
                *p /= 255.0;
            }
            Sample::classification(v, y as u32)
        })
        .collect()
}

/// Deterministic hold-out: every `k`-th sample (index `i % k == k - 1`) is a test sample.
/// Stratified for data sorted by class.
pub fn split_every(samples: &[Sample], k: usize) -> (Vec<Sample>, Vec<Sample>) {
    let (mut train, mut test) = (Vec::new(), Vec::new());
    for (i, s) in samples.iter().enumerate() {
        if i % k == k - 1 {
            test.push(s.clone());
        } else {
            train.push(s.clone());
        }
    }
    (train, test)
}

/// The first 1000 sentences of PTB's validation split as word-id samples, and the size
/// of their vocabulary (built from them with `min_word_freq` 1).
pub fn ptb_subset() -> (Vec<Sample>, u64) {
    let sentences = lines("ptb.valid.head1000.txt");
    let mut freq: HashMap<&str, u64> = HashMap::new();
    for s in &sentences {
        for w in s.split_whitespace().chain(["<s>", "<e>"]) {
            *freq.entry(w).or_default() += 1;
        }
    }
    let mut words: Vec<(&str, u64)> = freq.into_iter().filter(|(w, _)| *w != "<unk>").collect();
    words.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    let mut ids: HashMap<&str, u64> = words
        .iter()
        .enumerate()
        .map(|(i, (w, _))| (*w, i as u64))
        .collect();
    let unk = ids.len() as u64;
    ids.insert("<unk>", unk);
    let samples = sentences
        .iter()
        .map(|s| {
            let mut v = vec![ids["<s>"]];
            v.extend(
                s.split_whitespace()
                    .map(|w| ids.get(w).copied().unwrap_or(unk)),
            );
            v.push(ids["<e>"]);
            Sample::sparse(v)
        })
        .collect();
    (samples, unk + 1)
}
