//! Security end to end (docs/security.md): `edl run --secure` over mutual TLS with a job
//! user in an etcd with authentication on; jobs isolated from each other by etcd; a
//! pserver's memory under an unauthenticated flood.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Error as CoordError, EtcdBackend, EtcdConfig};
use edl_job::{PserverRecord, Record};
use edl_proto::tls::{LocalCa, TlsFiles};
use edl_testkit::EtcdCluster;
use serde_json::Value;
use tonic::Code;

use crate::run::{HOUSING_COST_BOUND, example, metric, read_report};
use crate::support::{Proc, World, wait_until};

const ROOT_PASSWORD: &str = "root-s3cret";

/// An etcd with authentication on; a backend connected as root.
async fn etcd_with_auth() -> (EtcdCluster, Arc<EtcdBackend>) {
    EtcdCluster::start_with_auth(ROOT_PASSWORD)
        .await
        .expect("start etcd with authentication on (run scripts/test to install etcd)")
}

fn denied<T: std::fmt::Debug>(r: Result<T, CoordError>, what: &str) {
    match r {
        Err(CoordError::PermissionDenied(_)) => {}
        other => panic!("{what}: expected PermissionDenied, got {other:?}"),
    }
}

/// A job's user (made as `edl run --secure` makes it) reads and writes its own job's
/// keys, and etcd refuses it every key of another job, and the listing of all jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_user_cannot_read_or_write_another_jobs_keys() {
    let (etcd, root) = etcd_with_auth().await;
    let alpha = root
        .grant_prefix("edl-job-alpha", "/edl/alpha/")
        .await
        .expect("grant alpha");
    root.grant_prefix("edl-job-beta", "/edl/beta/")
        .await
        .expect("grant beta");
    root.put("/edl/beta/job/control", b"{\"stop\":false}".to_vec(), None)
        .await
        .expect("seed beta");
    let as_alpha: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(
            EtcdConfig::new(etcd.endpoints()).with_auth(alpha.user.clone(), alpha.password),
        )
        .await
        .expect("connect as alpha's user"),
    );
    // Its own keys: the positive witness that the user works.
    as_alpha
        .put("/edl/alpha/scale/trainers", b"3".to_vec(), None)
        .await
        .expect("alpha writes its own keys");
    let (own, _) = as_alpha
        .range("/edl/alpha/")
        .await
        .expect("alpha lists its keys");
    assert_eq!(own.len(), 1);
    // Another job's: refused by etcd, and unchanged.
    denied(
        as_alpha
            .put("/edl/beta/job/control", b"{\"stop\":true}".to_vec(), None)
            .await,
        "write beta's control key",
    );
    denied(
        as_alpha
            .put("/edl/beta/scale/trainers", b"0".to_vec(), None)
            .await,
        "write beta's scale key",
    );
    denied(
        as_alpha.get("/edl/beta/job/control").await,
        "read beta's key",
    );
    denied(
        as_alpha.delete("/edl/beta/job/control").await,
        "delete beta's key",
    );
    denied(as_alpha.range("/edl/").await, "list every job");
    denied(
        as_alpha.put("/edl/alpha", b"x".to_vec(), None).await,
        "write just outside its prefix",
    );
    let beta = root
        .get("/edl/beta/job/control")
        .await
        .expect("read as root")
        .expect("still there");
    assert_eq!(beta.value, b"{\"stop\":false}");
    // Granting again gives a new password; the old one no longer works.
    let again = root
        .grant_prefix("edl-job-alpha", "/edl/alpha/")
        .await
        .expect("grant again");
    let old =
        EtcdBackend::connect(EtcdConfig::new(etcd.endpoints()).with_auth("edl-job-alpha", "wrong"))
            .await;
    assert!(old.is_err(), "a wrong password is refused");
    EtcdBackend::connect(EtcdConfig::new(etcd.endpoints()).with_auth(again.user, again.password))
        .await
        .expect("the new password works");
}

/// `edl run --secure` against an etcd with authentication on, given root's credentials:
/// the job trains to its usual quality with every process on mutual TLS and a job
/// user. While it runs, its pserver answers (with `Unauthenticated`, no token) over TLS
/// with the job's certificate, and refuses plain TCP, TLS without a client certificate,
/// and a certificate of another CA. The job's user may touch only the job's prefix, and
/// another job's keys are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_run_trains_over_mutual_tls_as_a_job_user() {
    let (etcd, root) = etcd_with_auth().await;
    root.put("/edl/other/job/control", b"untouched".to_vec(), None)
        .await
        .expect("seed another job");
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = example(dir.path(), "fit_a_line", "job.toml", |s| s);
    let run_dir = dir.path().join("secure-run");
    let report = dir.path().join("secure.report.json");
    let args: Vec<String> = [
        "run",
        &spec.display().to_string(),
        "--secure",
        "--etcd",
        &etcd.endpoints().join(","),
        "--etcd-user",
        "root",
        "--etcd-password",
        ROOT_PASSWORD,
        "--run-dir",
        &run_dir.display().to_string(),
        "--report",
        &report.display().to_string(),
        "--quiet",
    ]
    .map(String::from)
    .to_vec();
    let mut p = Proc::spawn(dir.path(), "secure", &args);

    // The pserver's address, once it serves.
    let job = "fit-a-line";
    let ps_key = format!("/edl/{job}/ps/0");
    let pserver = || {
        let (root, key) = (root.clone(), ps_key.clone());
        async move {
            let kv = root.get(&key).await.ok().flatten()?;
            PserverRecord::decode(&kv.value).ok().map(|r| r.addr)
        }
    };
    let found = wait_until(Duration::from_secs(120), || async {
        pserver().await.is_some()
    })
    .await;
    assert!(found, "no pserver served; log:\n{}", p.log());
    let addr = pserver().await.expect("the pserver's address");
    let tls_dir = run_dir.join("tls");
    let files = TlsFiles {
        ca: tls_dir.join("ca.pem"),
        cert: Some(tls_dir.join("job.pem")),
        key: Some(tls_dir.join("job.key")),
        domain: None,
        client_auth: true,
    };
    let job_tls = files.load().expect("the job's certificates");
    let probe = |tls: Option<edl_proto::tls::Tls>| {
        let addr = addr.clone();
        async move {
            edl_pserver_client::probe(&addr, job, None, tls.as_ref(), Duration::from_secs(5)).await
        }
    };
    // With the job's certificate the TLS round trip completes: the pserver answers,
    // refusing the missing token.
    let over_tls = probe(Some(job_tls.clone())).await;
    // Whether a probe reached the service (an answer, or its refusal of the token), as
    // opposed to a connection that failed.
    let served =
        |r: &Result<edl_proto::pserver::StatusResponse, edl_pserver_client::PsClientError>| match r
        {
            Ok(_) => true,
            Err(edl_pserver_client::PsClientError::ProbeRefused { status, .. }) => {
                status.code() == Code::Unauthenticated
            }
            Err(_) => false,
        };
    assert!(
        matches!(&over_tls, Err(edl_pserver_client::PsClientError::ProbeRefused { status, .. })
            if status.code() == Code::Unauthenticated),
        "expected the pserver's Unauthenticated over TLS, got {over_tls:?}"
    );
    // Plain TCP: closed unread.
    let plain = probe(None).await;
    assert!(
        !served(&plain),
        "plain TCP must not reach the pserver: {plain:?}"
    );
    // TLS without a client certificate: refused in the handshake.
    let no_cert = TlsFiles {
        cert: None,
        key: None,
        client_auth: false,
        ..files.clone()
    }
    .load()
    .expect("CA only");
    let r = probe(Some(no_cert)).await;
    assert!(
        !served(&r),
        "TLS without a client certificate must not reach the service: {r:?}"
    );
    // A certificate of another CA, trusting the job's CA: refused.
    let intruder_dir = dir.path().join("intruder");
    let mut intruder = LocalCa::generate("intruder")
        .expect("CA")
        .write(&intruder_dir)
        .expect("write");
    intruder.ca = files.ca.clone();
    let r = probe(Some(intruder.load().expect("intruder's files"))).await;
    assert!(
        !served(&r),
        "a certificate of another CA must not reach the service: {r:?}"
    );

    let status = p.wait_exit(Duration::from_secs(300)).await;
    let log = p.log();
    let r: Value = read_report(&report);
    assert!(status.success(), "edl run --secure failed: {r}\n{log}");
    assert_eq!(r["succeeded"], true);
    assert_eq!(r["lost_records"], 0);
    let (_, cost) = metric(&r);
    assert!(cost < HOUSING_COST_BOUND, "held-out cost {cost}");
    assert!(log.contains("edl run: secure:"), "{log}");
    // The key is readable by its owner only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(tls_dir.join("job.key"))
        .expect("key")
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "job.key mode {mode:o}");
    // The job's user exists, with one role limited to the job's prefix.
    let user = format!("edl-job-{job}");
    let roles = role_permissions(&etcd, &user).await;
    assert_eq!(
        roles,
        vec![(format!("/edl/{job}/"), format!("/edl/{job}0"))],
        "the job user's permissions"
    );
    let other = root
        .get("/edl/other/job/control")
        .await
        .expect("read")
        .expect("still there");
    assert_eq!(other.value, b"untouched");
}

/// The key ranges role `role` may touch, as root sees them.
async fn role_permissions(etcd: &EtcdCluster, role: &str) -> Vec<(String, String)> {
    use edl_proto::etcd::etcdserverpb::{self as pb, auth_client::AuthClient};
    let channel = tonic::transport::Endpoint::from_shared(etcd.endpoint(0))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut auth = AuthClient::new(channel.clone());
    let token = auth
        .authenticate(pb::AuthenticateRequest {
            name: "root".into(),
            password: ROOT_PASSWORD.into(),
        })
        .await
        .expect("authenticate")
        .into_inner()
        .token;
    let mut req = tonic::Request::new(pb::AuthRoleGetRequest { role: role.into() });
    req.metadata_mut()
        .insert("token", token.parse().expect("token"));
    auth.role_get(req)
        .await
        .expect("role get")
        .into_inner()
        .perm
        .into_iter()
        .map(|p| {
            (
                String::from_utf8_lossy(&p.key).into_owned(),
                String::from_utf8_lossy(&p.range_end).into_owned(),
            )
        })
        .collect()
}

/// Resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

/// A peer without the job's token offers 900 MB on 8 concurrent gRPC streams and 900
/// MB on 8 bulk connections: every push is refused, and the pserver's memory stays flat
/// (the body is never read past HTTP/2's windows, the bulk path stops at the hello and
/// closes the connection). The witness that the bulk flood reached the pserver: it is
/// stopped (SIGSTOP) while the 8 connections flood, until its sockets hold at least
/// 16 KiB of each beyond the hellos (the kernel's receive queues, read from
/// `/proc/net/tcp`); it then resumes with all of it waiting, refuses each hello and
/// closes, and the queued bytes go with the connections, unread. The same pserver then
/// serves a client with the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_peer_offering_900_mb_leaves_pserver_memory_flat() {
    use edl_proto::pserver::{self as pb, parameter_server_client::ParameterServerClient};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const STREAMS: usize = 8;
    const PER_STREAM: usize = 900_000_000 / STREAMS;
    let world = World::new("flood").await;
    let (_ps, addr) = world
        .pserver("ps", &["--shards", "1", "--token", "s3cret"])
        .await;
    let pid = _ps.pid();
    let before = rss(pid);
    // The peak, sampled every 2 ms through the flood.
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut peak = 0;
            let mut samples = 0u32;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss(pid));
                samples += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (peak, samples)
        })
    };

    let values = bytes::Bytes::from(vec![0u8; PER_STREAM]);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut pushes = Vec::new();
    for i in 0..STREAMS {
        let mut client =
            ParameterServerClient::new(channel.clone()).max_encoding_message_size(usize::MAX);
        let req = pb::PushRequest {
            shard: 0,
            shards: 1,
            trainer: format!("intruder-{i}"),
            step: 1,
            dense: vec![pb::DenseBlock {
                id: 0,
                version: 0,
                values: values.clone(),
            }],
            ..Default::default()
        };
        pushes.push(tokio::spawn(async move {
            let mut r = tonic::Request::new(req);
            edl_proto::headers::set_credentials(r.metadata_mut(), "flood", None);
            client.push(r).await
        }));
    }
    let mut peak = before;
    let mut refused = 0;
    for p in pushes {
        let r = tokio::time::timeout(Duration::from_secs(60), p)
            .await
            .expect("every push answered in time")
            .expect("task");
        peak = peak.max(rss(pid));
        match r {
            Err(s) if s.code() == Code::Unauthenticated => refused += 1,
            other => panic!("expected Unauthenticated, got {other:?}"),
        }
    }
    assert_eq!(refused, STREAMS);

    // The bulk path: a hello with a wrong token, then the bytes anyway, to a pserver
    // stopped until they reached its sockets.
    let port: u16 = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the pserver's port");
    // The refused gRPC pushes may leave bytes the pserver has not read yet; they would
    // drain after a baseline taken before the stop (on a busy machine all of them did,
    // and the flood's bytes then counted for nothing). So: the gRPC connection closed
    // (its socket leaves ESTABLISHED, which `unread_at` counts), then the baseline
    // taken once the pserver is stopped.
    drop(channel);
    wait_until(Duration::from_secs(30), || async {
        edl_testkit::unread_at(port) == 0
    })
    .await;
    _ps.signal("STOP");
    let idle = edl_testkit::unread_at(port);
    let mut bulk = Vec::new();
    for _ in 0..STREAMS {
        let addr = addr.clone();
        let values = values.clone();
        bulk.push(tokio::spawn(async move {
            let mut s = tokio::net::TcpStream::connect(&addr)
                .await
                .expect("connect");
            let hello = prost::Message::encode_to_vec(&pb::BulkHello {
                job: "flood".into(),
                token: "wrong".into(),
            });
            let mut head = b"EDLB".to_vec();
            head.extend_from_slice(&1u32.to_le_bytes());
            head.extend_from_slice(&(hello.len() as u32).to_le_bytes());
            head.extend_from_slice(&hello);
            s.write_all(&head).await.expect("hello");
            // Then the flood, until the pserver closes the connection.
            let mut sent = 0usize;
            for chunk in values.chunks(1 << 20) {
                if s.write_all(chunk).await.is_err() {
                    break;
                }
                sent += chunk.len();
            }
            let mut status = [0u8; 4];
            let answered = s.read_exact(&mut status).await.is_ok();
            (answered && u32::from_le_bytes(status) == 1, sent)
        }));
    }
    // The flood reached the pserver: beyond the hellos (under 100 bytes each), at least
    // 16 KiB of each connection waits in its sockets (loopback queues far more with the
    // default buffers; a hello alone is far less).
    const FLOOR: u64 = STREAMS as u64 * (16 << 10);
    let reached = wait_until(Duration::from_secs(30), || async {
        edl_testkit::unread_at(port) >= idle + FLOOR
    })
    .await;
    let queued = edl_testkit::unread_at(port).saturating_sub(idle);
    _ps.signal("CONT");
    assert!(
        reached,
        "only {queued} bytes of the bulk flood reached the stopped pserver's sockets"
    );
    let mut sent_total = 0;
    for b in bulk {
        let (refused_hello, sent) = tokio::time::timeout(Duration::from_secs(60), b)
            .await
            .expect("bulk flood ended in time")
            .expect("task");
        peak = peak.max(rss(pid));
        assert!(
            refused_hello,
            "the bulk hello with a wrong token is refused"
        );
        // Cut off: the pserver closed the connection before the flood went through.
        assert!(
            sent < PER_STREAM,
            "{sent} bytes of {PER_STREAM} went through"
        );
        sent_total += sent;
    }
    // What waited in its sockets went with the connections, unread.
    let dropped = wait_until(Duration::from_secs(10), || async {
        edl_testkit::unread_at(port) <= idle
    })
    .await;
    assert!(
        dropped,
        "{} bytes of the flood still wait in the pserver's sockets",
        edl_testkit::unread_at(port)
    );
    eprintln!(
        "bulk flood: {queued} bytes queued at the stopped pserver, {sent_total} written \
         before it closed"
    );
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let (sampled, samples) = sampler.await.expect("sampler");
    assert!(samples > 10, "the flood was sampled {samples} times");
    peak = peak.max(sampled);
    let after = rss(pid);
    let grew = peak.saturating_sub(before);
    println!(
        "pserver RSS under the flood ({samples} samples, {} MiB of the bulk flood written): \
         before {} MiB, peak {} MiB, after {} MiB",
        sent_total >> 20,
        before >> 20,
        peak >> 20,
        after >> 20
    );
    assert!(
        grew < 100 << 20,
        "pserver memory grew by {} MiB under an unauthenticated 2 x 900 MB flood \
         (before {} MiB, peak {} MiB, after {} MiB)",
        grew >> 20,
        before >> 20,
        peak >> 20,
        after >> 20
    );
    // Still serving: a client with the token gets its status.
    let status =
        edl_pserver_client::probe(&addr, "flood", Some("s3cret"), None, Duration::from_secs(5))
            .await
            .expect("the pserver serves a client with the token");
    assert_eq!(status.shard, 0);
}
