//! `edl data put LOCAL... URL` and `edl data ls URL`: moving a dataset to where jobs read
//! it, as `paddlecloud file put/ls` did, through the one storage abstraction
//! (`edl_storage`): a local folder, or an object store (`s3://`, `gs://`, `az://`).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Args;
use edl_storage::Location;

/// Arguments of `edl data put`.
#[derive(Debug, Args)]
pub struct PutArgs {
    /// Local files (a folder's files, not its subfolders), then where they go: a folder
    /// URL (`s3://bucket/mnist/`) or path; each file keeps its name under it.
    #[arg(required = true, num_args = 2..)]
    pub paths: Vec<PathBuf>,
}

/// Arguments of `edl data ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// A folder URL or path, or a glob (`s3://bucket/mnist/train-*.recordio`).
    pub url: String,
}

/// Uploads each file to the destination, one object per file, saying each as it goes.
pub fn put(args: &PutArgs) -> anyhow::Result<()> {
    let (dest, sources) = args
        .paths
        .split_last()
        .context("give the local files, then where they go")?;
    let mut files = Vec::new();
    for s in sources {
        files.extend(files_of(s)?);
    }
    if files.is_empty() {
        bail!("no files to put");
    }
    upload(&files, &dest.display().to_string())
}

/// Uploads each of `files` under `dest` (a folder URL or path), one object per file
/// keeping its name, saying each as it goes.
pub(super) fn upload(files: &[PathBuf], dest: &str) -> anyhow::Result<()> {
    let dest = Location::parse(dest)?;
    let (store, key) = dest.open()?;
    runtime()?.block_on(async {
        for file in files {
            let name = file
                .file_name()
                .and_then(|n| n.to_str())
                .with_context(|| format!("{}: not a file name", file.display()))?;
            let bytes = tokio::fs::read(file)
                .await
                .with_context(|| format!("read {}", file.display()))?;
            let len = bytes.len();
            let target = if key.is_empty() {
                name.to_owned()
            } else {
                format!("{}/{name}", key.trim_end_matches('/'))
            };
            store.put(&target, Bytes::from(bytes)).await?;
            println!("{} -> {} ({len} bytes)", file.display(), store.url(&target));
        }
        anyhow::Ok(())
    })
}

/// The files a source names: the file, or a folder's files (sorted).
fn files_of(source: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let meta =
        std::fs::metadata(source).with_context(|| format!("{}: cannot read", source.display()))?;
    if meta.is_file() {
        return Ok(vec![source.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(source).with_context(|| format!("list {}", source.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

/// Lists the objects under a folder URL (or matching a glob): size and URL, a line each.
pub fn ls(args: &LsArgs) -> anyhow::Result<()> {
    let location = Location::parse(&args.url)?;
    let (store, key) = location.open()?;
    let found = runtime()?.block_on(async {
        if key.contains(['*', '?', '[']) {
            store.glob(&key).await
        } else {
            store.list(&key).await
        }
    })?;
    for o in &found {
        println!("{:>12}  {}", o.size, o.url);
    }
    if found.is_empty() {
        eprintln!("{}: nothing there", location.url());
    }
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the I/O runtime")
}
