//! Tests of the TLS setup: variables, unusable files, handshakes.

use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn job_files(dir: &Path, job: &str) -> TlsFiles {
    LocalCa::generate(job).unwrap().write(dir).unwrap()
}

#[test]
fn variables_name_the_files_and_bad_ones_are_said() {
    let vars = |pairs: &[(&str, &str)]| {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    };
    assert_eq!(TlsFiles::from_vars(vars(&[])).unwrap(), None);
    let f = TlsFiles::from_vars(vars(&[
        (env::CA, "/ca"),
        (env::CERT, "/c"),
        (env::KEY, "/k"),
        (env::CLIENT_AUTH, "true"),
    ]))
    .unwrap()
    .unwrap();
    assert!(f.client_auth);
    let back: Vec<(String, String)> = f
        .to_vars()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    let again = TlsFiles::from_vars(move |k: &str| {
        back.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })
    .unwrap();
    assert_eq!(again, Some(f));
    let e = TlsFiles::from_vars(vars(&[(env::CERT, "/c")])).unwrap_err();
    assert!(e.to_string().contains("EDL_TLS_CA"), "{e}");
    let e = TlsFiles::from_vars(vars(&[(env::CA, "/c"), (env::CLIENT_AUTH, "yes")])).unwrap_err();
    assert!(e.to_string().contains("true or false"), "{e}");
}

#[test]
fn unusable_files_are_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let good = job_files(dir.path(), "j");
    let missing = TlsFiles {
        ca: dir.path().join("nope.pem"),
        ..good.clone()
    };
    let e = missing.load().unwrap_err().to_string();
    assert!(e.contains("nope.pem"), "{e}");
    let no_key = TlsFiles {
        key: None,
        ..good.clone()
    };
    assert!(no_key.load().unwrap_err().to_string().contains("--tls-key"));
    let not_pem = dir.path().join("junk.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let junk = TlsFiles {
        ca: not_pem,
        ..good.clone()
    };
    assert!(
        junk.load()
            .unwrap_err()
            .to_string()
            .contains("no certificate")
    );
    // A key that is not the certificate's.
    let other = job_files(&dir.path().join("other"), "k");
    let mismatched = TlsFiles {
        key: other.key.clone(),
        ..good.clone()
    };
    assert!(mismatched.load().is_err());
    let client_only = TlsFiles {
        cert: None,
        key: None,
        client_auth: true,
        ..good.clone()
    };
    assert!(client_only.load().is_err(), "client auth needs an identity");
    // The key file is the owner's only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(good.key.unwrap())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "{mode:o}");
}

/// A bulk-path handshake completes with the job's certificate and says so in its
/// ALPN; bytes round trip; a client of another CA is refused in the handshake.
#[tokio::test]
async fn handshakes_settle_the_protocol_and_refuse_strangers() {
    let dir = tempfile::tempdir().unwrap();
    let files = job_files(dir.path(), "j");
    let tls = files.load().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let acceptor = tls.acceptor().unwrap();
    let server = tokio::spawn(async move {
        let mut results = Vec::new();
        for _ in 0..2 {
            let (s, _) = listener.accept().await.unwrap();
            match ServerConn::accept(&acceptor, s).await {
                Ok(mut c) => {
                    let alpn = c.alpn().map(<[u8]>::to_vec);
                    let mut buf = [0u8; 5];
                    c.read_exact(&mut buf).await.unwrap();
                    c.write_all(&buf).await.unwrap();
                    c.flush().await.unwrap();
                    results.push(Ok(alpn));
                }
                Err(e) => results.push(Err(e.to_string())),
            }
        }
        results
    });
    let tcp = TcpStream::connect(&addr).await.unwrap();
    let mut c = ClientConn::Tls(Box::new(tls.connect(&addr, tcp).await.unwrap()));
    c.write_all(b"hello").await.unwrap();
    c.flush().await.unwrap();
    let mut back = [0u8; 5];
    c.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"hello");
    let mut stranger = job_files(&dir.path().join("x"), "x");
    stranger.ca = files.ca.clone();
    let stranger = stranger.load().unwrap();
    let tcp = TcpStream::connect(&addr).await.unwrap();
    // The client may finish its side before the server refuses its certificate:
    // the refusal shows at the first read.
    if let Ok(s) = stranger.connect(&addr, tcp).await {
        let mut s = ClientConn::Tls(Box::new(s));
        let _ = s.write_all(b"hello").await;
        let _ = s.flush().await;
        let mut b = [0u8; 5];
        assert!(s.read_exact(&mut b).await.is_err());
    }
    let results = server.await.unwrap();
    assert_eq!(results[0], Ok(Some(ALPN_BULK.to_vec())));
    assert!(results[1].is_err(), "{:?}", results[1]);
}

/// One CA, a certificate per role: a server's certificate serves and a client-only one
/// (a trainer's) is taken from a client, but a client refuses it from a server, so a
/// trainer cannot pose as a pserver or a master. A CA read back from its PEM issues
/// certificates the same clients accept.
#[tokio::test]
async fn a_client_only_certificate_cannot_serve() {
    let ca = JobCa::generate("j", 1).unwrap();
    let domain = "j.ns.edl.internal";
    let tls = |usage: CertUse, ca: &JobCa| {
        let leaf = ca
            .issue("edl test", vec![domain.to_owned()], usage, 1)
            .unwrap();
        Tls::from_pem(
            ca.ca_pem.as_bytes(),
            "ca",
            Some(PemIdentity {
                cert: leaf.cert_pem.into_bytes(),
                key: leaf.key_pem.into_bytes(),
                cert_name: "cert".to_owned(),
                key_name: "key".to_owned(),
            }),
            Some(domain.to_owned()),
            true,
        )
        .unwrap()
    };
    let again = JobCa::from_pem(&ca.ca_pem, &ca.ca_key_pem).unwrap();
    let (server, trainer, other_server) = (
        tls(CertUse::ServerAndClient, &ca),
        tls(CertUse::Client, &ca),
        tls(CertUse::ServerAndClient, &again),
    );
    // Serves two connections: each answers 5 bytes back, or fails its handshake.
    async fn serve_two(tls: &Tls) -> (String, tokio::task::JoinHandle<Vec<bool>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let acceptor = tls.acceptor().unwrap();
        let task = tokio::spawn(async move {
            let mut ok = Vec::new();
            for _ in 0..2 {
                let (s, _) = listener.accept().await.unwrap();
                ok.push(match ServerConn::accept(&acceptor, s).await {
                    Ok(mut c) => {
                        let mut buf = [0u8; 5];
                        c.read_exact(&mut buf).await.is_ok()
                            && c.write_all(&buf).await.is_ok()
                            && c.flush().await.is_ok()
                    }
                    Err(_) => false,
                });
            }
            ok
        });
        (addr, task)
    }
    async fn talk(client: &Tls, addr: &str) -> bool {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let Ok(s) = client.connect(addr, tcp).await else {
            return false;
        };
        let mut s = ClientConn::Tls(Box::new(s));
        let mut back = [0u8; 5];
        s.write_all(b"hello").await.is_ok()
            && s.flush().await.is_ok()
            && s.read_exact(&mut back).await.is_ok()
            && &back == b"hello"
    }
    // The server's certificate serves the trainer and a server of the CA read back.
    let (addr, task) = serve_two(&server).await;
    assert!(talk(&trainer, &addr).await, "a trainer is a client");
    assert!(
        talk(&other_server, &addr).await,
        "the CA read back issues alike"
    );
    assert_eq!(task.await.unwrap(), [true, true]);
    // The trainer's certificate serving: refused by clients.
    let (addr, task) = serve_two(&trainer).await;
    assert!(
        !talk(&server, &addr).await,
        "a client-only certificate served"
    );
    assert!(
        !talk(&trainer, &addr).await,
        "a client-only certificate served"
    );
    assert_eq!(task.await.unwrap(), [false, false]);
    // What is not a CA and its key does not read as one.
    let e = JobCa::from_pem(&ca.ca_pem, "junk").unwrap_err().to_string();
    assert!(e.contains("the CA's key"), "{e}");
}

/// A server's certificate rotated on disk (as the kubelet swaps a renewed Secret in: new
/// files renamed over the old) is presented from the next handshake on, without a
/// restart; a changed pair that does not go together is refused and the one before
/// stays (the witness: the change was looked at).
#[tokio::test]
async fn a_rotated_certificate_is_presented_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ca = JobCa::generate("j", 1).unwrap();
    let domain = "j.ns.edl.internal";
    let issue = |usage| {
        ca.issue("edl test", vec![domain.to_owned()], usage, 1)
            .unwrap()
    };
    let (first, second, client) = (
        issue(CertUse::ServerAndClient),
        issue(CertUse::ServerAndClient),
        issue(CertUse::Client),
    );
    let path = |name: &str| dir.path().join(name);
    std::fs::write(path("ca.crt"), &ca.ca_pem).unwrap();
    // Written beside, then renamed over: what a reader sees is always whole.
    let put = |cert: &str, key: &str| {
        std::fs::write(path("tls.crt.new"), cert).unwrap();
        std::fs::write(path("tls.key.new"), key).unwrap();
        std::fs::rename(path("tls.crt.new"), path("tls.crt")).unwrap();
        std::fs::rename(path("tls.key.new"), path("tls.key")).unwrap();
    };
    put(&first.cert_pem, &first.key_pem);
    let server = TlsFiles {
        ca: path("ca.crt"),
        cert: Some(path("tls.crt")),
        key: Some(path("tls.key")),
        domain: Some(domain.to_owned()),
        client_auth: true,
    }
    .load()
    .unwrap();
    let client = Tls::from_pem(
        ca.ca_pem.as_bytes(),
        "ca",
        Some(PemIdentity {
            cert: client.cert_pem.into_bytes(),
            key: client.key_pem.into_bytes(),
            cert_name: "cert".to_owned(),
            key_name: "key".to_owned(),
        }),
        Some(domain.to_owned()),
        true,
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // One acceptor for the server's life, as a role's.
    let acceptor = server.acceptor().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(mut c) = ServerConn::accept(&acceptor, s).await {
                    let mut buf = [0u8; 1];
                    let _ = c.read_exact(&mut buf).await;
                }
            });
        }
    });
    // The certificate the server presents to a new connection.
    let presented = || async {
        let tcp = TcpStream::connect(&addr).await.unwrap();
        let s = client.connect(&addr, tcp).await.expect("handshake");
        let der = s.get_ref().1.peer_certificates().expect("a certificate")[0].clone();
        der.as_ref().to_vec()
    };
    let der = |pem: &str| certs(pem.as_bytes(), "pem").unwrap()[0].as_ref().to_vec();
    assert_eq!(presented().await, der(&first.cert_pem));
    let identity = server.inner.identity.clone().expect("an identity");

    put(&second.cert_pem, &second.key_pem);
    identity.look_again();
    assert_eq!(presented().await, der(&second.cert_pem), "the renewed one");
    assert!(identity.seen_as_they_are());

    // A pair that does not go together (the first's key with the second's certificate).
    put(&second.cert_pem, &first.key_pem);
    assert!(!identity.seen_as_they_are(), "the files changed");
    identity.look_again();
    assert_eq!(
        presented().await,
        der(&second.cert_pem),
        "the previous pair stays"
    );
    assert!(
        identity.seen_as_they_are(),
        "the witness: the change was looked at"
    );
}

#[test]
fn a_certificate_is_renewed_with_a_third_of_its_life_left_and_never_past_its_ca() {
    use std::time::Duration;
    let (day, minute) = (Duration::from_secs(86_400), Duration::from_secs(60));
    let ca = JobCa::generate("j", 3650).unwrap();
    let leaf = ca
        .issue("edl test", vec!["j".to_owned()], CertUse::Client, 90)
        .unwrap();
    let (start, end) = validity_of(&leaf.cert_pem).unwrap();
    let life = end.duration_since(start).unwrap();
    // 90 days and the five minutes before now that allow for clocks.
    assert_eq!(life, 90 * day + 5 * minute);
    // With more than a third of its life left it stays; from a third on, and once
    // ended, it is renewed.
    let third = life / 3;
    let renewal_at = |t| renewal(&leaf.cert_pem, &ca.ca_pem, t).unwrap();
    assert_eq!(renewal_at(end - third - minute), Renewal::Keep);
    assert_eq!(renewal_at(end - third + minute), Renewal::Renew);
    assert_eq!(renewal_at(end + day), Renewal::Renew);
    // A certificate never outlives its CA: under a CA of 30 days a 90-day one ends with
    // it, and once due it cannot be renewed to end any later.
    let short_ca = JobCa::generate("j", 30).unwrap();
    let (_, ca_end) = validity_of(&short_ca.ca_pem).unwrap();
    let capped = short_ca
        .issue("edl test", vec!["j".to_owned()], CertUse::Client, 90)
        .unwrap();
    assert_eq!(validity_of(&capped.cert_pem).unwrap().1, ca_end);
    assert_eq!(
        renewal(&capped.cert_pem, &short_ca.ca_pem, ca_end - day).unwrap(),
        Renewal::CaEnds(ca_end)
    );
    assert!(renewal("not a certificate", &ca.ca_pem, end).is_err());
}

/// The role a certificate's common name names: the operator's per-role names only.
#[test]
fn a_common_name_names_a_role_only_as_the_operator_issues_them() {
    use super::role_of_common_name;
    for (cn, role) in [
        ("edl pserver ml.mnist", Some("pserver")),
        ("edl trainer ml.mnist", Some("trainer")),
        ("edl master ml.mnist", Some("master")),
        ("edl etcd ml.mnist", Some("etcd")),
        ("edl operator ml.mnist", Some("operator")),
        // `edl run --secure`'s one certificate for every process, and the CA.
        ("edl job mnist", None),
        ("edl job CA mnist", None),
        ("edl pserver", None),
        ("edl pserver ml.mnist extra", None),
        ("pserver ml.mnist", None),
        ("edl admin ml.mnist", None),
    ] {
        assert_eq!(role_of_common_name(cn), role, "{cn}");
    }
}
