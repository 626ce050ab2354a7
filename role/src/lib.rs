//! The process kit every edl role shares, whatever it runs: a master, a pserver, a
//! trainer (`edl trainer`, a program on the trainer API, the Python package), `edl
//! consume` and the operator's verbs. It sits beside `edl_coord`, below every role, so
//! that a master or a pserver links no trainer and a trainer no server.
//!
//! - [`connect`]: etcd, waiting out an outage at startup, with one error and its fix.
//! - [`shutdown_on_signals`]: a token cancelled on SIGTERM or SIGINT (a second exits).
//! - [`init_logging`]: stderr, filtered by `EDL_LOG` (a program's own subscriber wins).
//! - [`raise_open_files`]: the soft open-file limit raised to the hard one.
//! - [`runtime`]: a role's multi-threaded tokio runtime.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, EtcdBackend, EtcdConfig, retry_startup};
use tokio_util::sync::CancellationToken;

/// Why [`connect`] gave up: etcd refused, or stayed unreachable for the whole wait. The
/// message is whole (it names the endpoints and, for an unreachable etcd, the fix).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConnectError(String);

/// Connects to etcd, retrying while it cannot be reached for up to `wait`; `None` when
/// `cancel` fires first. An error that retrying cannot cure (bad credentials, a bad TLS
/// setup) fails at once; an etcd still unreachable after `wait` is one error with the fix.
pub async fn connect(
    cfg: &EtcdConfig,
    wait: Duration,
    cancel: &CancellationToken,
) -> Result<Option<Arc<dyn Backend>>, ConnectError> {
    match retry_startup("connect to etcd", wait, cancel, || {
        EtcdBackend::connect(cfg.clone())
    })
    .await
    {
        Ok(backend) => Ok(Some(Arc::new(backend))),
        Err(edl_coord::Error::Cancelled) => Ok(None),
        Err(e) if e.is_retryable() => Err(ConnectError(format!(
            "{e} (tried for {}; is etcd running there? pass its client URLs with --etcd or \
             EDL_ETCD, or wait longer with --etcd-wait or EDL_ETCD_WAIT)",
            humantime::format_duration(wait)
        ))),
        Err(e) => Err(ConnectError(format!("etcd: {e}"))),
    }
}

/// A token cancelled on SIGTERM or SIGINT (Ctrl-C); a second signal exits at once.
/// Call on a tokio runtime.
pub fn shutdown_on_signals() -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let t = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        t.cancel();
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::warn!("second signal: exiting now");
        std::process::exit(130);
    });
    Ok(token)
}

/// Logs to stderr (the filter in `EDL_LOG`, as for every edl process, else `RUST_LOG`,
/// else `info`), unless the program set up its own subscriber.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env(edl_job::env::LOG)
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::env::var_os("NO_COLOR").is_none())
        .try_init();
}

/// Raises this process's soft limit on open files to its hard limit, and returns the
/// soft limit now in force (`u64::MAX`: unlimited, or unknown). A master or pserver of
/// a thousand trainers holds a few thousand connections, over the soft limit of 1,024
/// that many systems start processes with; the hard limit is what an administrator
/// allows.
pub fn raise_open_files() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return u64::MAX;
    };
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return hard;
    }
    soft
}

/// A role's multi-threaded tokio runtime.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}
