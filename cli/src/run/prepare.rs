//! Data preparation: the spec's RecordIO files made from `[data.prepare]` when they are
//! missing (converted in process, as `edl data convert` would), and the check that every
//! glob of the spec matches a file.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::ValueEnum;
use edl_recordio::{Compressor, DEFAULT_MAX_CHUNK_BYTES};

use crate::data::{ConvertArgs, InputFormat, LabelKind, OutputArgs};
use edl_job::JobSpec;
use edl_job::spec::PrepareSpec;

/// `DIR/PREFIX-*.recordio` -> (DIR, PREFIX).
fn glob_target(glob: &str, key: &str) -> anyhow::Result<(PathBuf, String)> {
    let path = Path::new(glob);
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let prefix = name.strip_suffix("-*.recordio").with_context(|| {
        format!(
            "data.{key}: with [data.prepare] it must look like DIR/PREFIX-*.recordio, not {glob}"
        )
    })?;
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok((dir, prefix.to_owned()))
}

fn matches_nothing(globs: &[String]) -> bool {
    edl_recordio::expand_globs(globs).map_or(true, |f| f.is_empty())
}

/// One conversion of `[data.prepare]`: plain options for the data library.
struct Conversion<'a> {
    prep: &'a PrepareSpec,
    dir: &'a Path,
    prefix: &'a str,
    shards: u32,
    /// The training split's vocabulary (text, test split).
    vocab: Option<PathBuf>,
}

impl Conversion<'_> {
    /// The options of `edl data convert` for this conversion of `input`.
    fn args(&self, input: PathBuf) -> anyhow::Result<ConvertArgs> {
        let prep = self.prep;
        let format = InputFormat::from_str(&prep.format, false)
            .map_err(|e| anyhow::anyhow!("data.prepare.format: {e}"))?;
        let label = match &prep.label {
            Some(l) => LabelKind::from_str(l, false)
                .map_err(|e| anyhow::anyhow!("data.prepare.label: {e}"))?,
            None => LabelKind::Value,
        };
        let chunk_size = match &prep.chunk_size {
            Some(c) => crate::data::parse_size(c)
                .map_err(|e| anyhow::anyhow!("data.prepare.chunk_size: {e}"))?,
            None => DEFAULT_MAX_CHUNK_BYTES as u64,
        };
        Ok(ConvertArgs {
            format,
            label_column: -1,
            label,
            delimiter: ',',
            header: prep.header,
            slots: prep.slots.clone(),
            min_word_freq: 1,
            vocab: self.vocab.clone(),
            output: OutputArgs {
                shards: self.shards,
                prefix: self.prefix.to_owned(),
                out: self.dir.to_path_buf(),
                compressor: Compressor::default(),
                chunk_size,
            },
            inputs: vec![input],
        })
    }

    /// Writes `lines` (after the header, if any) to a temporary input next to the
    /// output and converts it.
    fn run(&self, header: Option<&str>, lines: &[&str]) -> anyhow::Result<()> {
        let input = self.dir.join(format!(".{}.prepare.txt", self.prefix));
        let mut body = String::new();
        if let Some(h) = header {
            body.push_str(h);
            body.push('\n');
        }
        for l in lines {
            body.push_str(l);
            body.push('\n');
        }
        std::fs::write(&input, body).with_context(|| format!("write {}", input.display()))?;
        let converted = self
            .args(input.clone())
            .and_then(|a| crate::data::convert(&a));
        let _ = std::fs::remove_file(&input);
        converted
            .map(drop)
            .with_context(|| format!("data.prepare: converting {} failed", self.prep.from))
    }
}

/// Creates the spec's RecordIO files from `[data.prepare]` when they are missing.
pub(crate) fn prepare_data(spec: &JobSpec) -> anyhow::Result<()> {
    let Some(prep) = &spec.data.prepare else {
        return Ok(());
    };
    let train = spec.data.train.patterns();
    let test = spec.data.test.as_ref().map(|t| t.patterns());
    let missing = matches_nothing(&train) || test.as_deref().is_some_and(matches_nothing);
    if !missing {
        return Ok(());
    }
    anyhow::ensure!(
        train.len() == 1 && test.as_ref().is_none_or(|t| t.len() == 1),
        "data: with [data.prepare], train and test are one glob each"
    );
    let (train_dir, train_prefix) = glob_target(&train[0], "train")?;
    let test_target = match &test {
        Some(t) => Some(glob_target(&t[0], "test")?),
        None => None,
    };
    anyhow::ensure!(
        test_target.is_none() || prep.test_every >= 2,
        "data.prepare.test_every: must be at least 2 when data.test is set"
    );
    let raw = std::fs::read(&prep.from)
        .with_context(|| format!("data.prepare.from: read {}", prep.from))?;
    let text = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut flate2::read::MultiGzDecoder::new(&raw[..]), &mut s)
            .with_context(|| format!("data.prepare.from: decompress {}", prep.from))?;
        s
    } else {
        String::from_utf8(raw)
            .with_context(|| format!("data.prepare.from: {} is not UTF-8", prep.from))?
    };
    let mut lines: Vec<&str> = text.lines().collect();
    let header = if prep.header && !lines.is_empty() {
        Some(lines.remove(0))
    } else {
        None
    };
    if prep.shuffle {
        use rand::SeedableRng;
        use rand::seq::SliceRandom;
        lines.shuffle(&mut rand::rngs::StdRng::seed_from_u64(spec.train.seed));
    }
    let (mut tr, mut te) = (Vec::new(), Vec::new());
    for (i, l) in lines.into_iter().enumerate() {
        if test_target.is_some() && i % prep.test_every == prep.test_every - 1 {
            te.push(l);
        } else {
            tr.push(l);
        }
    }
    println!(
        "edl run: preparing {} training and {} test lines from {}",
        tr.len(),
        te.len(),
        prep.from
    );
    std::fs::create_dir_all(&train_dir)
        .with_context(|| format!("create {}", train_dir.display()))?;
    Conversion {
        prep,
        dir: &train_dir,
        prefix: &train_prefix,
        shards: prep.shards.max(1),
        vocab: None,
    }
    .run(header, &tr)?;
    if let Some((dir, prefix)) = &test_target {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let vocab =
            (prep.format == "text").then(|| train_dir.join(format!("{train_prefix}.vocab")));
        Conversion {
            prep,
            dir,
            prefix,
            shards: 1,
            vocab,
        }
        .run(header, &te)?;
    }
    Ok(())
}

/// Every glob of the spec matches at least one file or object (one clear error
/// otherwise: no match, a bad URL, missing credentials, a store that cannot be reached).
pub(crate) fn check_data(spec: &JobSpec) -> anyhow::Result<()> {
    let mut globs = spec.data.train.patterns();
    if let Some(t) = &spec.data.test {
        globs.extend(t.patterns());
    }
    for g in globs {
        if edl_storage::blocking::is_object_url(&g) || g.contains("://") {
            edl_storage::blocking::expand(std::slice::from_ref(&g))
                .map_err(|e| anyhow::anyhow!("data: {e}"))?;
            continue;
        }
        match edl_recordio::expand_globs(std::slice::from_ref(&g)) {
            Ok(files) if !files.is_empty() => {}
            Ok(_) => anyhow::bail!("data: no files match {g}"),
            Err(e) => anyhow::bail!("data: {e}"),
        }
    }
    Ok(())
}

/// Where the pservers of a run checkpoint: `[cluster] checkpoint_dir`, or `checkpoints`
/// in the run directory.
pub(crate) fn checkpoint_location(spec: &JobSpec, run_dir: &Path) -> String {
    match &spec.cluster.checkpoint_dir {
        Some(dir) => dir.clone(),
        None => run_dir.join("checkpoints").display().to_string(),
    }
}

/// Checks that checkpoints can go to `location` before anything starts: a directory is
/// created; an object URL must parse, its store must have credentials in the
/// environment, and a listing under it must succeed (a missing bucket or refused
/// credentials fail here, once).
pub(crate) fn check_checkpoint_dir(location: &str) -> anyhow::Result<()> {
    let parsed = edl_storage::Location::parse(location)
        .map_err(|e| anyhow::anyhow!("checkpoint directory: {e}"))?;
    if !parsed.is_object() {
        return std::fs::create_dir_all(location)
            .with_context(|| format!("create checkpoint directory {location}"));
    }
    let (store, key) = edl_storage::blocking::BlockingStore::open(location)
        .map_err(|e| anyhow::anyhow!("checkpoint directory: {e}"))?;
    store
        .list(&key)
        .map_err(|e| anyhow::anyhow!("checkpoint directory: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The labels of a CSV's lines (the last column) in the order `[data.prepare]` wrote
    /// them to the training files, for `shuffle` and `seed`.
    fn prepared_labels(dir: &Path, shuffle: bool, seed: u64) -> Vec<String> {
        let csv = dir.join("rows.csv");
        let rows: String = (0..40).map(|i| format!("{i}.5,{i}\n")).collect();
        std::fs::write(&csv, rows).unwrap();
        let out = dir.join(format!("out-{shuffle}-{seed}"));
        let mut spec = JobSpec::parse_toml(&format!(
            "name = \"p\"\n[data]\ntrain = \"{}/rows-*.recordio\"\n\
             [data.prepare]\nfrom = \"{}\"\nformat = \"csv\"\nshuffle = {shuffle}\n\
             [model]\nkind = \"fit_a_line\"\n[train]\nseed = {seed}\n",
            out.display(),
            csv.display()
        ))
        .unwrap();
        spec.resolve_paths(dir);
        prepare_data(&spec).unwrap();
        edl_trainer::load_records(&spec.data.train.patterns())
            .unwrap()
            .iter()
            .map(|r| format!("{:?}", edl_proto::sample::decode(r).unwrap().label))
            .collect()
    }

    #[test]
    fn shuffle_mixes_the_lines_the_same_way_for_a_seed() {
        let dir = tempfile::tempdir().unwrap();
        let plain = prepared_labels(dir.path(), false, 1);
        let a = prepared_labels(dir.path(), true, 1);
        let b = prepared_labels(dir.path(), true, 1);
        let c = prepared_labels(dir.path(), true, 2);
        assert_eq!(plain.len(), 40, "no test split: every line trains");
        assert_ne!(a, plain, "shuffled");
        assert_eq!(a, b, "the same seed, the same order");
        assert_ne!(a, c, "another seed, another order");
    }
}
