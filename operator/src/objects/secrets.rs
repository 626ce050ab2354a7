//! A job's Secrets and how its pods take them: its credentials (the job token, and on
//! a shared etcd its own etcd user) and its TLS Secret (the job's CA and its pods'
//! certificate), with the volume and variables that turn mutual TLS on in a pod.

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    EnvVar, KeyToPath, Secret, SecretVolumeSource, Volume, VolumeMount,
};

use edl_proto::tls::{CertUse, Issued, JobCa};

use super::{Role, env, meta};
use crate::crd::TrainingJob;

/// The keys of a job's credentials Secret: the job's etcd user and password, and the
/// job token (the variables every role reads).
pub const CREDENTIAL_KEYS: [&str; 3] = edl_job::env::CREDENTIALS;

/// The Secret holding `job`'s own etcd credentials and token: `<job>-edl-credentials`.
pub fn credentials_secret_name(job: &str) -> String {
    format!("{job}-edl-credentials")
}

/// The Secret holding `job`'s scrape-only token (`EDL_METRICS_TOKEN`): what a
/// Prometheus scraping the job's `/metrics` is given instead of the job token, which
/// it then never holds nor sends: `<job>-edl-metrics`.
pub fn metrics_secret_name(job: &str) -> String {
    format!("{job}-edl-metrics")
}

/// The Secret [`metrics_secret_name`] with `token`, owned by `tj`.
pub fn metrics_secret(tj: &TrainingJob, token: &str) -> Secret {
    let job = tj.metadata.name.clone().unwrap_or_default();
    Secret {
        metadata: meta(tj, metrics_secret_name(&job), None),
        type_: Some("Opaque".to_owned()),
        data: Some(
            [(
                edl_job::env::METRICS_TOKEN.to_owned(),
                ByteString(token.as_bytes().to_vec()),
            )]
            .into(),
        ),
        ..Secret::default()
    }
}

/// The Secret holding `job`'s CA (certificate and key) and the operator's own client
/// certificate for the job: `<job>-edl-ca`. Only the operator reads it; no pod mounts it.
pub fn ca_secret_name(job: &str) -> String {
    format!("{job}-edl-ca")
}

/// The keys of [`ca_secret_name`]: the CA's certificate and key, the operator's
/// certificate and key.
pub const CA_KEYS: [&str; 4] = ["ca.crt", "ca.key", "operator.crt", "operator.key"];

/// The Secret holding the certificate of `role` in `job` (and the CA's certificate),
/// which only `role`'s pods mount: `<job>-edl-tls-<role>`.
pub fn tls_secret_name(job: &str, role: Role) -> String {
    format!("{job}-edl-tls-{}", role.name())
}

/// The one TLS Secret an earlier operator made for every role of `job`, with the CA's
/// key in it: `<job>-edl-tls`. Its CA carries on in [`ca_secret_name`]; its CA key is
/// taken out of it.
pub fn legacy_tls_secret_name(job: &str) -> String {
    format!("{job}-edl-tls")
}

/// The key of the CA's key in [`legacy_tls_secret_name`].
pub const LEGACY_CA_KEY: &str = "ca.key";

/// The name every edl certificate of `job` carries and every edl process checks in its
/// peers' (`EDL_TLS_DOMAIN`, `EDL_ETCD_DOMAIN`): pods dial one another by IP address.
pub fn tls_domain(job: &str, namespace: &str) -> String {
    format!("{job}.{namespace}.edl.internal")
}

/// The names in the managed etcd members' certificate: [`tls_domain`], which every edl
/// process checks; the members' DNS names under the job's headless service (etcd's
/// peers check them, and the peer's address against them, and accept as a peer only a
/// certificate for them: `--peer-cert-allowed-hostname`); `localhost` and `127.0.0.1`,
/// for a probe or `etcdctl` inside a member's pod.
pub fn tls_names(job: &str, namespace: &str) -> Vec<String> {
    vec![
        tls_domain(job, namespace),
        format!("*.{job}.{namespace}.svc"),
        format!("*.{job}.{namespace}.svc.cluster.local"),
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
    ]
}

/// The certificate of `role` in `job` (namespace `namespace`; `None`: the operator's
/// own): its common name, the names it is valid for and what for. Only the managed
/// etcd's is valid for the members' names (so only it joins the etcd as a peer); a
/// trainer's and the operator's are for clients only (so neither can serve as a
/// master or a pserver).
pub fn role_certificate(
    job: &str,
    namespace: &str,
    role: Option<Role>,
) -> (String, Vec<String>, CertUse) {
    let domain = vec![tls_domain(job, namespace)];
    match role {
        Some(Role::Etcd) => (
            format!("edl etcd {namespace}.{job}"),
            tls_names(job, namespace),
            CertUse::ServerAndClient,
        ),
        Some(r @ (Role::Master | Role::Pserver)) => (
            format!("edl {} {namespace}.{job}", r.name()),
            domain,
            CertUse::ServerAndClient,
        ),
        Some(Role::Trainer) => (
            format!("edl trainer {namespace}.{job}"),
            domain,
            CertUse::Client,
        ),
        None => (
            format!("edl operator {namespace}.{job}"),
            domain,
            CertUse::Client,
        ),
    }
}

/// The Secret holding the root password of `job`'s managed etcd:
/// `<job>-etcd-root`. The operator reads it; of the job's pods, only the masters get it
/// (as `EDL_ETCD_SNAPSHOT_PASSWORD`), when they snapshot the etcd.
pub fn etcd_root_secret_name(job: &str) -> String {
    format!("{job}-etcd-root")
}

/// The key of the root password in [`etcd_root_secret_name`].
pub const ETCD_ROOT_KEY: &str = "password";

/// The Secret with the root password of `tj`'s managed etcd, owned by `tj`.
pub fn etcd_root_secret(tj: &TrainingJob, password: &str) -> Secret {
    let job = tj.metadata.name.clone().unwrap_or_default();
    Secret {
        metadata: meta(tj, etcd_root_secret_name(&job), None),
        type_: Some("Opaque".to_owned()),
        data: Some(
            [(
                ETCD_ROOT_KEY.to_owned(),
                ByteString(password.as_bytes().to_vec()),
            )]
            .into(),
        ),
        ..Secret::default()
    }
}

/// Where a pod mounts its TLS files.
pub const TLS_MOUNT: &str = "/etc/edl/tls";

/// The keys of a role's TLS Secret: the CA's certificate, the role's certificate and key.
pub const TLS_KEYS: [&str; 3] = ["ca.crt", "tls.crt", "tls.key"];

fn opaque(tj: &TrainingJob, name: String, pairs: &[(&str, &str)]) -> Secret {
    Secret {
        metadata: meta(tj, name, None),
        type_: Some("Opaque".to_owned()),
        data: Some(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Secret::default()
    }
}

/// The CA Secret of `tj` ([`ca_secret_name`]), with `ca` and the operator's
/// certificate `operator`, owned by `tj`.
pub fn ca_secret(tj: &TrainingJob, ca: &JobCa, operator: &Issued) -> Secret {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let values = [
        &ca.ca_pem,
        &ca.ca_key_pem,
        &operator.cert_pem,
        &operator.key_pem,
    ];
    let pairs: Vec<(&str, &str)> = CA_KEYS
        .iter()
        .zip(values)
        .map(|(k, v)| (*k, v.as_str()))
        .collect();
    opaque(tj, ca_secret_name(&job), &pairs)
}

/// The TLS Secret of `role` in `tj` ([`tls_secret_name`]): the CA's certificate
/// `ca_pem` and the role's `issued`, owned by `tj`.
pub fn tls_secret(tj: &TrainingJob, role: Role, ca_pem: &str, issued: &Issued) -> Secret {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let pairs = [
        (TLS_KEYS[0], ca_pem),
        (TLS_KEYS[1], issued.cert_pem.as_str()),
        (TLS_KEYS[2], issued.key_pem.as_str()),
    ];
    opaque(tj, tls_secret_name(&job, role), &pairs)
}

/// The etcd user (and role) of `job`, the job's name in etcd ([`super::etcd_job`]: on
/// a shared etcd, and on its managed one): `edl-job-<job>`, as `edl run --secure` names
/// it.
pub fn job_etcd_user(job: &str) -> String {
    format!("edl-job-{job}")
}

/// How a job's pods take the Secret [`credentials_secret_name`] (as `envFrom`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialsRef {
    /// Not at all: the job runs its own etcd (`etcd.managed`), which has no users
    /// yet.
    None,
    /// If it exists: a job on a shared etcd whose operator makes no credentials (an
    /// administrator may have made the Secret by hand).
    Optional,
    /// It must exist (the operator made it): a pod without it does not start.
    Required,
}

impl CredentialsRef {
    /// The reference `tj`'s pods get; `issued`: the operator makes the job's credentials.
    pub fn of(tj: &TrainingJob, issued: bool) -> CredentialsRef {
        match (tj.spec.etcd.managed, issued) {
            (_, true) => CredentialsRef::Required,
            (true, false) => CredentialsRef::None,
            (false, false) => CredentialsRef::Optional,
        }
    }
}

/// The Secret with `tj`'s job token and its etcd user and password (`auth`; none when
/// an administrator gives the operator no etcd user on a shared etcd), owned by `tj`.
pub fn credentials_secret(
    tj: &TrainingJob,
    auth: Option<&edl_coord::EtcdAuth>,
    token: &str,
) -> Secret {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let values = [
        auth.map(|a| a.user.as_str()),
        auth.map(|a| a.password.as_str()),
        Some(token),
    ];
    Secret {
        metadata: meta(tj, credentials_secret_name(&job), None),
        type_: Some("Opaque".to_owned()),
        data: Some(
            CREDENTIAL_KEYS
                .iter()
                .zip(values)
                .filter_map(|(k, v)| Some(((*k).to_owned(), ByteString(v?.as_bytes().to_vec()))))
                .collect(),
        ),
        ..Secret::default()
    }
}

/// The job's TLS Secret as a read-only volume at [`TLS_MOUNT`]: the CA's certificate
/// and the pods' certificate and key, not the CA's key.
pub(super) fn mount_tls(
    job: &str,
    role: Role,
    volumes: &mut Vec<Volume>,
    mounts: &mut Vec<VolumeMount>,
) {
    let secret = tls_secret_name(job, role);
    mount_secret(("tls", &secret, &TLS_KEYS), TLS_MOUNT, volumes, mounts);
}

/// Keys `keys` of Secret `secret` as the read-only volume `name` at `at`, each file
/// readable by the pod's group (fsGroup), not by others.
fn mount_secret(
    (name, secret, keys): (&str, &str, &[&str]),
    at: &str,
    volumes: &mut Vec<Volume>,
    mounts: &mut Vec<VolumeMount>,
) {
    volumes.push(Volume {
        name: name.to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.to_owned()),
            items: Some(
                keys.iter()
                    .map(|k| KeyToPath {
                        key: (*k).to_owned(),
                        path: (*k).to_owned(),
                        mode: None,
                    })
                    .collect(),
            ),
            default_mode: Some(0o440),
            optional: None,
        }),
        ..Volume::default()
    });
    mounts.push(VolumeMount {
        name: name.to_owned(),
        mount_path: at.to_owned(),
        read_only: Some(true),
        ..VolumeMount::default()
    });
}

/// Where a job's pods find the TLS files of an existing etcd
/// ([`SharedEtcdTls`](crate::crd::SharedEtcdTls)).
pub const ETCD_TLS_MOUNT: &str = "/etc/edl/etcd-tls";

/// TLS to an existing etcd (`spec.etcd.tls`): its Secret as a read-only volume at
/// [`ETCD_TLS_MOUNT`] and the variables that point edl's etcd client at it.
pub(super) fn shared_etcd_tls(
    t: &crate::crd::SharedEtcdTls,
    volumes: &mut Vec<Volume>,
    mounts: &mut Vec<VolumeMount>,
) -> Vec<EnvVar> {
    use edl_job::env as job_env;
    let keys: &[&str] = if t.client_certificate {
        &["ca.crt", "tls.crt", "tls.key"]
    } else {
        &["ca.crt"]
    };
    mount_secret(
        ("etcd-tls", &t.secret_name, keys),
        ETCD_TLS_MOUNT,
        volumes,
        mounts,
    );
    let mut vars = vec![env(job_env::ETCD_CA, format!("{ETCD_TLS_MOUNT}/ca.crt"))];
    if t.client_certificate {
        vars.push(env(job_env::ETCD_CERT, format!("{ETCD_TLS_MOUNT}/tls.crt")));
        vars.push(env(job_env::ETCD_KEY, format!("{ETCD_TLS_MOUNT}/tls.key")));
    }
    if let Some(d) = &t.domain {
        vars.push(env(job_env::ETCD_DOMAIN, d.clone()));
    }
    vars
}

/// The variables that turn mutual TLS on in every edl role (with the files of
/// [`mount_tls`]), and with a managed etcd (`managed_etcd`) TLS to it with the same
/// certificate.
pub(super) fn tls_vars(job: &str, namespace: &str, managed_etcd: bool) -> Vec<EnvVar> {
    use edl_proto::tls::env as tls;
    let (ca, cert, key) = (
        format!("{TLS_MOUNT}/ca.crt"),
        format!("{TLS_MOUNT}/tls.crt"),
        format!("{TLS_MOUNT}/tls.key"),
    );
    let mut vars = vec![
        env(tls::CA, ca.clone()),
        env(tls::CERT, cert.clone()),
        env(tls::KEY, key.clone()),
        env(tls::DOMAIN, tls_domain(job, namespace)),
        env(tls::CLIENT_AUTH, "true"),
    ];
    if managed_etcd {
        use edl_job::env as job_env;
        vars.extend([
            env(job_env::ETCD_CA, ca),
            env(job_env::ETCD_CERT, cert),
            env(job_env::ETCD_KEY, key),
            env(job_env::ETCD_DOMAIN, tls_domain(job, namespace)),
        ]);
    }
    vars
}
