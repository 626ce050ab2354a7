//! `edl data convert` and `edl data split`: write sharded RecordIO files.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use edl_proto::sample::{self, Sample};
use edl_recordio::{FileWriter, WriterOptions};
use indicatif::{ProgressBar, ProgressStyle};

use super::{ConvertArgs, InputFormat, LabelKind, OutputArgs, SplitArgs, expand};

/// Inputs larger than this (in bytes, all together) get a progress bar.
const PROGRESS_THRESHOLD: u64 = 8 << 20;

/// The vocabulary symbols added to every text corpus.
const BOS: &str = "<s>";
const EOS: &str = "<e>";
const UNK: &str = "<unk>";

/// Round-robin writer over N shard files; the shards appear under their final names only
/// when every one of them is complete (dropping it on an error leaves nothing behind).
struct ShardSet {
    writers: Vec<FileWriter>,
    paths: Vec<PathBuf>,
    next: usize,
    records: u64,
}

impl ShardSet {
    fn create(out: &OutputArgs, opts: WriterOptions) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&out.out)
            .with_context(|| format!("create output directory {}", out.out.display()))?;
        let mut writers = Vec::new();
        let mut paths = Vec::new();
        for i in 0..out.shards {
            let path = out.shard_path(i);
            let w = FileWriter::create(&path, opts.clone())
                .with_context(|| format!("create shard {}", path.display()))?;
            writers.push(w);
            paths.push(path);
        }
        Ok(ShardSet {
            writers,
            paths,
            next: 0,
            records: 0,
        })
    }

    fn write(&mut self, record: &[u8]) -> anyhow::Result<()> {
        let i = self.next;
        self.writers[i]
            .write(record)
            .with_context(|| format!("write shard {}", self.paths[i].display()))?;
        self.next = (i + 1) % self.writers.len();
        self.records += 1;
        Ok(())
    }

    /// Completes every shard; returns the line that says what was written.
    fn finish(self) -> anyhow::Result<String> {
        let mut chunks = 0;
        let mut bytes = 0;
        for (w, path) in self.writers.into_iter().zip(&self.paths) {
            let stats = w
                .finish()
                .with_context(|| format!("finish shard {}", path.display()))?;
            chunks += stats.chunks;
            bytes += stats.file_bytes;
        }
        Ok(format!(
            "wrote {} records in {} chunks ({} bytes) to {} shard(s): {}{}",
            self.records,
            chunks,
            bytes,
            self.paths.len(),
            self.paths
                .first()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            if self.paths.len() > 1 { " ..." } else { "" },
        ))
    }
}

/// Counts bytes read, to drive the progress bar.
struct Counting<R> {
    inner: R,
    bar: ProgressBar,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bar.inc(n as u64);
        Ok(n)
    }
}

fn progress_bar(inputs: &[PathBuf]) -> ProgressBar {
    let total: u64 = inputs
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    if total < PROGRESS_THRESHOLD {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Opens an input, transparently decompressing gzip (detected by its magic bytes).
fn open_input(path: &Path, bar: &ProgressBar) -> anyhow::Result<Box<dyn BufRead>> {
    let mut file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut magic = [0u8; 2];
    let n =
        read_prefix(&mut file, &mut magic).with_context(|| format!("read {}", path.display()))?;
    let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    let counted = Counting {
        inner: file,
        bar: bar.clone(),
    };
    if n == 2 && magic == [0x1f, 0x8b] {
        Ok(Box::new(BufReader::with_capacity(
            1 << 16,
            flate2::read::MultiGzDecoder::new(BufReader::new(counted)),
        )))
    } else {
        Ok(Box::new(BufReader::with_capacity(1 << 16, counted)))
    }
}

fn read_prefix(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Iterates the lines of an input with 1-based line numbers and errors naming the file.
fn for_each_line(
    path: &Path,
    bar: &ProgressBar,
    mut f: impl FnMut(u64, &str) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut reader = open_input(path, bar)?;
    let mut line = String::new();
    let mut lineno = 0u64;
    loop {
        line.clear();
        let n = reader
            .read_line(&mut line)
            .with_context(|| format!("{}:{}: read failed", path.display(), lineno + 1))?;
        if n == 0 {
            return Ok(());
        }
        lineno += 1;
        f(lineno, line.trim_end_matches(['\n', '\r']))?;
    }
}

/// Runs `edl data convert`; returns the lines that say what was written (`edl data
/// convert` prints them; `edl run` converts in process, quietly).
pub fn convert(args: &ConvertArgs) -> anyhow::Result<Vec<String>> {
    let opts = args.output.writer_options()?;
    for input in &args.inputs {
        let meta =
            std::fs::metadata(input).with_context(|| format!("input {}", input.display()))?;
        if !meta.is_file() {
            bail!("input {} is not a file", input.display());
        }
    }
    let bar = progress_bar(&args.inputs);
    let written = match args.format {
        InputFormat::Csv | InputFormat::MnistCsv => convert_csv(args, opts, &bar)?,
        InputFormat::Text => convert_text(args, opts, &bar)?,
        InputFormat::Multislot => convert_multislot(args, opts, &bar)?,
    };
    bar.finish_and_clear();
    Ok(written)
}

/// How one CSV row becomes a sample.
#[derive(Debug, Clone, Copy)]
struct CsvLayout {
    /// Expected column count, fixed by the first row (or by the format).
    columns: Option<usize>,
    label_column: i64,
    label: LabelKind,
    /// Multiply features by this (1/255 for MNIST pixels).
    scale: f32,
}

impl CsvLayout {
    fn sample(&mut self, fields: &[f32], path: &Path, lineno: u64) -> anyhow::Result<Sample> {
        let n = fields.len();
        match self.columns {
            Some(expected) if expected != n => bail!(
                "{}:{lineno}: expected {expected} columns, found {n}",
                path.display()
            ),
            Some(_) => {}
            None => self.columns = Some(n),
        }
        if self.label == LabelKind::None {
            let dense = fields.iter().map(|v| v * self.scale).collect();
            return Ok(Sample {
                version: sample::SAMPLE_VERSION,
                dense,
                ..Default::default()
            });
        }
        let idx = if self.label_column < 0 {
            n as i64 + self.label_column
        } else {
            self.label_column
        };
        if idx < 0 || idx as usize >= n || n < 2 {
            bail!(
                "{}:{lineno}: label column {} is out of range for a row of {n} columns",
                path.display(),
                self.label_column
            );
        }
        let idx = idx as usize;
        let dense: Vec<f32> = fields
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != idx)
            .map(|(_, v)| v * self.scale)
            .collect();
        let y = fields[idx];
        if self.label == LabelKind::Value {
            return Ok(Sample::regression(dense, y));
        }
        if !(y >= 0.0 && y.fract() == 0.0 && y <= u32::MAX as f32) {
            bail!(
                "{}:{lineno}: class label {y} in column {} is not a non-negative integer",
                path.display(),
                idx + 1
            );
        }
        Ok(Sample::classification(dense, y as u32))
    }
}

fn convert_csv(
    args: &ConvertArgs,
    opts: WriterOptions,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<String>> {
    let mut layout = match args.format {
        InputFormat::MnistCsv => CsvLayout {
            columns: Some(785),
            label_column: -1,
            label: LabelKind::Class,
            scale: 1.0 / 255.0,
        },
        _ => CsvLayout {
            columns: None,
            label_column: args.label_column,
            label: args.label,
            scale: 1.0,
        },
    };
    let mut shards = ShardSet::create(&args.output, opts)?;
    let mut fields: Vec<f32> = Vec::new();
    let mut buf = Vec::new();
    for input in &args.inputs {
        bar.set_message(input.display().to_string());
        for_each_line(input, bar, |lineno, line| {
            if lineno == 1 && args.header {
                return Ok(());
            }
            if line.trim().is_empty() {
                return Ok(());
            }
            fields.clear();
            for (col, field) in line.split(args.delimiter).enumerate() {
                let field = field.trim();
                let v: f32 = field.parse().map_err(|_| {
                    anyhow::anyhow!(
                        "{}:{lineno}: column {}: {field:?} is not a number",
                        input.display(),
                        col + 1
                    )
                })?;
                if !v.is_finite() {
                    bail!(
                        "{}:{lineno}: column {}: {field:?} is not a finite number",
                        input.display(),
                        col + 1
                    );
                }
                fields.push(v);
            }
            let s = layout.sample(&fields, input, lineno)?;
            buf.clear();
            prost::Message::encode(&s, &mut buf).context("encode sample")?;
            shards.write(&buf)
        })?;
    }
    Ok(vec![shards.finish()?])
}

fn convert_multislot(
    args: &ConvertArgs,
    opts: WriterOptions,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<String>> {
    let slots = super::multislot::parse_slots(&args.slots)?;
    let mut shards = ShardSet::create(&args.output, opts)?;
    let mut buf = Vec::new();
    for input in &args.inputs {
        bar.set_message(input.display().to_string());
        for_each_line(input, bar, |lineno, line| {
            if line.trim().is_empty() {
                return Ok(());
            }
            let s = super::multislot::sample(line, &slots, args.label)
                .with_context(|| format!("{}:{lineno}", input.display()))?;
            buf.clear();
            prost::Message::encode(&s, &mut buf).context("encode sample")?;
            shards.write(&buf)
        })?;
    }
    Ok(vec![shards.finish()?])
}

/// A word vocabulary: id = position.
struct Vocab {
    ids: HashMap<String, u64>,
    words: Vec<String>,
}

impl Vocab {
    fn unk(&self) -> u64 {
        self.ids.get(UNK).copied().unwrap_or(0)
    }

    /// PaddlePaddle imikolov's dictionary: words (with `<s>` and `<e>`) seen at least
    /// `min_freq` times, most frequent first (ties by word), then `<unk>`.
    fn build(inputs: &[PathBuf], min_freq: u64, bar: &ProgressBar) -> anyhow::Result<Vocab> {
        let mut freq: HashMap<String, u64> = HashMap::new();
        for input in inputs {
            for_each_line(input, bar, |_, line| {
                if line.trim().is_empty() {
                    return Ok(());
                }
                for w in line.split_whitespace().chain([BOS, EOS]) {
                    *freq.entry(w.to_owned()).or_default() += 1;
                }
                Ok(())
            })?;
        }
        let mut kept: Vec<(String, u64)> = freq
            .into_iter()
            .filter(|(w, f)| *f >= min_freq && w != UNK)
            .collect();
        kept.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let mut words: Vec<String> = kept.into_iter().map(|(w, _)| w).collect();
        words.push(UNK.to_owned());
        Ok(Self::from_words(words))
    }

    fn from_words(words: Vec<String>) -> Vocab {
        let ids = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.clone(), i as u64))
            .collect();
        Vocab { ids, words }
    }

    fn load(path: &Path) -> anyhow::Result<Vocab> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("read vocabulary {}", path.display()))?;
        let words: Vec<String> = text.lines().map(str::to_owned).collect();
        for w in [BOS, EOS, UNK] {
            if !words.iter().any(|x| x == w) {
                bail!("vocabulary {} has no {w} entry", path.display());
            }
        }
        Ok(Self::from_words(words))
    }

    fn save(&self, path: &Path) -> anyhow::Result<()> {
        let tmp = path.with_extension("vocab.tmp");
        let write = || -> std::io::Result<()> {
            let mut f = BufWriter::new(File::create(&tmp)?);
            for w in &self.words {
                writeln!(f, "{w}")?;
            }
            f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        write().with_context(|| format!("write vocabulary {}", path.display()))
    }
}

fn convert_text(
    args: &ConvertArgs,
    opts: WriterOptions,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<String>> {
    let mut written = Vec::new();
    let vocab = match &args.vocab {
        Some(path) => Vocab::load(path)?,
        None => {
            let v = Vocab::build(&args.inputs, args.min_word_freq, &ProgressBar::hidden())?;
            std::fs::create_dir_all(&args.output.out).with_context(|| {
                format!("create output directory {}", args.output.out.display())
            })?;
            let path = args
                .output
                .out
                .join(format!("{}.vocab", args.output.prefix));
            v.save(&path)?;
            written.push(format!(
                "vocabulary of {} words written to {}",
                v.words.len(),
                path.display()
            ));
            v
        }
    };
    let (bos, eos, unk) = (vocab.ids[BOS], vocab.ids[EOS], vocab.unk());
    let mut shards = ShardSet::create(&args.output, opts)?;
    let mut buf = Vec::new();
    for input in &args.inputs {
        bar.set_message(input.display().to_string());
        for_each_line(input, bar, |_, line| {
            if line.trim().is_empty() {
                return Ok(());
            }
            let mut ids = vec![bos];
            ids.extend(
                line.split_whitespace()
                    .map(|w| vocab.ids.get(w).copied().unwrap_or(unk)),
            );
            ids.push(eos);
            buf.clear();
            prost::Message::encode(&Sample::sparse(ids), &mut buf).context("encode sample")?;
            shards.write(&buf)
        })?;
    }
    written.push(shards.finish()?);
    Ok(written)
}

/// Runs `edl data split`: re-shards existing RecordIO files, records passed through as is.
pub fn split(args: &SplitArgs) -> anyhow::Result<()> {
    let opts = args.output.writer_options()?;
    let inputs = expand(&args.paths)?;
    let out_paths: Vec<PathBuf> = (0..args.output.shards)
        .map(|i| args.output.shard_path(i))
        .collect();
    for input in &inputs {
        let canon = std::fs::canonicalize(input).ok();
        if out_paths.iter().any(|o| {
            std::fs::canonicalize(o)
                .ok()
                .is_some_and(|c| Some(c) == canon)
        }) {
            bail!(
                "input {} would be overwritten by an output shard; choose another --prefix or --out",
                input.display()
            );
        }
    }
    let bar = progress_bar(&inputs);
    let mut scanner = super::scanner(inputs, false);
    let mut shards = ShardSet::create(&args.output, opts)?;
    let mut last = 0;
    while let Some(record) = scanner.next_record()? {
        shards.write(record)?;
        let read = scanner.stats().compressed_bytes;
        bar.inc(read.saturating_sub(last));
        last = read;
    }
    bar.finish_and_clear();
    println!("{}", shards.finish()?);
    Ok(())
}
