//! Push + pull throughput of a 10M-float dense model (40 MB) with 2 pserver shards and 2
//! trainer clients on loopback gRPC, next to raw TCP loopback moving the same bytes in the
//! same pattern (each trainer sends its half-model to each of 2 sink servers, which send
//! it back), measured in the same run; then the optimizer update rate per core.
//!
//! Both client transports are measured: the bulk path (the default: plain TCP on the
//! pserver's port, floats outside protobuf) and gRPC.
//!
//! Run: `cargo bench -p edl-pserver --bench push_pull`
//! (`EDL_BENCH_FLOATS=N` sets the model size, `EDL_BENCH_ROUNDS=R` the rounds per
//! trainer, `EDL_BENCH_TRIES=T` the interleaved tries whose best is reported.)
//!
//! Coordination uses the in-memory backend (the data path does not touch etcd).

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, MemBackend};
use edl_pserver::{IndexChoice, PsConfig};
use edl_pserver_client::{
    DenseCache, DenseInit, Mode, Optimizer, OptimizerConfig, OptimizerKind, ParamConfig, PsClient,
    PsClientConfig,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const SHARDS: u32 = 2;
const TRAINERS: usize = 2;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Rate {
    bytes: f64,
    secs: f64,
}

impl Rate {
    fn gbps(&self) -> f64 {
        self.bytes / self.secs / 1e9
    }
}

/// `rounds` of push (whole model) + pull (whole model) by each of the trainers.
async fn ps_round_trips(floats: usize, rounds: usize, bulk: bool) -> (Rate, Rate, Rate) {
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
    let stop = CancellationToken::new();
    for i in 0..SHARDS {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let mut cfg = PsConfig::new(edl_job::JobName::new("bench").expect("a valid job name"));
        cfg.index = IndexChoice::Fixed(i);
        cfg.shards = Some(SHARDS);
        tokio::spawn(edl_pserver::run(
            backend.clone(),
            cfg,
            listener,
            stop.clone(),
        ));
    }
    let connect = || async {
        let mut cfg =
            PsClientConfig::new(edl_job::JobName::new("bench").expect("a valid job name"));
        cfg.bulk = bulk;
        PsClient::connect(backend.clone(), cfg, stop.child_token())
            .await
            .expect("client")
    };
    let init = connect().await;
    let w = vec![0.0f32; floats];
    init.init(
        "init",
        &[DenseInit {
            name: "w",
            shape: &[floats],
            values: &w,
        }],
        &[],
        ParamConfig::new(Mode::Async, OptimizerConfig::sgd(1e-6)),
    )
    .await
    .expect("init");
    let mut clients = Vec::new();
    for _ in 0..TRAINERS {
        let c = connect().await;
        let mut cache = DenseCache::new();
        c.pull_dense(&mut cache).await.expect("warm-up pull");
        clients.push((c, cache));
    }
    let bytes = (floats * 4) as f64;
    // Push + pull.
    let start = Instant::now();
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(t, (c, mut cache))| {
            tokio::spawn(async move {
                let g = vec![1.0f32; floats];
                for r in 0..rounds as u64 {
                    c.push(&format!("t{t}"), r + 1, &[("w", &g)], &[])
                        .await
                        .expect("push");
                    let s = c.pull_dense(&mut cache).await.expect("pull");
                    assert_eq!(s.bytes, floats * 4, "every block changed");
                }
                (c, cache)
            })
        })
        .collect();
    let mut clients = Vec::new();
    for t in tasks {
        clients.push(t.await.expect("trainer"));
    }
    let both = Rate {
        bytes: 2.0 * bytes * (TRAINERS * rounds) as f64,
        secs: start.elapsed().as_secs_f64(),
    };
    // Push only.
    let start = Instant::now();
    let tasks: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(t, (c, _))| {
            let c = c.clone();
            tokio::spawn(async move {
                let g = vec![1.0f32; floats];
                for r in 0..rounds as u64 {
                    c.push(&format!("t{t}"), 1000 + r, &[("w", &g)], &[])
                        .await
                        .expect("push");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("trainer");
    }
    let push = Rate {
        bytes: bytes * (TRAINERS * rounds) as f64,
        secs: start.elapsed().as_secs_f64(),
    };
    // Pull only: the whole model each time (the caches forget their versions).
    let start = Instant::now();
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|(c, mut cache)| {
            tokio::spawn(async move {
                for _ in 0..rounds {
                    cache.invalidate();
                    let s = c.pull_dense(&mut cache).await.expect("pull");
                    assert_eq!(s.bytes, floats * 4);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("trainer");
    }
    let pull = Rate {
        bytes: bytes * (TRAINERS * rounds) as f64,
        secs: start.elapsed().as_secs_f64(),
    };
    stop.cancel();
    (both, push, pull)
}

/// The same traffic over plain TCP: each trainer sends `bytes / SHARDS` to each of the
/// sink servers, which send as much back.
async fn tcp_round_trips(floats: usize, rounds: usize) -> Rate {
    let part = floats * 4 / SHARDS as usize;
    let mut addrs = Vec::new();
    for _ in 0..SHARDS {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        addrs.push(listener.local_addr().expect("addr"));
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                s.set_nodelay(true).ok();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; part];
                    loop {
                        if s.read_exact(&mut buf).await.is_err() {
                            return;
                        }
                        if s.write_all(&buf).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
    }
    let mut conns = Vec::new();
    for _ in 0..TRAINERS {
        let mut per = Vec::new();
        for a in &addrs {
            let s = TcpStream::connect(a).await.expect("connect");
            s.set_nodelay(true).ok();
            per.push(s);
        }
        conns.push(per);
    }
    let start = Instant::now();
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|per| {
            tokio::spawn(async move {
                let sends = per.into_iter().map(|mut s| async move {
                    let out = vec![1u8; part];
                    let mut back = vec![0u8; part];
                    for _ in 0..rounds {
                        s.write_all(&out).await.expect("write");
                        s.read_exact(&mut back).await.expect("read");
                    }
                });
                futures::future::join_all(sends).await;
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("trainer");
    }
    Rate {
        bytes: 2.0 * (floats * 4) as f64 * (TRAINERS * rounds) as f64,
        secs: start.elapsed().as_secs_f64(),
    }
}

/// Single-thread update rate of an optimizer over a slice of `n` floats.
fn update_rate(kind: OptimizerKind, n: usize) -> f64 {
    let o = Optimizer::new(OptimizerConfig {
        kind,
        ..OptimizerConfig::sgd(1e-3)
    })
    .expect("valid optimizer");
    let mut p = vec![0.5f32; n];
    let g = vec![0.01f32; n];
    let mut st = o.state(n);
    o.step(1e-3, &mut p, &g, 1.0, &mut st);
    let iters = 20;
    let start = std::time::Instant::now();
    for _ in 0..iters {
        o.step(1e-3, &mut p, &g, 1.0, &mut st);
    }
    std::hint::black_box(&p);
    (n * iters) as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let floats = env("EDL_BENCH_FLOATS", 10_000_000);
    let rounds = env("EDL_BENCH_ROUNDS", 10);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "pserver push+pull: {floats} floats ({:.0} MB), {SHARDS} shards, {TRAINERS} trainers, {rounds} rounds each, {cores} cores, loopback; best of {} interleaved tries",
        floats as f64 * 4.0 / 1e6,
        env("EDL_BENCH_TRIES", 3)
    );
    // Interleaved, best of `tries` for each path: the host may be shared.
    let tries = env("EDL_BENCH_TRIES", 3);
    let best = |a: Option<Rate>, b: Rate| match a {
        Some(a) if a.gbps() >= b.gbps() => Some(a),
        _ => Some(b),
    };
    let (mut tcp, mut bulk, mut grpc) = (None, None, None);
    let (mut bulk_push, mut bulk_pull, mut grpc_push, mut grpc_pull) = (None, None, None, None);
    rt.block_on(async {
        for _ in 0..tries {
            tcp = best(tcp.take(), tcp_round_trips(floats, rounds).await);
            let (b, bp, bl) = ps_round_trips(floats, rounds, true).await;
            bulk = best(bulk.take(), b);
            bulk_push = best(bulk_push.take(), bp);
            bulk_pull = best(bulk_pull.take(), bl);
            let (g, gp, gl) = ps_round_trips(floats, rounds, false).await;
            grpc = best(grpc.take(), g);
            grpc_push = best(grpc_push.take(), gp);
            grpc_pull = best(grpc_pull.take(), gl);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let none = || Rate {
        bytes: 0.0,
        secs: 1.0,
    };
    let tcp_best = tcp.unwrap_or_else(none);
    println!();
    println!("| path | bytes moved | time | throughput | vs raw TCP |");
    println!("|---|---:|---:|---:|---:|");
    let row = |name: &str, r: &Rate| {
        println!(
            "| {name} | {:.0} MB | {:.2} s | {:.2} GB/s | {:.0}% |",
            r.bytes / 1e6,
            r.secs,
            r.gbps(),
            100.0 * r.gbps() / tcp_best.gbps()
        )
    };
    row("raw TCP send + echo", &tcp_best);
    row(
        "pserver push+pull, bulk path (default)",
        &bulk.unwrap_or_else(none),
    );
    row(
        "pserver push only, bulk path",
        &bulk_push.unwrap_or_else(none),
    );
    row(
        "pserver pull only, bulk path",
        &bulk_pull.unwrap_or_else(none),
    );
    row("pserver push+pull, gRPC", &grpc.unwrap_or_else(none));
    row("pserver push only, gRPC", &grpc_push.unwrap_or_else(none));
    row("pserver pull only, gRPC", &grpc_pull.unwrap_or_else(none));
    println!();
    let n = 1 << 22;
    println!("| optimizer | params/s per core |");
    println!("|---|---:|");
    for (name, kind) in [
        ("SGD", OptimizerKind::sgd()),
        (
            "SGD momentum",
            OptimizerKind::Sgd {
                momentum: 0.9,
                nesterov: false,
                weight_decay: 0.0,
            },
        ),
        (
            "Adagrad",
            OptimizerKind::Adagrad {
                eps: 1e-10,
                initial_accumulator: 0.0,
                weight_decay: 0.0,
            },
        ),
        ("Adam", OptimizerKind::adam()),
        (
            "AdamW",
            OptimizerKind::AdamW {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
            },
        ),
    ] {
        println!("| {name} | {:.2e} |", update_rate(kind, n));
    }
}
