//! `edl-s3-server --root DIR [--listen 127.0.0.1:0] [--access-key K --secret-key S]
//! [--faults FILE]`: the S3 server edl's tests run, s3s-fs (a real implementation of the
//! S3 protocol over a directory: each bucket a folder of `DIR`, each object a file) on a
//! loopback port. It prints `listening on ADDR` once it accepts connections and serves
//! until it is killed. Path-style requests only (`http://ADDR/bucket/key`), as
//! object_store sends them with an endpoint set.
//!
//! GET bodies are read in 1 MiB blocks (`store.rs`); the rest is s3s-fs's own.
//!
//! Fault injection in front of the store (`--faults FILE`, read at every request): while
//! `FILE` says `error`, every request is answered `503 SlowDown` (what S3 says when it
//! sheds load); while it says `stall`, requests are held unanswered, each until the file
//! says something else (then served). A missing or empty file serves normally. Each
//! request a fault met adds a line (`error` or `stall`) to `FILE.hits`.

mod store;

use std::path::{Path, PathBuf};
use std::time::Duration;

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
    faults: Option<PathBuf>,
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
            "--faults" => out.faults = Some(value()?.into()),
            other => bail!(
                "unknown argument {other:?} (usage: edl-s3-server --root DIR [--listen \
                 ADDR] [--access-key K --secret-key S] [--faults FILE])"
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
    let mut builder = S3ServiceBuilder::new(store::Store {
        fs,
        root: root.clone(),
    });
    if let (Some(ak), Some(sk)) = (args.access_key, args.secret_key) {
        builder.set_auth(SimpleAuth::from_single(ak, sk));
    }
    let service = Faulty {
        inner: builder.build(),
        faults: args.faults.map(Into::into),
    };
    let listen = args.listen.unwrap_or_else(|| "127.0.0.1:0".to_owned());
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("bind {listen}"))?;
    println!("listening on {}", listener.local_addr()?);
    let http = ConnBuilder::new(TokioExecutor::new());
    loop {
        let (socket, _) = listener.accept().await?;
        // The body goes out in small frames: without TCP_NODELAY, Nagle's algorithm
        // holds the last one until the client's delayed ACK (40 ms a request).
        socket.set_nodelay(true)?;
        let service = service.clone();
        let http = http.clone();
        tokio::spawn(async move {
            let _ = http.serve_connection(TokioIo::new(socket), service).await;
        });
    }
}

/// What `--faults FILE` asks for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Error,
    Stall,
}

fn fault(file: Option<&Path>) -> Fault {
    let Some(file) = file else {
        return Fault::None;
    };
    match std::fs::read_to_string(file).as_deref().map(str::trim) {
        Ok("error") => Fault::Error,
        Ok("stall") => Fault::Stall,
        _ => Fault::None,
    }
}

/// Adds a line to `FILE.hits` for a request that met `fault`.
fn record_hit(file: Option<&Path>, fault: Fault) {
    use std::io::Write;
    let Some(file) = file else { return };
    let mut hits = file.as_os_str().to_owned();
    hits.push(".hits");
    let line = if fault == Fault::Error {
        "error\n"
    } else {
        "stall\n"
    };
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(hits)
    {
        let _ = f.write_all(line.as_bytes());
    }
}

/// The S3 service behind the fault injection of `--faults`.
#[derive(Clone)]
struct Faulty {
    inner: s3s::service::S3Service,
    faults: Option<std::sync::Arc<Path>>,
}

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for Faulty {
    type Response = s3s::HttpResponse;
    type Error = s3s::HttpError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn call(&self, req: http::Request<hyper::body::Incoming>) -> Self::Future {
        let (inner, faults) = (self.inner.clone(), self.faults.clone());
        Box::pin(async move {
            let mut met = false;
            loop {
                let now = fault(faults.as_deref());
                if now != Fault::None && !met {
                    met = true;
                    record_hit(faults.as_deref(), now);
                }
                match now {
                    Fault::None => break,
                    Fault::Error => {
                        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>\
                                    SlowDown</Code><Message>injected fault</Message></Error>";
                        let mut resp = http::Response::new(s3s::Body::from(body.to_owned()));
                        *resp.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                        return Ok(resp);
                    }
                    // Held until the file says otherwise (the test that stalls the
                    // server ends the stall; a dropped connection drops this future).
                    Fault::Stall => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
            hyper::service::Service::call(&inner, req).await
        })
    }
}
