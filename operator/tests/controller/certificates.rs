//! The renewal of a job's certificates (`edl_operator::controller`, its TLS Secrets)
//! against the fake API server and a real etcd. What it shows:
//! - a job's CA is made for ten years and the certificates it issues for 90 days;
//! - a role's certificate with a third of its life left or less (here: 20 days of 90;
//!   the operator's own: one that has ended) is issued again by the job's CA, for the same names and use, and its
//!   Secret updated in place (the same Secret, so the pods that mount it are not
//!   replaced), with a `CertificateRenewed` Event; the operator's own certificate in
//!   the CA Secret likewise; a certificate with time left is kept as it is;
//! - a certificate that is due but ends with its CA is not issued again (it could not
//!   end later): the `TLSReady` condition says `CAEnding`, with what to do, and one
//!   Warning Event;
//! - every request is one `deploy/rbac.yaml` allows, the Secrets' `update` among them.

use std::time::SystemTime;

use edl_operator::objects::{Role, role_certificate};
use edl_proto::tls::{CertUse, JobCa, validity_of};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;

use super::*;

/// Where `deploy/rbac.yaml` binds the edl-operator-credentials ClusterRole.
const CERT_NS: &str = "default";
const CA_SECRET: &str = "mnist-edl-ca";
const MASTER_SECRET: &str = "mnist-edl-tls-master";
const TRAINER_SECRET: &str = "mnist-edl-tls-trainer";
const DAY: Duration = Duration::from_secs(86_400);

/// The Secret's value of `key`, as text.
fn text(secret: &Secret, key: &str) -> String {
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .unwrap_or_else(|| panic!("no {key} in Secret {:?}", secret.metadata.name));
    String::from_utf8(bytes.0.clone()).expect("UTF-8")
}

/// How long from now until `pem`'s certificate ends (zero once it has).
fn left(pem: &str) -> Duration {
    let (_, end) = validity_of(pem).expect("a certificate");
    end.duration_since(SystemTime::now()).unwrap_or_default()
}

/// `secret` with `cert` and `key` under `keys` (its certificate's and key's).
fn with_pair(mut secret: Secret, [cert_key, key_key]: [&str; 2], cert: &str, key: &str) -> Secret {
    let data = secret.data.get_or_insert_with(Default::default);
    data.insert(cert_key.into(), ByteString(cert.as_bytes().to_vec()));
    data.insert(key_key.into(), ByteString(key.as_bytes().to_vec()));
    secret
}

fn events_of(api: &FakeApi, reason: &str) -> Vec<String> {
    event_notes(api, CERT_NS, JOB, reason, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_renewed_in_place_before_they_end_and_never_past_their_ca() {
    let etcd = EtcdCluster::start(1).await.expect("etcd");
    let (api, client, operator_client) = fake_api().await;
    let stop = CancellationToken::new();
    let operator = tokio::spawn(controller::run(
        operator_client,
        ControllerConfig {
            namespace: Some(CERT_NS.to_owned()),
            resync: Duration::from_millis(300),
            ..ControllerConfig::default()
        },
        Arc::new(Metrics::default()),
        stop.clone(),
    ));
    let mut tj = mnist_on(etcd.endpoints(), "trainers = 1\n");
    tj.metadata.namespace = Some(CERT_NS.to_owned());
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), CERT_NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), CERT_NS);
    let (within, every) = (Duration::from_secs(20), Duration::from_millis(50));
    let made = wait_until(within, every, || async {
        [CA_SECRET, MASTER_SECRET, TRAINER_SECRET]
            .iter()
            .all(|n| api.get("secrets", CERT_NS, n).is_some())
    })
    .await;
    assert!(made, "the job's TLS Secrets were not made");
    let ca_secret = secrets.get(CA_SECRET).await.expect("the CA Secret");
    let ca = JobCa::from_pem(&text(&ca_secret, "ca.crt"), &text(&ca_secret, "ca.key"))
        .expect("the job's CA");
    assert!(left(&ca.ca_pem) > 3640 * DAY, "a CA for ten years");
    let master = secrets.get(MASTER_SECRET).await.expect("the master's");
    let first = text(&master, "tls.crt");
    assert!((89 * DAY..=90 * DAY).contains(&left(&first)), "90 days");

    // The master's certificate two thirds through its life (one of the job's CA, as
    // though issued 70 days ago, with 20 left): it is issued again, in the same Secret.
    let (cn, names, usage) = role_certificate(JOB, CERT_NS, Some(Role::Master));
    let now = SystemTime::now();
    let due = ca
        .issue_between(&cn, names, usage, now - 70 * DAY, now + 20 * DAY)
        .expect("a certificate");
    let master = secrets
        .replace(
            MASTER_SECRET,
            &PostParams::default(),
            &with_pair(master, ["tls.crt", "tls.key"], &due.cert_pem, &due.key_pem),
        )
        .await
        .expect("put the certificate that is due");
    let trainer_before = secrets.get(TRAINER_SECRET).await.expect("the trainer's");
    let renewed = |name: &'static str, key: &'static str| {
        let secrets = secrets.clone();
        move || {
            let secrets = secrets.clone();
            async move {
                secrets
                    .get(name)
                    .await
                    .is_ok_and(|s| left(&text(&s, key)) > 89 * DAY)
            }
        }
    };
    assert!(
        wait_until(within, every, renewed(MASTER_SECRET, "tls.crt")).await,
        "the master's certificate was not renewed"
    );
    let now = secrets.get(MASTER_SECRET).await.expect("the master's");
    assert_eq!(now.metadata.uid, master.metadata.uid, "the same Secret");
    let (cert, key) = (text(&now, "tls.crt"), text(&now, "tls.key"));
    assert_ne!(cert, first);
    // Of the job's CA, for the job's name (what every edl process checks), and its key
    // goes with it.
    let domain = edl_operator::objects::tls_domain(JOB, CERT_NS);
    let tls = pem_tls(&ca.ca_pem, &cert, &key, domain.clone());
    assert!(tls.is_ok(), "{:?}", tls.err());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let acceptor = tls
        .as_ref()
        .expect("checked")
        .acceptor()
        .expect("an acceptor");
    let served = tokio::spawn(async move {
        let (s, _) = listener.accept().await.expect("accept");
        edl_proto::tls::ServerConn::accept(&acceptor, s)
            .await
            .is_ok()
    });
    let trainer = secrets.get(TRAINER_SECRET).await.expect("the trainer's");
    let client_tls = pem_tls(
        &ca.ca_pem,
        &text(&trainer, "tls.crt"),
        &text(&trainer, "tls.key"),
        domain,
    )
    .expect("the trainer's TLS");
    let tcp = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    assert!(
        client_tls.connect(&addr, tcp).await.is_ok() && served.await.expect("served"),
        "the renewed master certificate serves the job's trainers"
    );
    // The trainer's, with time left, was kept.
    assert_eq!(
        trainer.metadata.resource_version, trainer_before.metadata.resource_version,
        "a certificate with time left is not issued again"
    );
    // Recorded at the end of the round that renewed it.
    let said = wait_until(within, every, || async {
        events_of(&api, "CertificateRenewed")
            .iter()
            .any(|n| n.contains(MASTER_SECRET))
    })
    .await;
    assert!(
        said,
        "no CertificateRenewed event for {MASTER_SECRET}: {:?}",
        events_of(&api, "CertificateRenewed")
    );
    // The operator's own certificate, in the CA Secret, once it has ended.
    let ended = ca
        .issue("edl operator", vec!["ended".into()], CertUse::Client, 0)
        .expect("a certificate");
    assert_eq!(left(&ended.cert_pem), Duration::ZERO);
    let ca_secret = secrets.get(CA_SECRET).await.expect("the CA Secret");
    secrets
        .replace(
            CA_SECRET,
            &PostParams::default(),
            &with_pair(
                ca_secret,
                ["operator.crt", "operator.key"],
                &ended.cert_pem,
                &ended.key_pem,
            ),
        )
        .await
        .expect("put the ended certificate");
    assert!(
        wait_until(within, every, renewed(CA_SECRET, "operator.crt")).await,
        "the operator's certificate was not renewed"
    );
    assert_eq!(
        condition(&api, CERT_NS, JOB, "TLSReady").map(|c| c.1),
        Some("Issued".to_owned())
    );

    // A CA at its end: the operator's certificate, due, ends with it and is not issued
    // again; the condition says so, with one Warning Event.
    let ending = JobCa::generate("default.mnist", 0).expect("a CA");
    let short = ending
        .issue("edl operator", vec!["x".into()], CertUse::Client, 0)
        .expect("a certificate");
    let ca_now = secrets.get(CA_SECRET).await.expect("the CA Secret");
    let mut ended_ca = with_pair(
        ca_now,
        ["ca.crt", "ca.key"],
        &ending.ca_pem,
        &ending.ca_key_pem,
    );
    ended_ca = with_pair(
        ended_ca,
        ["operator.crt", "operator.key"],
        &short.cert_pem,
        &short.key_pem,
    );
    let put = secrets
        .replace(CA_SECRET, &PostParams::default(), &ended_ca)
        .await
        .expect("put the ending CA");
    let said = wait_until(within, every, || async {
        condition(&api, CERT_NS, JOB, "TLSReady").is_some_and(|c| c.1 == "CAEnding")
    })
    .await;
    assert!(said, "{:?}", condition(&api, CERT_NS, JOB, "TLSReady"));
    let (_, _, message) = condition(&api, CERT_NS, JOB, "TLSReady").expect("the condition");
    assert!(
        message.contains("delete Secret mnist-edl-ca") && message.contains("Suspend"),
        "{message}"
    );
    let ca_secret = secrets.get(CA_SECRET).await.expect("the CA Secret");
    assert_eq!(
        ca_secret.metadata.resource_version, put.metadata.resource_version,
        "a certificate that cannot outlive its CA is not issued again"
    );
    let warned = wait_until(within, every, || async {
        !events_of(&api, "CAEnding").is_empty()
    })
    .await;
    assert!(warned, "no CAEnding event");

    stop.cancel();
    operator.await.expect("operator");
    assert_eq!(events_of(&api, "CAEnding").len(), 1, "one Warning Event");
    // Renewals are updates of the job's Secrets, found by one list a round; no Secret
    // of an earlier job was here to delete, and no credentials Secret to get (the
    // credentials test uses those).
    check_rbac(&operator_accesses(&api), &|r, verb| {
        !credentials_rule(r) || verb == "delete" || verb == "get"
    });
}
