//! The environment contract: the variables through which `edl run` and the Kubernetes
//! operator hand settings to a job's processes, and through which those processes (the
//! trainer API, the Python package, `edl`'s options) read them (docs/trainer-api.md,
//! section 4). Every writer and reader names them through these constants. The TLS
//! settings' names are `edl_proto::tls::env`.

/// etcd client URLs, comma-separated (required).
pub const ETCD: &str = "EDL_ETCD";
/// PaddlePaddle's name for the same, read when [`ETCD`] is not set.
pub const PADDLE_ETCD: &str = "PADDLE_ETCD_ENDPOINTS";
/// The job's name (required).
pub const JOB: &str = "EDL_JOB";
/// PaddlePaddle's name for the same, read when [`JOB`] is not set.
pub const PADDLE_JOB: &str = "PADDLE_JOB_ID";
/// This trainer's id, unique in the job (default `trainer-<pid>-<random>`).
pub const TRAINER_ID: &str = "EDL_TRAINER_ID";
/// Compute device: `auto`, `cpu` or `cuda:N` (default `auto`).
pub const DEVICE: &str = "EDL_DEVICE";
/// TTL of the registration lease, e.g. `10s` (default: the spec's).
pub const LEASE_TTL: &str = "EDL_LEASE_TTL";
/// Serve `/metrics` on this address (default: none).
pub const METRICS_ADDR: &str = "EDL_METRICS_ADDR";
/// Write the JSON report to this file (default: stdout only).
pub const REPORT: &str = "EDL_REPORT";
/// `train` (default) or `evaluate`.
pub const MODE: &str = "EDL_MODE";
/// The job token every RPC carries (optional).
pub const TOKEN: &str = "EDL_JOB_TOKEN";
/// The token a `/metrics` scrape must carry instead of the job token (optional): it
/// grants nothing else, so a scraper never holds the job token.
pub const METRICS_TOKEN: &str = "EDL_METRICS_TOKEN";
/// The CA (PEM) of TLS between the job's processes: TLS is on when set. With it:
/// `EDL_TLS_CERT`, `EDL_TLS_KEY` (this process's certificate, for mutual TLS),
/// `EDL_TLS_DOMAIN`, `EDL_TLS_CLIENT_AUTH` ([`edl_proto::tls::env`]).
pub const TLS_CA: &str = edl_proto::tls::env::CA;
/// This process's certificate, for mutual TLS.
pub const TLS_CERT: &str = edl_proto::tls::env::CERT;
/// This process's key, for mutual TLS.
pub const TLS_KEY: &str = edl_proto::tls::env::KEY;
/// The name the job's certificates are issued for, when not the address's host.
pub const TLS_DOMAIN: &str = edl_proto::tls::env::DOMAIN;
/// The name etcd's TLS certificate is checked against instead of the host dialled.
pub const ETCD_DOMAIN: &str = "EDL_ETCD_DOMAIN";
/// etcd user, with [`ETCD_PASSWORD`].
pub const ETCD_USER: &str = "EDL_ETCD_USER";
/// etcd password.
pub const ETCD_PASSWORD: &str = "EDL_ETCD_PASSWORD";
/// A user with etcd's `root` role, for `edl master --etcd-snapshots` (default `root`).
pub const ETCD_SNAPSHOT_USER: &str = "EDL_ETCD_SNAPSHOT_USER";
/// Its password.
pub const ETCD_SNAPSHOT_PASSWORD: &str = "EDL_ETCD_SNAPSHOT_PASSWORD";
/// The operator's: the shared etcd's client URLs (comma-separated) that its
/// [`ETCD_USER`] is for; it sends the credentials nowhere else.
pub const ETCD_ENDPOINTS: &str = "EDL_ETCD_ENDPOINTS";
/// CA certificate (PEM) for etcd TLS.
pub const ETCD_CA: &str = "EDL_ETCD_CA";
/// Client certificate (PEM) for etcd TLS, with [`ETCD_KEY`].
pub const ETCD_CERT: &str = "EDL_ETCD_CERT";
/// Client key (PEM) for etcd TLS.
pub const ETCD_KEY: &str = "EDL_ETCD_KEY";
/// How long each startup step retries an unreachable etcd (default `2m`).
pub const ETCD_WAIT: &str = "EDL_ETCD_WAIT";
/// How long to wait for the job's spec to appear in etcd (default `60s`).
pub const SPEC_WAIT: &str = "EDL_SPEC_WAIT";
/// The run directory of `edl run`, for a trainer's own files.
pub const RUN_DIR: &str = "EDL_RUN_DIR";
/// A job spec file for `edl trainer` to store (PaddlePaddle's environment).
pub const SPEC: &str = "EDL_SPEC";
/// A pserver's checkpoint directory (PaddlePaddle's environment).
pub const CHECKPOINT_DIR: &str = "EDL_CHECKPOINT_DIR";
/// A tracing filter for the logs, e.g. `info,edl_coord=debug`.
pub const LOG: &str = "EDL_LOG";
/// This process's incarnation, unique in the job, given by whoever starts it (the
/// Kubernetes operator: `<pod name>.<pod uid>`): a pserver writes it into its shard
/// claim and replica registration, a master beside its candidacy, so that whoever sees
/// the process end can revoke what it held ([`crate::holders`]) without knowing its
/// address or process id.
pub const INSTANCE: &str = "EDL_INSTANCE";
/// The etcd user and password and the job token: the credentials the Kubernetes operator
/// keeps in a job's Secret.
pub const CREDENTIALS: [&str; 3] = [ETCD_USER, ETCD_PASSWORD, TOKEN];

/// This process's [`INSTANCE`], or "" when it was not given one.
pub fn instance() -> &'static str {
    static INSTANCE_OF_THIS_PROCESS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    INSTANCE_OF_THIS_PROCESS.get_or_init(|| std::env::var(INSTANCE).unwrap_or_default())
}
