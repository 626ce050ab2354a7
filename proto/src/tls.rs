//! TLS between edl's own processes: masters, pservers (gRPC and the bulk path on the
//! same port), trainers and the commands that talk to them.
//!
//! - [`TlsFiles`] names the PEM files (a CA, and this process's certificate and key);
//!   [`TlsFiles::load`] reads and checks them once, into a [`Tls`].
//! - A server ([`Tls::acceptor`]) presents its certificate and, with `client_auth`,
//!   accepts only clients whose certificate the CA signed (mutual TLS). It offers two
//!   ALPN protocols on one port: `h2` (gRPC) and [`ALPN_BULK`] (the pserver's bulk
//!   path), and `http/1.1` for a master's `/metrics`, so a connection says which it is in the handshake and nothing is read in
//!   clear.
//! - A client trusts only the CA (not the system's roots) and presents its certificate
//!   when it has one: [`Tls::endpoint`] for gRPC, [`Tls::connect`] for the bulk path.
//! - [`LocalCa`] makes a private CA and one certificate for a job on this machine (what
//!   `edl run --secure` uses).
//!
//! The crypto provider is `ring`'s, given explicitly, so nothing depends on a
//! process-wide default.
//!
//! Invariant: a [`Tls`] always has a CA; a server needs a certificate and key too (said
//! when it starts, not at the first connection).

use std::fmt;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

pub use tokio_rustls::TlsAcceptor;

/// ALPN of gRPC (HTTP/2).
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN of HTTP/1.1 (a `/metrics` scrape on a master's port).
pub const ALPN_HTTP1: &[u8] = b"http/1.1";
/// ALPN of the pserver's bulk path.
pub const ALPN_BULK: &[u8] = b"edl-bulk/1";
/// How long a TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest PEM file read (a CA bundle is a few KiB).
const MAX_PEM: u64 = 1 << 20;

/// A TLS setup that cannot be used: the file and what is wrong with it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("TLS: {0}")]
pub struct TlsError(String);

impl TlsError {
    fn new(msg: impl Into<String>) -> TlsError {
        TlsError(msg.into())
    }
}

/// Where the PEM files are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA certificate(s) that sign the job's certificates; the only roots trusted.
    pub ca: PathBuf,
    /// This process's certificate chain (a server's, and a client's for mutual TLS).
    pub cert: Option<PathBuf>,
    /// Its private key.
    pub key: Option<PathBuf>,
    /// The name a client checks in servers' certificates instead of the host it dials
    /// (default: that host, a DNS name or an IP address).
    pub domain: Option<String>,
    /// Servers accept only clients with a certificate the CA signed.
    pub client_auth: bool,
}

impl TlsFiles {
    /// Reads and checks the files.
    pub fn load(&self) -> Result<Tls, TlsError> {
        let ca_pem = read_pem(&self.ca, "CA")?;
        let mut roots = RootCertStore::empty();
        let ca_certs = certs(&ca_pem, &self.ca)?;
        for c in ca_certs {
            roots.add(c).map_err(|e| {
                TlsError::new(format!("CA {}: not a usable CA: {e}", self.ca.display()))
            })?;
        }
        let identity = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => Some((read_pem(c, "certificate")?, read_pem(k, "key")?, c, k)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(TlsError::new(
                    "a certificate without its key: give --tls-key (EDL_TLS_KEY) too",
                ));
            }
            (None, Some(_)) => {
                return Err(TlsError::new(
                    "a key without its certificate: give --tls-cert (EDL_TLS_CERT) too",
                ));
            }
        };
        let identity = match identity {
            Some((cert_pem, key_pem, cert_path, key_path)) => {
                let chain = certs(&cert_pem, cert_path)?;
                let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
                    TlsError::new(format!(
                        "key {}: no private key in PEM: {e}",
                        key_path.display()
                    ))
                })?;
                Some(Ident {
                    cert_pem,
                    key_pem,
                    chain,
                    key: Arc::new(key),
                })
            }
            None => None,
        };
        if self.client_auth && identity.is_none() {
            return Err(TlsError::new(
                "client authentication needs this process's own certificate: give \
                 --tls-cert and --tls-key (EDL_TLS_CERT, EDL_TLS_KEY)",
            ));
        }
        let tls = Tls {
            inner: Arc::new(Inner {
                ca_pem,
                roots: Arc::new(roots),
                identity,
                domain: self.domain.clone(),
                client_auth: self.client_auth,
            }),
        };
        // Both sides' configurations are built once here, so a bad key or certificate
        // is said at the start.
        tls.client_config(ALPN_BULK)?;
        if tls.inner.identity.is_some() {
            tls.server_config()?;
        }
        Ok(tls)
    }
}

/// The environment variables of a TLS setup (what `edl run` gives its children, and what
/// the `--tls-*` options read).
pub mod env {
    /// The CA's PEM file: TLS is on when it is set.
    pub const CA: &str = "EDL_TLS_CA";
    /// This process's certificate (PEM).
    pub const CERT: &str = "EDL_TLS_CERT";
    /// Its private key (PEM).
    pub const KEY: &str = "EDL_TLS_KEY";
    /// The name checked in servers' certificates instead of the host dialled.
    pub const DOMAIN: &str = "EDL_TLS_DOMAIN";
    /// `true`: servers require client certificates.
    pub const CLIENT_AUTH: &str = "EDL_TLS_CLIENT_AUTH";
}

impl TlsFiles {
    /// The files named by the [`env`](mod@env) variables read through `var`: `None` when none
    /// is set; an error naming the variable when one is set without [`env::CA`] or has
    /// a bad value.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<TlsFiles>, TlsError> {
        let (ca, cert, key, domain, auth) = (
            var(env::CA),
            var(env::CERT),
            var(env::KEY),
            var(env::DOMAIN),
            var(env::CLIENT_AUTH),
        );
        let Some(ca) = ca else {
            if let Some((name, _)) = [
                (env::CERT, &cert),
                (env::KEY, &key),
                (env::DOMAIN, &domain),
                (env::CLIENT_AUTH, &auth),
            ]
            .into_iter()
            .find(|(_, v)| v.is_some())
            {
                return Err(TlsError::new(format!(
                    "{name} is set but {} is not: TLS needs the CA that signs the job's certificates",
                    env::CA
                )));
            }
            return Ok(None);
        };
        let client_auth = match auth.as_deref() {
            None | Some("0") | Some("false") => false,
            Some("1") | Some("true") => true,
            Some(other) => {
                return Err(TlsError::new(format!(
                    "{}={other:?}: expected true or false",
                    env::CLIENT_AUTH
                )));
            }
        };
        Ok(Some(TlsFiles {
            ca: ca.into(),
            cert: cert.map(PathBuf::from),
            key: key.map(PathBuf::from),
            domain,
            client_auth,
        }))
    }

    /// The [`env`](mod@env) variables that name these files.
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = vec![(env::CA, self.ca.display().to_string())];
        if let Some(c) = &self.cert {
            vars.push((env::CERT, c.display().to_string()));
        }
        if let Some(k) = &self.key {
            vars.push((env::KEY, k.display().to_string()));
        }
        if let Some(d) = &self.domain {
            vars.push((env::DOMAIN, d.clone()));
        }
        vars.push((env::CLIENT_AUTH, self.client_auth.to_string()));
        vars
    }
}

struct Ident {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
}

struct Inner {
    ca_pem: Vec<u8>,
    roots: Arc<RootCertStore>,
    identity: Option<Ident>,
    domain: Option<String>,
    client_auth: bool,
}

/// A loaded TLS setup, cheap to clone.
#[derive(Clone)]
pub struct Tls {
    inner: Arc<Inner>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("identity", &self.inner.identity.is_some())
            .field("domain", &self.inner.domain)
            .field("client_auth", &self.inner.client_auth)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Tls {
    /// Whether servers require client certificates.
    pub fn client_auth(&self) -> bool {
        self.inner.client_auth
    }

    /// The server's side: presents this process's certificate, offers `h2` and the bulk
    /// path, and with `client_auth` verifies clients against the CA.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let Some(id) = &self.inner.identity else {
            return Err(TlsError::new(
                "a server needs its certificate and key: give --tls-cert and --tls-key \
                 (EDL_TLS_CERT, EDL_TLS_KEY)",
            ));
        };
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::new(e.to_string()))?;
        let builder = if self.inner.client_auth {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(self.inner.roots.clone(), provider())
                    .build()
                    .map_err(|e| TlsError::new(format!("client verifier: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut cfg = builder
            .with_single_cert(id.chain.clone(), id.key.clone_key())
            .map_err(|e| TlsError::new(format!("certificate and key do not go together: {e}")))?;
        cfg.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_BULK.to_vec(), ALPN_HTTP1.to_vec()];
        Ok(Arc::new(cfg))
    }

    /// The acceptor of a server.
    pub fn acceptor(&self) -> Result<TlsAcceptor, TlsError> {
        Ok(TlsAcceptor::from(self.server_config()?))
    }

    fn client_config(&self, alpn: &[u8]) -> Result<Arc<ClientConfig>, TlsError> {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::new(e.to_string()))?
            .with_root_certificates(self.inner.roots.clone());
        let mut cfg = match &self.inner.identity {
            Some(id) => builder
                .with_client_auth_cert(id.chain.clone(), id.key.clone_key())
                .map_err(|e| {
                    TlsError::new(format!("certificate and key do not go together: {e}"))
                })?,
            None => builder.with_no_client_auth(),
        };
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(Arc::new(cfg))
    }

    /// The name checked in the certificate of a server dialled at `addr` (`host:port`).
    fn server_name(&self, addr: &str) -> io::Result<ServerName<'static>> {
        let host = match &self.inner.domain {
            Some(d) => d.as_str(),
            None => host_of(addr),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok(ServerName::IpAddress(ip.into()));
        }
        ServerName::try_from(host.to_owned()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{host:?} is not a server name for TLS: {e}"),
            )
        })
    }

    /// A gRPC endpoint for `addr` (`host:port`) over TLS.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, TlsError> {
        let mut cfg =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.inner.ca_pem));
        if let Some(id) = &self.inner.identity {
            cfg = cfg.identity(Identity::from_pem(&id.cert_pem, &id.key_pem));
        }
        let domain = match &self.inner.domain {
            Some(d) => d.clone(),
            None => host_of(addr)
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
        };
        cfg = cfg.domain_name(domain);
        Endpoint::from_shared(format!("https://{addr}"))
            .map_err(|e| TlsError::new(format!("address {addr:?}: {e}")))?
            .tls_config(cfg)
            .map_err(|e| TlsError::new(e.to_string()))
    }

    /// Opens a TLS connection for the bulk path on `stream`, connected to `addr`.
    pub async fn connect(
        &self,
        addr: &str,
        stream: TcpStream,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let cfg = self
            .client_config(ALPN_BULK)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let name = self.server_name(addr)?;
        let connect = tokio_rustls::TlsConnector::from(cfg).connect(name, stream);
        tokio::time::timeout(HANDSHAKE_TIMEOUT, connect)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))?
    }
}

/// A gRPC endpoint for `addr` (`host:port`): over TLS with `tls`, else plain HTTP/2.
pub fn endpoint(addr: &str, tls: Option<&Tls>) -> Result<Endpoint, TlsError> {
    match tls {
        Some(t) => t.endpoint(addr),
        None => Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| TlsError::new(format!("address {addr:?}: {e}"))),
    }
}

fn host_of(addr: &str) -> &str {
    match addr.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => addr,
    }
}

fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>, TlsError> {
    use std::io::Read;
    let f = std::fs::File::open(path)
        .map_err(|e| TlsError::new(format!("{what} {}: {e}", path.display())))?;
    let mut buf = Vec::new();
    f.take(MAX_PEM + 1)
        .read_to_end(&mut buf)
        .map_err(|e| TlsError::new(format!("{what} {}: {e}", path.display())))?;
    if buf.len() as u64 > MAX_PEM {
        return Err(TlsError::new(format!(
            "{what} {}: over {MAX_PEM} bytes; not a PEM file",
            path.display()
        )));
    }
    Ok(buf)
}

fn certs(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::new(format!("{}: bad PEM: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(TlsError::new(format!(
            "{}: no certificate in it (expected PEM \"BEGIN CERTIFICATE\")",
            path.display()
        )));
    }
    Ok(certs)
}

/// A server's side of a connection: plain TCP, or TLS over it.
#[derive(Debug)]
pub enum ServerConn {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl ServerConn {
    /// The ALPN protocol the handshake settled on (none for plain TCP).
    pub fn alpn(&self) -> Option<&[u8]> {
        match self {
            ServerConn::Plain(_) => None,
            ServerConn::Tls(s) => s.get_ref().1.alpn_protocol(),
        }
    }

    /// Completes the TLS handshake of `stream` within [`HANDSHAKE_TIMEOUT`].
    pub async fn accept(acceptor: &TlsAcceptor, stream: TcpStream) -> io::Result<ServerConn> {
        let s = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        Ok(ServerConn::Tls(Box::new(s)))
    }
}

impl Connected for ServerConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            ServerConn::Plain(s) => s.connect_info(),
            ServerConn::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}

/// A client's side of a bulk connection: plain TCP, or TLS over it.
#[derive(Debug)]
pub enum ClientConn {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

macro_rules! delegate_io {
    ($t:ident) => {
        impl AsyncRead for $t {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_read(cx, buf),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
                }
            }
        }

        impl AsyncWrite for $t {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_write(cx, buf),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
                }
            }

            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
                }
            }

            fn is_write_vectored(&self) -> bool {
                match self {
                    $t::Plain(s) => s.is_write_vectored(),
                    $t::Tls(s) => s.is_write_vectored(),
                }
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_flush(cx),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
                }
            }

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_shutdown(cx),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
                }
            }
        }
    };
}

delegate_io!(ServerConn);
delegate_io!(ClientConn);

/// Accepts connections on `listener` for a gRPC server, until the receiver is dropped:
/// plain ones without `tls`; with it, only TLS handshakes that complete (each on its own
/// task, within [`HANDSHAKE_TIMEOUT`], so a slow peer holds up nobody).
pub fn incoming(
    listener: tokio::net::TcpListener,
    tls: Option<TlsAcceptor>,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<ServerConn>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                _ = tx.closed() => return,
                r = listener.accept() => match r {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            match &tls {
                None => {
                    if tx.send(Ok(ServerConn::Plain(stream))).await.is_err() {
                        return;
                    }
                }
                Some(acceptor) => {
                    let (acceptor, tx) = (acceptor.clone(), tx.clone());
                    tokio::spawn(async move {
                        let peer = stream.peer_addr().ok();
                        match ServerConn::accept(&acceptor, stream).await {
                            Ok(conn) => {
                                let _ = tx.send(Ok(conn)).await;
                            }
                            Err(e) => {
                                tracing::debug!(?peer, error = %e, "TLS handshake refused")
                            }
                        }
                    });
                }
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A private CA and one certificate it signed, for a job on this machine: valid for
/// `localhost`, `127.0.0.1` and `::1`, as a server and as a client.
pub struct LocalCa {
    /// The CA certificate (PEM).
    pub ca_pem: String,
    /// The job's certificate (PEM).
    pub cert_pem: String,
    /// The job certificate's private key (PEM, PKCS#8).
    pub key_pem: String,
}

impl fmt::Debug for LocalCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalCa").finish_non_exhaustive()
    }
}

impl LocalCa {
    /// A new CA (its key is not kept) and a certificate for `job`, valid for 30 days.
    pub fn generate(job: &str) -> Result<LocalCa, TlsError> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let err = |e: rcgen::Error| TlsError::new(format!("make a certificate: {e}"));
        let now = time::OffsetDateTime::now_utc();
        let (not_before, not_after) = (
            now - time::Duration::minutes(5),
            now + time::Duration::days(30),
        );
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        ca.distinguished_name
            .push(DnType::CommonName, format!("edl job CA {job}"));
        ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca.not_before = not_before;
        ca.not_after = not_after;
        let ca_key = KeyPair::generate().map_err(err)?;
        let ca_cert = ca.self_signed(&ca_key).map_err(err)?;
        let issuer = rcgen::Issuer::new(ca, ca_key);

        let mut leaf = CertificateParams::new(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
        ])
        .map_err(err)?;
        leaf.distinguished_name
            .push(DnType::CommonName, format!("edl job {job}"));
        leaf.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        leaf.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        leaf.not_before = not_before;
        leaf.not_after = not_after;
        let key = KeyPair::generate().map_err(err)?;
        let cert = leaf.signed_by(&key, &issuer).map_err(err)?;
        Ok(LocalCa {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Writes `ca.pem`, `job.pem` and `job.key` (mode 0600) into `dir`; the files, with
    /// client authentication on.
    pub fn write(&self, dir: &Path) -> io::Result<TlsFiles> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::create_dir_all(dir)?;
        let write = |name: &str, text: &str, mode: u32| -> io::Result<PathBuf> {
            let path = dir.join(name);
            let _ = std::fs::remove_file(&path);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&path)?;
            f.write_all(text.as_bytes())?;
            Ok(path)
        };
        Ok(TlsFiles {
            ca: write("ca.pem", &self.ca_pem, 0o644)?,
            cert: Some(write("job.pem", &self.cert_pem, 0o644)?),
            key: Some(write("job.key", &self.key_pem, 0o600)?),
            domain: None,
            client_auth: true,
        })
    }
}

#[cfg(test)]
mod tests {
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
        let e =
            TlsFiles::from_vars(vars(&[(env::CA, "/c"), (env::CLIENT_AUTH, "yes")])).unwrap_err();
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
}
