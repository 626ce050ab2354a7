//! This process's certificate and key, read again when their files change: a certificate
//! rotated on disk (a renewed Kubernetes Secret, which the kubelet swaps in atomically;
//! cert-manager; a hand-run renewal) is presented by the next handshake, as a server and
//! as a client, without a restart. Connections already open keep the certificate they
//! were made with (TLS checks it only at the handshake).
//!
//! Invariants: the identity presented is always a certificate and key that go together
//! (a changed pair that does not, or does not parse, is refused with one warning and the
//! previous pair stays); the files are looked at most once a second (`stat`, then read
//! only when their inode, modification time or size changed).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use rustls::client::ResolvesClientCert;
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use super::{PemIdentity, TlsError, certs, provider, read_pem};

/// How often the files are looked at, at most.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// One certificate and key, as PEM (for tonic's gRPC clients) and as rustls takes them.
pub(super) struct Pair {
    pub(super) cert_pem: Vec<u8>,
    pub(super) key_pem: Vec<u8>,
    pub(super) key: Arc<CertifiedKey>,
}

impl Pair {
    /// The pair of `id`, checked: the chain parses, the key parses, and they go together.
    pub(super) fn of(id: PemIdentity) -> Result<Pair, TlsError> {
        let chain = certs(&id.cert, &id.cert_name)?;
        let key = PrivateKeyDer::from_pem_slice(&id.key).map_err(|e| {
            TlsError::new(format!("key {}: no private key in PEM: {e}", id.key_name))
        })?;
        let key = CertifiedKey::from_der(chain, key, &provider()).map_err(|e| {
            TlsError::new(format!(
                "certificate {} and key {} do not go together: {e}",
                id.cert_name, id.key_name
            ))
        })?;
        Ok(Pair {
            cert_pem: id.cert,
            key_pem: id.key,
            key: Arc::new(key),
        })
    }
}

/// The files a pair came from, and what they looked like when last read.
struct Source {
    cert: PathBuf,
    key: PathBuf,
    seen: Mutex<Seen>,
}

struct Seen {
    checked: Instant,
    stamp: Stamp,
}

/// Inode, modification time and size of the certificate and the key file (through
/// symbolic links: a Kubernetes Secret volume's files are links into a directory the
/// kubelet swaps whole, so a renewed file is a new inode).
type Stamp = [(u64, Option<SystemTime>, u64); 2];

fn stamp(cert: &Path, key: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    [cert, key].map(|p| match std::fs::metadata(p) {
        Ok(m) => (m.ino(), m.modified().ok(), m.len()),
        Err(_) => (0, None, 0),
    })
}

/// The identity a [`super::Tls`] presents.
pub(super) struct Identity {
    current: RwLock<Arc<Pair>>,
    source: Option<Source>,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("reloaded_from", &self.source.as_ref().map(|s| &s.cert))
            .finish_non_exhaustive()
    }
}

impl Identity {
    /// `pair`, for good.
    pub(super) fn fixed(pair: Pair) -> Identity {
        Identity {
            current: RwLock::new(Arc::new(pair)),
            source: None,
        }
    }

    /// `pair`, read from `cert` and `key`, and read again when they change.
    pub(super) fn from_files(pair: Pair, cert: &Path, key: &Path) -> Identity {
        Identity {
            current: RwLock::new(Arc::new(pair)),
            source: Some(Source {
                cert: cert.to_owned(),
                key: key.to_owned(),
                seen: Mutex::new(Seen {
                    checked: Instant::now(),
                    stamp: stamp(cert, key),
                }),
            }),
        }
    }

    /// The pair to present now (read again first if its files changed).
    pub(super) fn current(&self) -> Arc<Pair> {
        self.refresh();
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// As though the files were last looked at over a second ago (a test's clock).
    #[cfg(test)]
    pub(super) fn look_again(&self) {
        if let Some(s) = &self.source {
            let mut seen = s.seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.checked = Instant::now() - 2 * CHECK_EVERY;
        }
    }

    /// Whether the files were last seen as they are now (a test's witness that a
    /// change was looked at).
    #[cfg(test)]
    pub(super) fn seen_as_they_are(&self) -> bool {
        self.source.as_ref().is_some_and(|s| {
            s.seen.lock().unwrap_or_else(|e| e.into_inner()).stamp == stamp(&s.cert, &s.key)
        })
    }

    fn refresh(&self) {
        let Some(s) = &self.source else {
            return;
        };
        let mut seen = s.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.checked.elapsed() < CHECK_EVERY {
            return;
        }
        seen.checked = Instant::now();
        let now = stamp(&s.cert, &s.key);
        if now == seen.stamp {
            return;
        }
        seen.stamp = now;
        let read = || -> Result<Pair, TlsError> {
            Pair::of(PemIdentity {
                cert: read_pem(&s.cert, "certificate")?,
                key: read_pem(&s.key, "key")?,
                cert_name: s.cert.display().to_string(),
                key_name: s.key.display().to_string(),
            })
        };
        match read() {
            Ok(pair) => {
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(pair);
                tracing::info!(cert = %s.cert.display(), "TLS: a new certificate, presented from now on");
            }
            Err(e) => tracing::warn!(
                error = %e,
                "TLS: the certificate or key file changed but cannot be used; the previous \
                 certificate is still presented"
            ),
        }
    }
}

/// [`Identity`] as rustls asks for it, on both sides.
#[derive(Debug)]
pub(super) struct Resolver(pub(super) Arc<Identity>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().key.clone())
    }
}

impl ResolvesClientCert for Resolver {
    fn resolve(&self, _: &[&[u8]], _: &[rustls::SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().key.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}
