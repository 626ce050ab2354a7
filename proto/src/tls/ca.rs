//! [`LocalCa`]: a private CA and a job certificate, for `edl run --secure` and for the
//! operator's jobs.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

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
        let ca = JobCa::generate(job, days)?;
        let leaf = ca.issue(
            &format!("edl job {job}"),
            names,
            CertUse::ServerAndClient,
            days,
        )?;
        Ok(LocalCa {
            ca_pem: ca.ca_pem,
            cert_pem: leaf.cert_pem,
            key_pem: leaf.key_pem,
            ca_key_pem: ca.ca_key_pem,
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

/// What a certificate is for: the extended key usages its peers check. A certificate
/// made for clients only cannot serve (a client refuses it in the handshake), which is
/// how a trainer's certificate is kept from posing as a pserver or a master.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertUse {
    /// Clients only (TLS client authentication).
    Client,
    /// Servers and clients.
    ServerAndClient,
}

/// A certificate [`JobCa::issue`] made, and its key (PEM).
pub struct Issued {
    /// The certificate (PEM).
    pub cert_pem: String,
    /// Its private key (PEM, PKCS#8).
    pub key_pem: String,
}

impl fmt::Debug for Issued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Issued").finish_non_exhaustive()
    }
}

/// A job's private CA (ECDSA P-256): its certificate and key, which issue the job's
/// certificates, one per role.
pub struct JobCa {
    /// The CA certificate (PEM).
    pub ca_pem: String,
    /// The CA's private key (PEM, PKCS#8): for whoever keeps the CA only.
    pub ca_key_pem: String,
}

impl fmt::Debug for JobCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobCa").finish_non_exhaustive()
    }
}

fn cert_err(e: rcgen::Error) -> TlsError {
    TlsError::new(format!("make a certificate: {e}"))
}

/// From five minutes ago (clocks differ) to `days` days from now.
fn validity(days: i64) -> (time::OffsetDateTime, time::OffsetDateTime) {
    let now = time::OffsetDateTime::now_utc();
    (
        now - time::Duration::minutes(5),
        now + time::Duration::days(days),
    )
}

impl JobCa {
    /// A new CA for `job`, valid for `days` days, that signs certificates only (no
    /// intermediate CA under it).
    pub fn generate(job: &str, days: i64) -> Result<JobCa, TlsError> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(cert_err)?;
        ca.distinguished_name
            .push(DnType::CommonName, format!("edl job CA {job}"));
        ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        (ca.not_before, ca.not_after) = validity(days);
        let key = KeyPair::generate().map_err(cert_err)?;
        let cert = ca.self_signed(&key).map_err(cert_err)?;
        Ok(JobCa {
            ca_pem: cert.pem(),
            ca_key_pem: key.serialize_pem(),
        })
    }

    /// The CA of `ca_pem` with its key `ca_key_pem` (as [`JobCa::generate`] made them,
    /// or an earlier [`LocalCa`]'s); `Err` says which does not read.
    pub fn from_pem(ca_pem: &str, ca_key_pem: &str) -> Result<JobCa, TlsError> {
        let key = rcgen::KeyPair::from_pem(ca_key_pem)
            .map_err(|e| TlsError::new(format!("the CA's key does not read: {e}")))?;
        rcgen::Issuer::from_ca_cert_pem(ca_pem, key)
            .map_err(|e| TlsError::new(format!("the CA's certificate does not read: {e}")))?;
        Ok(JobCa {
            ca_pem: ca_pem.to_owned(),
            ca_key_pem: ca_key_pem.to_owned(),
        })
    }

    /// A new certificate and key named `common_name`, valid for `names` (DNS names,
    /// wildcards or IP addresses) for `usage`, for `days` days (never past the CA's
    /// end), signed by this CA.
    pub fn issue(
        &self,
        common_name: &str,
        names: Vec<String>,
        usage: CertUse,
        days: i64,
    ) -> Result<Issued, TlsError> {
        let (from, until) = validity(days);
        self.issue_between(common_name, names, usage, from.into(), until.into())
    }

    /// As [`JobCa::issue`], valid from `from` until `until` (never past the CA's end):
    /// a certificate as though issued earlier, such as one close to its end.
    pub fn issue_between(
        &self,
        common_name: &str,
        names: Vec<String>,
        usage: CertUse,
        from: SystemTime,
        until: SystemTime,
    ) -> Result<Issued, TlsError> {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose};
        let ca_key = KeyPair::from_pem(&self.ca_key_pem).map_err(cert_err)?;
        let issuer = rcgen::Issuer::from_ca_cert_pem(&self.ca_pem, ca_key).map_err(cert_err)?;
        let mut leaf = CertificateParams::new(names).map_err(cert_err)?;
        leaf.distinguished_name
            .push(DnType::CommonName, common_name.to_owned());
        leaf.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        leaf.extended_key_usages = match usage {
            CertUse::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
            CertUse::ServerAndClient => vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        };
        // Never past the CA's own end: such a certificate would not verify then.
        let (_, ca_ends) = validity_of(&self.ca_pem)?;
        (leaf.not_before, leaf.not_after) = (from.into(), until.min(ca_ends).into());
        let key = KeyPair::generate().map_err(cert_err)?;
        let cert = leaf.signed_by(&key, &issuer).map_err(cert_err)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// When the first certificate in `pem` starts and ends being valid.
pub fn validity_of(pem: &str) -> Result<(SystemTime, SystemTime), TlsError> {
    let der = super::certs(pem.as_bytes(), "certificate")?;
    let first = der
        .first()
        .ok_or_else(|| TlsError::new("no certificate in PEM"))?;
    let (_, cert) = x509_parser::parse_x509_certificate(first.as_ref())
        .map_err(|e| TlsError::new(format!("the certificate does not parse: {e}")))?;
    let v = cert.validity();
    Ok((
        v.not_before.to_datetime().into(),
        v.not_after.to_datetime().into(),
    ))
}

/// What to do about a certificate a job's CA issued, at a given time (see [`renewal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// More than a third of its life is left.
    Keep,
    /// A third of its life or less is left (or it has ended): issue it again.
    Renew,
    /// It is due, but it already ends with its CA (at the time given): a certificate
    /// issued again would end no later, so only a new CA helps.
    CaEnds(SystemTime),
}

/// Whether `leaf_pem`, issued by the CA `ca_pem`, is to be issued again at `now`: once
/// no more than a third of its life is left (cert-manager's default), so a renewal that
/// fails is tried again for weeks before anything stops working. A certificate that
/// already ends within a minute of its CA's end is not renewed (a new one could not
/// outlive the CA either): [`Renewal::CaEnds`].
pub fn renewal(leaf_pem: &str, ca_pem: &str, now: SystemTime) -> Result<Renewal, TlsError> {
    let (start, end) = validity_of(leaf_pem)?;
    let life = end.duration_since(start).unwrap_or_default();
    let left = end.duration_since(now).unwrap_or_default();
    if left > life / 3 {
        return Ok(Renewal::Keep);
    }
    let (_, ca_ends) = validity_of(ca_pem)?;
    if end + Duration::from_secs(60) >= ca_ends {
        return Ok(Renewal::CaEnds(ca_ends));
    }
    Ok(Renewal::Renew)
}
