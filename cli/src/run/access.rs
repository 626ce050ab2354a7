//! What the job's processes need to reach each other and etcd: the job token, TLS
//! between them, etcd's credentials and TLS. `edl run` gives the same [`Access`] to its
//! own clients and, through the environment (never the command line, which any local
//! user can read), to every child.
//!
//! `--secure` ([`secure`]) makes one for the job:
//! - a random job token;
//! - a private CA and a certificate for the job in `<run dir>/tls/` (the key mode 0600),
//!   with mutual TLS: masters and pservers accept only clients the CA signed;
//! - an etcd user `edl-job-<job>` whose only role may read and write `/edl/<job>/`,
//!   created with the admin credentials given (`--etcd-user`, `--etcd-password`), or on
//!   the private etcd, where authentication is turned on first with a random root
//!   password that only this process knows. `edl run` itself then works as the job's
//!   user.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use edl_coord::{EtcdAuth, EtcdBackend, EtcdConfig, EtcdTls};
use edl_job::{JobKeys, JobName};
use edl_master_client::MasterClientConfig;
use edl_proto::tls::{LocalCa, Tls, TlsFiles};
use edl_pserver_client::PsClientConfig;

/// The job token, TLS and etcd credentials of a run.
#[derive(Debug, Clone, Default)]
pub(crate) struct Access {
    /// The job token every RPC carries.
    pub token: Option<String>,
    /// TLS between the job's processes: the files (for the children) and the loaded
    /// setup (for this process).
    pub tls: Option<(TlsFiles, Tls)>,
    /// etcd's user and password.
    pub etcd_auth: Option<EtcdAuth>,
    /// TLS to etcd.
    pub etcd_tls: Option<EtcdTls>,
}

impl Access {
    /// The environment that gives a child this access (the variables of
    /// docs/trainer-api.md, read by `edl master`, `edl pserver` and `edl trainer` too).
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        let mut env: Vec<(&str, String)> = Vec::new();
        if let Some(t) = &self.token {
            env.push((edl_job::env::TOKEN, t.clone()));
        }
        if let Some((files, _)) = &self.tls {
            env.extend(files.to_vars());
        }
        if let Some(a) = &self.etcd_auth {
            env.push((edl_job::env::ETCD_USER, a.user.clone()));
            env.push((edl_job::env::ETCD_PASSWORD, a.password.clone()));
        }
        if let Some(t) = &self.etcd_tls {
            let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.display().to_string());
            for (k, v) in [
                (edl_job::env::ETCD_CA, path(&t.ca_file)),
                (edl_job::env::ETCD_CERT, path(&t.cert_file)),
                (edl_job::env::ETCD_KEY, path(&t.key_file)),
                (edl_job::env::ETCD_DOMAIN, t.domain.clone()),
            ] {
                if let Some(v) = v {
                    env.push((k, v));
                }
            }
        }
        env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
    }

    /// The etcd configuration for `endpoints` with these credentials.
    pub(crate) fn etcd_config(&self, endpoints: &[String]) -> EtcdConfig {
        let mut cfg = EtcdConfig::new(endpoints.iter().cloned());
        cfg.auth = self.etcd_auth.clone();
        cfg.tls = self.etcd_tls.clone();
        cfg
    }

    /// A master client's settings for `job`.
    pub(crate) fn master_client(&self, job: &JobName) -> MasterClientConfig {
        let mut cfg = MasterClientConfig::new(job.clone());
        cfg.token = self.token.clone();
        cfg.tls = self.tls.as_ref().map(|(_, t)| t.clone());
        cfg
    }

    /// A pserver client's settings for `job`.
    pub(crate) fn ps_client(&self, job: &JobName) -> PsClientConfig {
        let mut cfg = PsClientConfig::new(job.clone());
        cfg.token = self.token.clone();
        cfg.tls = self.tls.as_ref().map(|(_, t)| t.clone());
        cfg
    }

    /// The loaded TLS setup.
    pub(crate) fn tls(&self) -> Option<&Tls> {
        self.tls.as_ref().map(|(_, t)| t)
    }
}

/// The etcd user of `job` under `--secure`.
pub(crate) fn job_user(job: &JobName) -> String {
    format!("edl-job-{job}")
}

/// `--secure`: a token, a CA and certificate in `run_dir/tls`, and the job's own etcd
/// user, made with `admin` (connected as a user that may manage users). `base` is the
/// access given on the command line (its etcd TLS is kept).
pub(crate) async fn secure(
    admin: &EtcdBackend,
    job: &JobName,
    run_dir: &Path,
    base: &Access,
) -> anyhow::Result<Access> {
    let token = edl_coord::random_secret();
    let ca = LocalCa::generate(job.as_str())?;
    let dir = run_dir.join("tls");
    let files = ca
        .write(&dir)
        .with_context(|| format!("write the job's certificates into {}", dir.display()))?;
    let tls = files.load()?;
    let prefix = JobKeys::new(job).root().to_owned();
    let auth = admin
        .grant_prefix(&job_user(job), &prefix)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "--secure creates an etcd user for the job that may touch only {prefix}: {e} \
                 (give --etcd-user and --etcd-password of a user that may manage users, e.g. \
                 root; docs/security.md says how to create the user by hand instead)"
            )
        })?;
    Ok(Access {
        token: Some(token),
        tls: Some((files, tls)),
        etcd_auth: Some(auth),
        etcd_tls: base.etcd_tls.clone(),
    })
}

/// Turns authentication on in a private etcd that has none: a random root password,
/// kept in this process only; a backend connected as root.
pub(crate) async fn lock_private_etcd(endpoints: &[String]) -> anyhow::Result<Arc<EtcdBackend>> {
    let root = edl_coord::random_secret();
    let admin =
        EtcdBackend::connect_as_root(EtcdConfig::new(endpoints.iter().cloned()), None, &root)
            .await
            .map_err(crate::common::etcd_connect_error)?;
    Ok(Arc::new(admin))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_carries_every_secret_and_file() {
        let a = Access {
            token: Some("t0k".into()),
            tls: None,
            etcd_auth: Some(EtcdAuth {
                user: "u".into(),
                password: "p".into(),
            }),
            etcd_tls: Some(EtcdTls {
                ca_file: Some("/ca.pem".into()),
                cert_file: None,
                key_file: None,
                domain: Some("etcd.local".into()),
            }),
        };
        let env: std::collections::BTreeMap<String, String> = a.env().into_iter().collect();
        assert_eq!(env["EDL_JOB_TOKEN"], "t0k");
        assert_eq!(env["EDL_ETCD_USER"], "u");
        assert_eq!(env["EDL_ETCD_PASSWORD"], "p");
        assert_eq!(env["EDL_ETCD_CA"], "/ca.pem");
        assert_eq!(env["EDL_ETCD_DOMAIN"], "etcd.local");
        assert!(!env.contains_key("EDL_ETCD_CERT"));
        assert!(!env.contains_key("EDL_TLS_CA"));
        // The trainer API reads back what the children get.
        let vars = env.clone();
        let t = edl_trainer::Trainer::from_vars(|k| {
            vars.get(k).cloned().or_else(|| match k {
                "EDL_ETCD" => Some("http://127.0.0.1:1".into()),
                "EDL_JOB" => Some("j".into()),
                _ => None,
            })
        })
        .expect("the children's variables are a valid trainer configuration");
        assert_eq!(t.config().token.as_deref(), Some("t0k"));
        let etcd = t.etcd_config();
        assert_eq!(etcd.auth.as_ref().map(|a| a.user.as_str()), Some("u"));
        let tls = etcd.tls.as_ref().expect("etcd TLS");
        assert_eq!(tls.domain.as_deref(), Some("etcd.local"));
        assert_eq!(tls.ca_file.as_deref(), Some(Path::new("/ca.pem")));
    }
}
