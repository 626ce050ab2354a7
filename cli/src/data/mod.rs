//! `edl data`: tools for RecordIO datasets.
//!
//! - `convert`: CSV, MNIST CSV or text into sharded RecordIO files of encoded samples.
//! - `stat`: files, chunks, records, bytes and compression ratio.
//! - `verify`: checks every chunk; non-zero exit naming each bad file and offset.
//! - `cat`: prints records, raw or decoded.
//! - `split`: re-shards RecordIO files.
//! - `put`, `ls`: upload files to a folder or object store URL, list one.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use edl_recordio::{Compressor, DEFAULT_MAX_CHUNK_BYTES, WriterOptions};

mod convert;
mod inspect;
mod multislot;
mod objects;
mod size;

pub use convert::convert;
pub use size::parse_size;

/// The `edl data` subcommands.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Convert CSV, MNIST CSV or text files into sharded RecordIO files of samples.
    Convert(ConvertArgs),
    /// Print files, chunks, records, bytes and compression ratio of RecordIO files.
    Stat(StatArgs),
    /// Check every chunk of RecordIO files; exits non-zero naming each bad file.
    Verify(PathsArgs),
    /// Print the records of RecordIO files (raw bytes, or decoded samples).
    Cat(CatArgs),
    /// Re-shard RecordIO files into N shards.
    Split(SplitArgs),
    /// Upload local files to a folder or object store URL (`s3://bucket/mnist/`), one
    /// object per file; credentials from the environment (AWS_ACCESS_KEY_ID, ...).
    Put(objects::PutArgs),
    /// List the objects under a folder or object store URL, or matching a glob.
    Ls(objects::LsArgs),
}

/// Input formats of `edl data convert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InputFormat {
    /// Numeric CSV; the label column is the last one unless `--label-column` says otherwise.
    Csv,
    /// MNIST as CSV: 784 pixel values (0-255) then the digit label; pixels are scaled to
    /// [0, 1].
    MnistCsv,
    /// Plain text, one sentence a line, tokenised on whitespace into word ids (word2vec).
    Text,
    /// PaddlePaddle's MultiSlot text, one sample a line, each slot `n v1 .. vn`; what
    /// each slot is comes from `--slots` (e.g. `dense,sparse*26,label`).
    Multislot,
}

/// How `convert --format csv` stores the label column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LabelKind {
    /// A real-valued target (regression).
    Value,
    /// A class index, a non-negative integer (classification).
    Class,
    /// No label: every column is a feature.
    None,
}

/// Output options shared by `convert` and `split`.
#[derive(Debug, Args)]
pub struct OutputArgs {
    /// Number of output shards.
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// Name prefix of the shards: PREFIX-00000-of-0000N.recordio.
    #[arg(long)]
    pub prefix: String,
    /// Output directory (created if missing), or an object URL (`s3://bucket/prefix/`):
    /// the shards are written locally, then uploaded.
    #[arg(long)]
    pub out: PathBuf,
    /// Chunk compressor.
    #[arg(long, default_value = "snappy")]
    pub compressor: Compressor,
    /// Uncompressed bytes per chunk (e.g. 65536, 64KiB, 1MiB); a chunk is the unit a task
    /// is made of, so smaller chunks give finer-grained tasks.
    #[arg(long, value_parser = parse_size, default_value_t = DEFAULT_MAX_CHUNK_BYTES as u64)]
    pub chunk_size: u64,
}

impl OutputArgs {
    fn writer_options(&self) -> anyhow::Result<WriterOptions> {
        if self.shards == 0 {
            bail!("--shards must be at least 1");
        }
        if self.prefix.is_empty() || self.prefix.contains('/') {
            bail!("--prefix must be a non-empty file name prefix without '/'");
        }
        let max_chunk_bytes = usize::try_from(self.chunk_size)
            .ok()
            .filter(|&n| n > 0)
            .context("--chunk-size must be between 1 byte and the address space")?;
        Ok(WriterOptions {
            max_chunk_bytes,
            compressor: self.compressor,
        })
    }

    /// The path of shard `i`.
    pub fn shard_path(&self, i: u32) -> PathBuf {
        self.out.join(shard_name(&self.prefix, i, self.shards))
    }
}

/// `PREFIX-0000i-of-0000n.recordio`, PaddlePaddle's shard naming.
pub fn shard_name(prefix: &str, i: u32, n: u32) -> String {
    format!("{prefix}-{i:05}-of-{n:05}.recordio")
}

/// Arguments of `edl data convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// Input format.
    #[arg(long, value_enum)]
    pub format: InputFormat,
    /// Column index of the label for `--format csv` (0-based; negative counts from the end).
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub label_column: i64,
    /// How the label is stored for `--format csv`.
    #[arg(long, value_enum, default_value_t = LabelKind::Value)]
    pub label: LabelKind,
    /// Field delimiter for CSV input.
    #[arg(long, default_value_t = ',')]
    pub delimiter: char,
    /// Skip the first line of each CSV input (a header row).
    #[arg(long)]
    pub header: bool,
    /// For `--format multislot`: what each slot is, in order, comma-separated: `dense`
    /// (features), `sparse` (ids), `label` (one value, see `--label`), `skip`;
    /// `kind*N` repeats a kind (e.g. `dense,sparse*26,label`).
    #[arg(long, default_value = "")]
    pub slots: String,
    /// For `--format text`: words seen fewer times are mapped to `<unk>`.
    #[arg(long, default_value_t = 1)]
    pub min_word_freq: u64,
    /// For `--format text`: use this vocabulary (one word a line, id = line number)
    /// instead of building one; a converted test split should use its training split's.
    #[arg(long)]
    pub vocab: Option<PathBuf>,
    /// Output options.
    #[command(flatten)]
    pub output: OutputArgs,
    /// Input files (gzip-compressed inputs are detected and decompressed).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
}

/// Arguments of `edl data stat`.
#[derive(Debug, Args)]
pub struct StatArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// RecordIO files or glob patterns (paths or object URLs such as
    /// `s3://bucket/mnist/train-*.recordio`).
    #[arg(required = true)]
    pub paths: Vec<String>,
}

/// Paths or globs of RecordIO files.
#[derive(Debug, Args)]
pub struct PathsArgs {
    /// RecordIO files or glob patterns (paths or object URLs such as
    /// `s3://bucket/mnist/train-*.recordio`).
    #[arg(required = true)]
    pub paths: Vec<String>,
}

/// Arguments of `edl data cat`.
#[derive(Debug, Args)]
pub struct CatArgs {
    /// Decode each record as a sample and print it as one JSON object a line.
    #[arg(long)]
    pub decode: bool,
    /// Stop after this many records.
    #[arg(long)]
    pub limit: Option<u64>,
    /// RecordIO files or glob patterns (paths or object URLs such as
    /// `s3://bucket/mnist/train-*.recordio`).
    #[arg(required = true)]
    pub paths: Vec<String>,
}

/// Arguments of `edl data split`.
#[derive(Debug, Args)]
pub struct SplitArgs {
    /// Output options.
    #[command(flatten)]
    pub output: OutputArgs,
    /// RecordIO files or glob patterns to re-shard (paths or object URLs).
    #[arg(required = true)]
    pub paths: Vec<String>,
}

/// Runs an `edl data` subcommand.
pub fn run(cmd: DataCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        DataCommand::Convert(mut args) => {
            let staged = Staged::output(&mut args.output)?;
            for line in convert::convert(&args)? {
                println!("{line}");
            }
            staged.upload(&args.output)?;
            Ok(ExitCode::SUCCESS)
        }
        DataCommand::Split(mut args) => {
            let staged = Staged::output(&mut args.output)?;
            convert::split(&args)?;
            staged.upload(&args.output)?;
            Ok(ExitCode::SUCCESS)
        }
        DataCommand::Stat(args) => inspect::stat(&args).map(|()| ExitCode::SUCCESS),
        DataCommand::Verify(args) => inspect::verify(&args),
        DataCommand::Cat(args) => inspect::cat(&args).map(|()| ExitCode::SUCCESS),
        DataCommand::Put(args) => objects::put(&args).map(|()| ExitCode::SUCCESS),
        DataCommand::Ls(args) => objects::ls(&args).map(|()| ExitCode::SUCCESS),
    }
}

/// Expands globs (paths or object URLs) into the files and objects they match, each
/// pattern's sorted, with a clear error when one matches nothing. An object is named by
/// its URL.
fn expand(patterns: &[String]) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in patterns {
        let one = std::slice::from_ref(p);
        if edl_storage::blocking::is_object_url(p) {
            let objects = edl_storage::blocking::expand(one)?;
            out.extend(objects.into_iter().map(|o| PathBuf::from(o.url)));
        } else {
            out.extend(edl_recordio::expand_globs(one)?);
        }
    }
    Ok(out)
}

/// Output shards bound for an object URL (`--out s3://...`): written to a local
/// temporary folder first (a shard appears whole or not at all, as locally), then
/// uploaded, one object per shard.
struct Staged {
    /// The temporary folder and the URL, when `--out` is a URL.
    at: Option<(tempfile::TempDir, String)>,
}

impl Staged {
    /// Points `output` at a temporary folder if it names an object URL.
    fn output(output: &mut OutputArgs) -> anyhow::Result<Staged> {
        let url = output.out.display().to_string();
        if !edl_storage::blocking::is_object_url(&url) {
            return Ok(Staged { at: None });
        }
        // A bad URL or missing credentials are said before anything is converted.
        edl_storage::blocking::BlockingStore::open(&url)?;
        let dir = tempfile::tempdir().context("a temporary folder for the shards")?;
        output.out = dir.path().to_path_buf();
        Ok(Staged {
            at: Some((dir, url)),
        })
    }

    /// Uploads the shards `output` names to the URL.
    fn upload(self, output: &OutputArgs) -> anyhow::Result<()> {
        let Some((_dir, url)) = self.at else {
            return Ok(());
        };
        let shards: Vec<PathBuf> = (0..output.shards).map(|i| output.shard_path(i)).collect();
        objects::upload(&shards, &url)
    }
}

/// Bytes read from an object store at a time by a sequential scan.
const OBJECT_BLOCK: u64 = 8 << 20;

/// Opens a file, or an object named by its URL (read with ranged requests of
/// [`OBJECT_BLOCK`]).
fn open_source(name: &std::path::Path) -> edl_recordio::Result<Box<dyn edl_recordio::Source>> {
    let text = name.to_string_lossy();
    if !edl_storage::blocking::is_object_url(&text) {
        let file = std::fs::File::open(name).map_err(|e| edl_recordio::Error::io(name, e))?;
        return Ok(Box::new(std::io::BufReader::with_capacity(64 << 10, file)));
    }
    let object = edl_storage::blocking::ObjectReader::open(&text)
        .map_err(|e| edl_recordio::Error::io(name, std::io::Error::other(e)))?;
    Ok(Box::new(object.with_block_size(OBJECT_BLOCK)))
}

/// A scanner over files and objects, in order.
fn scanner(names: Vec<PathBuf>, lenient: bool) -> edl_recordio::Scanner {
    edl_recordio::Scanner::open_with(names, edl_recordio::ReadOptions { lenient }, open_source)
}

/// The chunk index of a file or object.
fn chunk_index(name: &std::path::Path) -> edl_recordio::Result<edl_recordio::ChunkIndex> {
    let source = open_source(name)?;
    edl_recordio::ChunkIndex::from_reader(source, name.to_path_buf())
}
