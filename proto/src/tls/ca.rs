//! [`LocalCa`]: a private CA and a job certificate, for `edl run --secure` and for the
//! operator's jobs.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use super::{TlsError, TlsFiles};

/// A private CA and one certificate it signed, for a job on this machine: valid for
/// `localhost`, `127.0.0.1` and `::1`, as a server and as a client.
pub struct LocalCa {
    /// The CA certificate (PEM).
    pub ca_pem: String,
    /// The job's certificate (PEM).
    pub cert_pem: String,
    /// The job certificate's private key (PEM, PKCS#8).
    pub key_pem: String,
    /// The CA's private key (PEM, PKCS#8), for whoever keeps the CA (the operator keeps
    /// it in the job's Secret); `edl run --secure` drops it.
    pub ca_key_pem: String,
}

impl fmt::Debug for LocalCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalCa").finish_non_exhaustive()
    }
}

impl LocalCa {
    /// A new CA and a certificate for `job` on this machine (`localhost`, `127.0.0.1`,
    /// `::1`), valid for 30 days.
    pub fn generate(job: &str) -> Result<LocalCa, TlsError> {
        let names = vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
        ];
        LocalCa::generate_for(job, names, 30)
    }

    /// A new CA and one certificate for `job`, valid for `names` (DNS names or IP
    /// addresses) as a server and as a client, for `days` days.
    pub fn generate_for(job: &str, names: Vec<String>, days: i64) -> Result<LocalCa, TlsError> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let err = |e: rcgen::Error| TlsError::new(format!("make a certificate: {e}"));
        let now = time::OffsetDateTime::now_utc();
        let (not_before, not_after) = (
            now - time::Duration::minutes(5),
            now + time::Duration::days(days),
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
        let ca_key_pem = ca_key.serialize_pem();
        let issuer = rcgen::Issuer::new(ca, ca_key);

        let mut leaf = CertificateParams::new(names).map_err(err)?;
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
            ca_key_pem,
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
