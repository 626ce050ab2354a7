//! Test support for the edl workspace: real etcd clusters with fault injection,
//! child processes, a fault-injecting backend, deadlines, and common fixtures. A
//! dev-dependency only: nothing here is compiled into a production crate.
//!
//! # Layout
//!
//! - [`etcd`]: [`EtcdCluster`], a [`LocalEtcd`](edl_coord::local_etcd::LocalEtcd)
//!   (real `etcd` processes on free loopback ports) with `restart`, `pause`, `resume`
//!   and finding the raft leader.
//! - [`child`]: [`ChildProcess`] runs a role of the *current* test binary as a child
//!   process (the binary re-executes itself with [`CHILD_ROLE_ENV`] set), so a test
//!   can SIGKILL or SIGSTOP "a process holding a lease"; [`signal`] for any process.
//! - [`faulty`]: [`FaultyBackend`] wraps a [`Backend`] and injects outages, watch
//!   disconnects and chosen errors (non-retryable ones too), for either backend, and
//!   counts requests (to check that loops back off).
//! - [`kube_api`]: [`FakeApi`](kube_api::FakeApi), a fake Kubernetes API server on
//!   loopback (list/watch with resourceVersions and 410 Gone, status and scale
//!   subresources, optimistic concurrency, finalizers, owner references) for the
//!   operator's tests; [`kubelet`]: [`Kubelet`](kubelet::Kubelet) runs its pods as real
//!   processes.
//! - [`proxy`]: [`Proxy`](proxy::Proxy), a TCP proxy on loopback that partitions (holds
//!   every byte) and heals, to cut one process off from one address.
//! - [`s3`]: [`S3Server`](s3::S3Server), a real S3 server (`edl-s3-server`, s3s-fs
//!   over a directory) on a loopback port, restartable on its data.
//! - [`free_port`]: a loopback port outside the ephemeral range, for a process told its
//!   port (and restarted on it).
//! - [`wait_until`]: polls a condition until a deadline.
//! - [`register_trainer`]: registers a trainer under a job's `trainers/` with its own
//!   lease, as trainers do.
//!
//! The `etcd` binary is found through `EDL_ETCD_BIN`, else on `PATH`
//! ([`etcd_binary`](edl_coord::local_etcd::etcd_binary)).

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use edl_coord::{Backend, Lease, Registry};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub mod child;
pub mod etcd;
pub mod faulty;
pub mod kube_api;
pub mod kubelet;
pub mod ports;
pub mod proxy;
pub mod s3;

pub use child::{CHILD_ROLE_ENV, ChildProcess, child_role, signal};
pub use etcd::EtcdCluster;
pub use faulty::{ErrorFn, FaultyBackend, WATCH_STREAM};
pub use nix::sys::signal::Signal;
pub use ports::free_port;

/// Polls `cond` every `every` until it returns true (then `true`) or `within` has
/// passed (then `false`). Works on paused and real clocks alike.
pub async fn wait_until<F, Fut>(within: Duration, every: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(every.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
}

/// Registers trainer `id` under `trainers_prefix` (a job's `/edl/<job>/trainers/`)
/// with a lease of `ttl` kept alive until `cancel`, as a trainer does (the master
/// and the pservers count registered trainers). Panics on failure (a test fixture).
pub async fn register_trainer(
    backend: &Arc<dyn Backend>,
    trainers_prefix: impl Into<String>,
    id: &str,
    ttl: Duration,
    cancel: CancellationToken,
) -> Lease {
    let lease = Lease::grant(backend.clone(), ttl, cancel)
        .await
        .expect("grant a trainer lease");
    Registry::new(backend.clone(), trainers_prefix)
        .register(id, b"test trainer".to_vec(), &lease)
        .await
        .expect("register the trainer");
    lease
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Writes values of `size` bytes until `backend` refuses one for lack of space
/// ([`edl_coord::Error::NoSpace`]): at distinct keys under `prefix` (live data), or all at
/// `prefix` (older versions, which compaction frees); how many fit. Panics on any other
/// error, or when 1000 values fit (the store has no quota that small).
pub async fn fill_until_full(
    backend: &std::sync::Arc<dyn edl_coord::Backend>,
    prefix: &str,
    size: usize,
    distinct: bool,
) -> usize {
    for n in 0..1000 {
        let key = if distinct {
            format!("{prefix}{n}")
        } else {
            prefix.to_owned()
        };
        match backend.put(&key, vec![n as u8; size], None).await {
            Ok(_) => {}
            Err(e) if e.is_no_space() => return n,
            Err(e) => panic!("filling the store: {e}"),
        }
    }
    panic!("1000 values of {size} bytes and the store is not full: is its quota set?");
}

/// Bytes received and not yet read on the connections accepted at loopback `port` (the
/// kernel's receive queues, from `/proc/net/tcp` and `/proc/net/tcp6`): what a stopped
/// process has been sent.
pub fn unread_at(port: u16) -> u64 {
    let mut total = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            // sl local_address rem_address st tx_queue:rx_queue ...
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local = cols
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            let established = cols.get(3) == Some(&"01");
            let rx = cols
                .get(4)
                .and_then(|q| q.split(':').nth(1))
                .and_then(|h| u64::from_str_radix(h, 16).ok());
            if let (Some(p), true, Some(rx)) = (local, established, rx)
                && p == port
            {
                total += rx;
            }
        }
    }
    total
}
