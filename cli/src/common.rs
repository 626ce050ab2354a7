//! Options and plumbing shared by the role subcommands: etcd connection, job identity,
//! signals, listeners. A role's startup is [`RoleArgs::run`] (and [`ListenArgs::bind`]
//! for one that serves), written once for `edl master`, `edl pserver` and `edl consume`
//! on the role kit (`edl_role`); `edl trainer` starts through the trainer API, on the
//! same kit.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_coord::{Backend, EtcdAuth, EtcdBackend, EtcdConfig, EtcdTls};
use edl_job::JobName;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// How to reach etcd.
#[derive(Debug, Clone, Args)]
pub struct EtcdArgs {
    /// etcd client URLs, comma-separated (http://127.0.0.1:2379,...). Required (a
    /// command that can work on a cluster instead takes --context).
    #[arg(long, env = edl_job::env::ETCD, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Credentials and TLS.
    #[command(flatten)]
    pub access: EtcdAccessArgs,
    /// Timeout of one etcd request (e.g. 5s).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub etcd_timeout: Duration,
}

/// etcd's credentials and TLS: the same options (and variables) for every command, and
/// what `edl run` gives its children.
#[derive(Debug, Clone, Default, Args)]
pub struct EtcdAccessArgs {
    /// etcd user (with --etcd-password) when etcd has authentication on.
    #[arg(long, env = edl_job::env::ETCD_USER)]
    pub etcd_user: Option<String>,
    /// etcd password.
    #[arg(long, env = edl_job::env::ETCD_PASSWORD, hide_env_values = true)]
    pub etcd_password: Option<String>,
    /// CA certificate (PEM) to verify etcd's TLS certificate with.
    #[arg(long, env = edl_job::env::ETCD_CA)]
    pub etcd_ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for etcd TLS, with --etcd-key.
    #[arg(long, env = edl_job::env::ETCD_CERT)]
    pub etcd_cert: Option<std::path::PathBuf>,
    /// Client key (PEM) for etcd TLS.
    #[arg(long, env = edl_job::env::ETCD_KEY)]
    pub etcd_key: Option<std::path::PathBuf>,
    /// The name etcd's certificate is checked against, instead of the host dialled.
    #[arg(long, env = edl_job::env::ETCD_DOMAIN)]
    pub etcd_domain: Option<String>,
}

impl EtcdAccessArgs {
    /// The user and password, if given (both or neither).
    pub fn auth(&self) -> anyhow::Result<Option<EtcdAuth>> {
        match (&self.etcd_user, &self.etcd_password) {
            (Some(user), Some(password)) => Ok(Some(EtcdAuth {
                user: user.clone(),
                password: password.clone(),
            })),
            (None, None) => Ok(None),
            _ => anyhow::bail!("--etcd-user and --etcd-password go together"),
        }
    }

    /// TLS to etcd, if any option of it is given.
    pub fn tls(&self) -> Option<EtcdTls> {
        (self.etcd_ca.is_some()
            || self.etcd_cert.is_some()
            || self.etcd_key.is_some()
            || self.etcd_domain.is_some())
        .then(|| EtcdTls {
            ca_file: self.etcd_ca.clone(),
            cert_file: self.etcd_cert.clone(),
            key_file: self.etcd_key.clone(),
            domain: self.etcd_domain.clone(),
        })
    }
}

impl EtcdArgs {
    /// The etcd client configuration.
    pub fn config(&self) -> anyhow::Result<EtcdConfig> {
        anyhow::ensure!(
            !self.etcd.is_empty(),
            "no etcd: give --etcd URLS (or set EDL_ETCD)"
        );
        let mut cfg = EtcdConfig::new(self.etcd.iter().cloned());
        cfg.request_timeout = self.etcd_timeout;
        cfg.dial_timeout = self.etcd_timeout;
        cfg.auth = self.access.auth()?;
        cfg.tls = self.access.tls();
        Ok(cfg)
    }

    /// Connects, with an error naming the endpoints when none answers.
    pub async fn connect(&self) -> anyhow::Result<Arc<dyn Backend>> {
        let backend = EtcdBackend::connect(self.config()?)
            .await
            .map_err(etcd_connect_error)?;
        Ok(Arc::new(backend))
    }

    /// Connects, retrying while etcd cannot be reached for up to `wait` (a role started
    /// beside its etcd, or during an etcd election); `None` when `cancel` fires first.
    /// An error that retrying cannot cure (bad credentials, a bad TLS setup) fails at
    /// once; after `wait`, the error names the endpoints and says what to do, once
    /// ([`edl_role::connect`], which every role shares).
    pub async fn connect_waiting(
        &self,
        wait: Duration,
        cancel: &CancellationToken,
    ) -> anyhow::Result<Option<Arc<dyn Backend>>> {
        Ok(edl_role::connect(&self.config()?, wait, cancel).await?)
    }
}

/// How long a role keeps retrying an unreachable etcd while it starts.
#[derive(Debug, Clone, Args)]
pub struct EtcdWaitArgs {
    /// How long each step of the startup (connecting, the lease, the registration, the
    /// job spec) keeps retrying an unreachable etcd before the process gives up (an etcd
    /// outage while running is waited out in any case).
    #[arg(long, env = edl_job::env::ETCD_WAIT, value_parser = humantime::parse_duration, default_value = "2m")]
    pub etcd_wait: Duration,
}

/// What every role of a job takes: its etcd, how long to wait for it, and the job.
#[derive(Debug, Clone, Args)]
pub struct RoleArgs {
    /// etcd connection.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Retrying etcd at startup.
    #[command(flatten)]
    pub wait: EtcdWaitArgs,
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
}

impl RoleArgs {
    /// Runs a role as every role starts: its open-file limit raised
    /// ([`edl_role::raise_open_files`]), on a runtime of its own, SIGTERM and SIGINT cancel the
    /// token `body` gets (a second signal exits at once), etcd connected first (waiting
    /// out an outage for up to `--etcd-wait`). Stopped before etcd answered, the role
    /// does nothing and succeeds.
    pub fn run<F, Fut>(&self, body: F) -> anyhow::Result<()>
    where
        F: FnOnce(Arc<dyn Backend>, CancellationToken) -> Fut,
        Fut: Future<Output = anyhow::Result<()>>,
    {
        edl_role::raise_open_files();
        runtime()?.block_on(async move {
            let shutdown = shutdown_on_signals()?;
            match self
                .etcd
                .connect_waiting(self.wait.etcd_wait, &shutdown)
                .await?
            {
                Some(backend) => body(backend, shutdown).await,
                None => Ok(()),
            }
        })
    }
}

/// Where a serving role (master, pserver) listens.
#[derive(Debug, Clone, Args)]
pub struct ListenArgs {
    /// Address to serve on: gRPC, and a pserver's bulk data path beside it (port 0 picks
    /// a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Address trainers reach this process at (default: the bound listen address).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Write the bound address to this file once listening (for scripts and tests).
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
}

impl ListenArgs {
    /// Binds `--listen`, writes the bound address to `--addr-file`, and says on stdout
    /// where `role` listens.
    pub async fn bind(&self, role: &str) -> anyhow::Result<TcpListener> {
        let listener = TcpListener::bind(&self.listen)
            .await
            .with_context(|| format!("listen on {}", self.listen))?;
        let addr = listener.local_addr().context("listener address")?;
        if let Some(path) = &self.addr_file {
            std::fs::write(path, addr.to_string())
                .with_context(|| format!("write {}", path.display()))?;
        }
        println!("{role} listening on {addr}");
        Ok(listener)
    }
}

/// The job a process belongs to.
#[derive(Debug, Clone, Args)]
pub struct JobArgs {
    /// Job name: every key of the job lives under `/edl/<job>/` in etcd.
    #[arg(long, env = edl_job::env::JOB)]
    pub job: JobName,
    /// Shared job token every RPC must carry (optional).
    #[arg(long, env = edl_job::env::TOKEN, hide_env_values = true)]
    pub token: Option<String>,
    /// The token a `/metrics` scrape must carry instead of the job token (optional): it
    /// grants nothing else, so a scraper never holds the job token.
    #[arg(long, env = edl_job::env::METRICS_TOKEN, hide_env_values = true)]
    pub metrics_token: Option<String>,
    /// TLS between the job's processes.
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// TLS between the job's processes (masters, pservers, trainers): docs/security.md.
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// CA certificate (PEM) that signs the job's certificates: turns TLS on. It is the
    /// only root trusted.
    #[arg(long, env = edl_proto::tls::env::CA)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// This process's certificate (PEM): a server's, and a client's for mutual TLS.
    #[arg(long, env = edl_proto::tls::env::CERT, requires = "tls_ca")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = edl_proto::tls::env::KEY, requires = "tls_ca")]
    pub tls_key: Option<std::path::PathBuf>,
    /// The name checked in servers' certificates instead of the host dialled.
    #[arg(long, env = edl_proto::tls::env::DOMAIN, requires = "tls_ca")]
    pub tls_domain: Option<String>,
    /// Servers accept only clients with a certificate the CA signed (mutual TLS).
    #[arg(long, env = edl_proto::tls::env::CLIENT_AUTH, requires = "tls_ca")]
    pub tls_client_auth: bool,
}

impl TlsArgs {
    /// The loaded setup; `None` without `--tls-ca`.
    pub fn load(&self) -> anyhow::Result<Option<edl_proto::tls::Tls>> {
        let Some(ca) = &self.tls_ca else {
            return Ok(None);
        };
        let files = edl_proto::tls::TlsFiles {
            ca: ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            domain: self.tls_domain.clone(),
            client_auth: self.tls_client_auth,
        };
        Ok(Some(files.load()?))
    }
}

/// A token cancelled on SIGTERM or SIGINT (Ctrl-C); a second signal exits at once
/// ([`edl_role::shutdown_on_signals`], shared by every role).
pub fn shutdown_on_signals() -> anyhow::Result<CancellationToken> {
    edl_role::shutdown_on_signals().context("install the SIGTERM and SIGINT handlers")
}

/// A multi-threaded tokio runtime for a role.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    edl_role::runtime().context("start the async runtime")
}

/// An error connecting to etcd, said once (the error names the endpoints), with the
/// fix when etcd cannot be reached.
pub fn etcd_connect_error(e: edl_coord::Error) -> anyhow::Error {
    if e.is_retryable() {
        anyhow::anyhow!("{e} (is etcd running there? pass its client URLs with --etcd or EDL_ETCD)")
    } else {
        anyhow::anyhow!("etcd: {e}")
    }
}
