//! TLS between edl's own processes: masters, pservers (gRPC and the bulk path on the
//! same port), trainers and the commands that talk to them.
//!
//! - [`TlsFiles`] names the PEM files (a CA, and this process's certificate and key);
//!   [`TlsFiles::load`] reads and checks them into a [`Tls`]. The certificate and key
//!   are read again when their files change (`identity`): a rotated certificate is
//!   presented from the next handshake on, without a restart; the CA is read once.
//! - A server ([`Tls::acceptor`]) presents its certificate and, with `client_auth`,
//!   accepts only clients whose certificate the CA signed (mutual TLS). It offers two
//!   ALPN protocols on one port: `h2` (gRPC) and [`ALPN_BULK`] (the pserver's bulk
//!   path), and `http/1.1` for a master's `/metrics`, so a connection says which it is in the handshake and nothing is read in
//!   clear.
//! - A client trusts only the CA (not the system's roots) and presents its certificate
//!   when it has one: [`Tls::endpoint`] (or [`Tls::secure_endpoint`]) for gRPC, etcd's
//!   included, [`Tls::connect`] for the bulk path.
//! - [`LocalCa`] makes a private CA and one certificate for a job on this machine (what
//!   `edl run --secure` uses).
//!
//! The crypto provider is `ring`'s, given explicitly, so nothing depends on a
//! process-wide default.
//!
//! Invariant: a [`Tls`] always has a CA; a server needs a certificate and key too (said
//! when it starts, not at the first connection).
//!
//! Layout: this file holds the settings ([`TlsFiles`], [`Tls`], [`endpoint`]); `conn` the
//! connections ([`ServerConn`], [`ClientConn`], [`incoming`]); `ca` the private CA
//! ([`LocalCa`]); `identity` this process's certificate, read again when it changes.

use std::fmt;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

pub use tokio_rustls::TlsAcceptor;

mod ca;
mod conn;
mod identity;
#[cfg(test)]
mod tests;

pub use ca::{CertUse, Issued, JobCa, LocalCa, Renewal, renewal, validity_of};
pub use conn::{ClientConn, ServerConn, incoming, role_of_common_name};
use identity::{Identity as Presented, Pair, Resolver};

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
        let ca = read_pem(&self.ca, "CA")?;
        let identity = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => {
                let pair = Pair::of(PemIdentity {
                    cert: read_pem(c, "certificate")?,
                    key: read_pem(k, "key")?,
                    cert_name: c.display().to_string(),
                    key_name: k.display().to_string(),
                })?;
                // Read again when the files change: a rotated certificate needs no
                // restart.
                Some(Presented::from_files(pair, c, k))
            }
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
        Tls::build(
            &ca,
            &self.ca.display().to_string(),
            identity,
            self.domain.clone(),
            self.client_auth,
        )
    }
}

/// A certificate and its key, as PEM, with the names errors give them (their files, or
/// the Secret keys they came from).
#[derive(Clone)]
pub struct PemIdentity {
    /// The certificate chain.
    pub cert: Vec<u8>,
    /// Its private key.
    pub key: Vec<u8>,
    /// Where the certificate came from.
    pub cert_name: String,
    /// Where the key came from.
    pub key_name: String,
}

impl fmt::Debug for PemIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PemIdentity")
            .field("cert_name", &self.cert_name)
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// A TLS setup from PEM: the CA (`ca_name` names it in errors), this process's
    /// identity, the name checked in servers' certificates, and whether servers require
    /// client certificates. Both sides' configurations are built here, so a bad key or
    /// certificate is said at once.
    pub fn from_pem(
        ca_pem: &[u8],
        ca_name: &str,
        identity: Option<PemIdentity>,
        domain: Option<String>,
        client_auth: bool,
    ) -> Result<Tls, TlsError> {
        let identity = identity.map(Pair::of).transpose()?.map(Presented::fixed);
        Tls::build(ca_pem, ca_name, identity, domain, client_auth)
    }

    /// [`Tls::from_pem`] with this process's identity already checked.
    fn build(
        ca_pem: &[u8],
        ca_name: &str,
        identity: Option<Presented>,
        domain: Option<String>,
        client_auth: bool,
    ) -> Result<Tls, TlsError> {
        let ca_pem = ca_pem.to_vec();
        let mut roots = RootCertStore::empty();
        for c in certs(&ca_pem, ca_name)? {
            roots
                .add(c)
                .map_err(|e| TlsError::new(format!("CA {ca_name}: not a usable CA: {e}")))?;
        }
        let identity = identity.map(Arc::new);
        if client_auth && identity.is_none() {
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
                domain,
                client_auth,
            }),
        };
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

struct Inner {
    ca_pem: Vec<u8>,
    roots: Arc<RootCertStore>,
    identity: Option<Arc<Presented>>,
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
        let mut cfg = builder.with_cert_resolver(Arc::new(Resolver(id.clone())));
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
            Some(id) => builder.with_client_cert_resolver(Arc::new(Resolver(id.clone()))),
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
        let ep = Endpoint::from_shared(format!("https://{addr}"))
            .map_err(|e| TlsError::new(format!("address {addr:?}: {e}")))?;
        self.secure_endpoint(ep)
    }

    /// `ep` (an `https://` URL) over TLS, the one client side of gRPC connections
    /// (edl's own and etcd's): trusts only the CA, presents this process's certificate
    /// when it has one, and checks in the server's certificate the domain, else the
    /// URL's host.
    pub fn secure_endpoint(&self, ep: Endpoint) -> Result<Endpoint, TlsError> {
        let mut cfg =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.inner.ca_pem));
        if let Some(id) = &self.inner.identity {
            // The certificate of now: a channel made after a rotation presents the new one.
            let pair = id.current();
            cfg = cfg.identity(Identity::from_pem(&pair.cert_pem, &pair.key_pem));
        }
        let domain = match &self.inner.domain {
            Some(d) => d.clone(),
            None => ep
                .uri()
                .host()
                .unwrap_or_default()
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
        };
        cfg = cfg.domain_name(domain);
        ep.tls_config(cfg).map_err(|e| TlsError::new(e.to_string()))
    }

    /// Opens a TLS connection for the bulk path on `stream`, connected to `addr`.
    pub async fn connect(
        &self,
        addr: &str,
        stream: TcpStream,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        self.connect_alpn(addr, stream, ALPN_BULK).await
    }

    /// Opens a TLS connection on `stream`, connected to `addr`, that offers `alpn` only
    /// (the bulk path's: [`Tls::connect`]; [`ALPN_HTTP1`] for HTTP/1.1).
    pub async fn connect_alpn(
        &self,
        addr: &str,
        stream: TcpStream,
        alpn: &[u8],
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let cfg = self
            .client_config(alpn)
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

fn certs(pem: &[u8], name: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::new(format!("{name}: bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::new(format!(
            "{name}: no certificate in it (expected PEM \"BEGIN CERTIFICATE\")"
        )));
    }
    Ok(certs)
}
