//! `edl-s3-server --root DIR [--listen 127.0.0.1:0] [--access-key K --secret-key S]`:
//! the S3 server edl's tests run, s3s-fs (a real implementation of the S3 protocol
//! over a directory: each bucket a folder of `DIR`, each object a file) on a loopback
//! port. It prints `listening on ADDR` once it accepts connections and serves until
//! it is killed. Path-style requests only (`http://ADDR/bucket/key`), as object_store
//! sends them with an endpoint set.

use std::path::PathBuf;

use anyhow::{Context, bail};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;

/// The command line.
#[derive(Debug, Default)]
struct Args {
    root: Option<PathBuf>,
    listen: Option<String>,
    access_key: Option<String>,
    secret_key: Option<String>,
}

fn parse(args: impl Iterator<Item = String>) -> anyhow::Result<Args> {
    let mut out = Args::default();
    let mut args = args;
    while let Some(flag) = args.next() {
        let mut value = || args.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--root" => out.root = Some(value()?.into()),
            "--listen" => out.listen = Some(value()?),
            "--access-key" => out.access_key = Some(value()?),
            "--secret-key" => out.secret_key = Some(value()?),
            other => bail!(
                "unknown argument {other:?} (usage: edl-s3-server --root DIR [--listen \
                 ADDR] [--access-key K --secret-key S])"
            ),
        }
    }
    if out.access_key.is_some() != out.secret_key.is_some() {
        bail!("--access-key and --secret-key go together");
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let args = parse(std::env::args().skip(1))?;
    let root = args.root.clone().context("--root DIR is required")?;
    std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(serve(args, root))
}

async fn serve(args: Args, root: PathBuf) -> anyhow::Result<()> {
    let fs = s3s_fs::FileSystem::new(&root).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let mut builder = S3ServiceBuilder::new(fs);
    if let (Some(ak), Some(sk)) = (args.access_key, args.secret_key) {
        builder.set_auth(SimpleAuth::from_single(ak, sk));
    }
    let service = builder.build();
    let listen = args.listen.unwrap_or_else(|| "127.0.0.1:0".to_owned());
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("bind {listen}"))?;
    println!("listening on {}", listener.local_addr()?);
    let http = ConnBuilder::new(TokioExecutor::new());
    loop {
        let (socket, _) = listener.accept().await?;
        let service = service.clone();
        let http = http.clone();
        tokio::spawn(async move {
            let _ = http.serve_connection(TokioIo::new(socket), service).await;
        });
    }
}
