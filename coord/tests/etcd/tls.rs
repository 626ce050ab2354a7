//! TLS to a real etcd that requires client certificates (`--client-cert-auth`), with
//! certificates from a private CA ([`LocalCa`]): the etcd client's TLS is the client
//! side of `edl_proto::tls`.

use std::time::Duration;

use edl_coord::{Backend, Error, EtcdBackend, EtcdConfig};
use edl_proto::tls::LocalCa;
use edl_testkit::etcd::TlsEtcd;

#[tokio::test]
async fn etcd_over_mutual_tls_serves_a_client_with_a_certificate_of_its_ca() {
    let etcd = TlsEtcd::start().await;
    let backend = EtcdBackend::connect(etcd.config(etcd.mutual()))
        .await
        .expect("connect over mutual TLS");
    backend
        .put("/edl/tls/k", b"v".to_vec(), None)
        .await
        .expect("put over TLS");
    let kv = backend.get("/edl/tls/k").await.expect("get over TLS");
    assert_eq!(kv.map(|kv| kv.value), Some(b"v".to_vec()));

    // The endpoint as `host:port`: https is implied by the TLS settings.
    let bare = etcd.endpoint.trim_start_matches("https://").to_owned();
    let mut cfg = etcd.config(etcd.mutual());
    cfg.endpoints = vec![bare];
    let backend = EtcdBackend::connect(cfg)
        .await
        .expect("connect to host:port over TLS");
    assert!(backend.get("/edl/tls/k").await.expect("get").is_some());

    // The name checked in etcd's certificate can be given (one it is valid for).
    let mut named = etcd.mutual();
    named.domain = Some("localhost".into());
    EtcdBackend::connect(etcd.config(named))
        .await
        .expect("connect checking the name localhost");
}

#[tokio::test]
async fn etcd_over_tls_refuses_what_it_cannot_trust_and_says_what_is_missing() {
    let etcd = TlsEtcd::start().await;

    // Without a client certificate: etcd refuses the handshake.
    let mut no_cert = etcd.mutual();
    no_cert.cert_file = None;
    no_cert.key_file = None;
    let r = EtcdBackend::connect(etcd.config(no_cert)).await;
    assert!(
        matches!(r, Err(Error::Unavailable { .. })),
        "a client without a certificate must be refused: {r:?}"
    );

    // A CA that did not sign etcd's certificate: the client refuses the server.
    let other = tempfile::tempdir().expect("temp dir");
    let other_files = LocalCa::generate("other")
        .expect("another CA")
        .write(other.path())
        .expect("write");
    let mut wrong_ca = etcd.mutual();
    wrong_ca.ca_file = Some(other_files.ca);
    let r = EtcdBackend::connect(etcd.config(wrong_ca)).await;
    assert!(
        matches!(r, Err(Error::Unavailable { .. })),
        "a server signed by another CA must not be trusted: {r:?}"
    );

    // A name etcd's certificate is not valid for.
    let mut wrong_name = etcd.mutual();
    wrong_name.domain = Some("etcd.example".into());
    let r = EtcdBackend::connect(etcd.config(wrong_name)).await;
    assert!(
        matches!(r, Err(Error::Unavailable { .. })),
        "a certificate for another name must not be trusted: {r:?}"
    );

    // An https endpoint without TLS settings, TLS without its CA, a certificate
    // without its key, a CA file that is not there: said before any connection.
    let r = EtcdBackend::connect(EtcdConfig::new([etcd.endpoint.clone()])).await;
    assert!(
        matches!(&r, Err(Error::InvalidArgument(m)) if m.contains("--etcd-ca")),
        "{r:?}"
    );
    let mut no_ca = etcd.mutual();
    no_ca.ca_file = None;
    let r = EtcdBackend::connect(etcd.config(no_ca)).await;
    assert!(
        matches!(&r, Err(Error::InvalidArgument(m)) if m.contains("--etcd-ca")),
        "{r:?}"
    );
    let mut no_key = etcd.mutual();
    no_key.key_file = None;
    let r = EtcdBackend::connect(etcd.config(no_key)).await;
    assert!(
        matches!(&r, Err(Error::InvalidArgument(m)) if m.contains("together")),
        "{r:?}"
    );
    let mut missing = etcd.mutual();
    missing.ca_file = Some(etcd.files.ca.with_file_name("absent.pem"));
    let r = EtcdBackend::connect(etcd.config(missing)).await;
    assert!(
        matches!(&r, Err(Error::InvalidArgument(m)) if m.contains("absent.pem")),
        "{r:?}"
    );
}

#[tokio::test]
async fn connect_as_root_turns_authentication_on_once_and_a_job_user_keeps_to_its_prefix() {
    let etcd = TlsEtcd::start().await;
    // TLS loaded from PEM in memory (as the operator holds a job's Secret), not files.
    let pem = |p: &std::path::Path| std::fs::read(p).expect("read PEM");
    let identity = edl_proto::tls::PemIdentity {
        cert: pem(etcd.files.cert.as_deref().expect("cert")),
        key: pem(etcd.files.key.as_deref().expect("key")),
        cert_name: "cert".into(),
        key_name: "key".into(),
    };
    let tls = edl_proto::tls::Tls::from_pem(&pem(&etcd.files.ca), "ca", Some(identity), None, true)
        .expect("TLS from PEM");
    let cfg = EtcdConfig::new([etcd.endpoint.clone()]).with_dial_timeout(Duration::from_secs(2));

    // A new etcd: authentication off, so anyone with a certificate may write.
    let open = EtcdBackend::connect_with_tls(cfg.clone(), tls.clone())
        .await
        .expect("connect without a user");
    open.put("/edl/open", b"v".to_vec(), None)
        .await
        .expect("no authentication yet");

    let root = EtcdBackend::connect_as_root(cfg.clone(), Some(tls.clone()), "pw-1")
        .await
        .expect("turn authentication on and connect as root");
    root.put("/edl/jobs/a/k", b"v".to_vec(), None)
        .await
        .expect("root writes");
    // Now the certificate alone is not enough.
    let r = open.get("/edl/open").await;
    assert!(
        matches!(r, Err(Error::PermissionDenied(_))),
        "without a user, authentication on refuses: {r:?}"
    );
    // Again with the same password: connects, turns nothing on twice.
    let again = EtcdBackend::connect_as_root(cfg.clone(), Some(tls.clone()), "pw-1")
        .await
        .expect("connect as root again");
    assert!(again.get("/edl/jobs/a/k").await.expect("get").is_some());
    // Another password is refused, not taken for a new cluster's.
    let r = EtcdBackend::connect_as_root(cfg.clone(), Some(tls.clone()), "pw-2").await;
    let refused = r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        refused.contains("authentication failed"),
        "a wrong root password must be refused: {refused}"
    );

    // A job's user reads and writes its prefix and nothing else.
    let auth = again
        .grant_prefix("edl-job-a", "/edl/jobs/a/")
        .await
        .expect("grant the job's prefix");
    let job = EtcdBackend::connect_with_tls(cfg.with_auth(auth.user, auth.password), tls)
        .await
        .expect("connect as the job's user");
    job.put("/edl/jobs/a/x", b"v".to_vec(), None)
        .await
        .expect("the job writes its own keys");
    let r = job.put("/edl/jobs/b/x", b"v".to_vec(), None).await;
    assert!(
        matches!(r, Err(Error::PermissionDenied(_))),
        "another job's keys are refused: {r:?}"
    );
}
