//! The operator's clients of the jobs' etcds: a shared etcd as the operator's admin
//! user, a job's managed etcd as its root over the job's TLS (turning authentication on
//! when the members are new), one client kept per endpoints and password.

use std::sync::Arc;

use edl_coord::{EtcdBackend, EtcdConfig};
use kube::ResourceExt;

use super::{Ctx, config, secrets};
use crate::crd::TrainingJob;
use crate::objects::etcd_endpoints;

impl Ctx {
    /// The client of `tj`'s etcd: at its endpoints as [`ControllerConfig::resolve`]
    /// maps them; on a shared etcd as the operator's admin user, on the job's managed
    /// etcd as its root (over the job's `tls`), turning its authentication on first
    /// when the members are new.
    pub(super) async fn backend(
        &self,
        tj: &TrainingJob,
        tls: Option<&edl_proto::tls::Tls>,
    ) -> Result<Arc<EtcdBackend>, String> {
        let endpoints: Vec<String> = etcd_endpoints(tj)
            .iter()
            .map(|e| (self.config.resolve.0)(e))
            .collect();
        if !tj.spec.etcd.managed {
            self.check_shared_endpoints(tj)?;
            let login = Login::Admin(self.config.etcd_auth.clone());
            return self.connect(endpoints, login).await;
        }
        if !tj.spec.plaintext && tls.is_none() {
            return Err("the job's TLS Secret is not there yet".to_owned());
        }
        let ns = tj.namespace().unwrap_or_else(|| "default".to_owned());
        let password = secrets::etcd_root_password(self, tj, &ns, tj.is_live()).await?;
        self.connect(endpoints, Login::Root { password, tls }).await
    }

    /// Whether the operator may log in to `tj`'s shared etcd: a job names its endpoints,
    /// so the operator's credentials go only where its own configuration says they
    /// belong ([`ControllerConfig::etcd_endpoints`]); an error says why not. Always `Ok`
    /// for a managed etcd, and without credentials (none are sent).
    ///
    /// [`ControllerConfig::etcd_endpoints`]: super::ControllerConfig::etcd_endpoints
    pub(super) fn check_shared_endpoints(&self, tj: &TrainingJob) -> Result<(), String> {
        if tj.spec.etcd.managed || self.config.etcd_auth.is_none() {
            return Ok(());
        }
        config::check_endpoints(&tj.spec.etcd.endpoints, &self.config.etcd_endpoints)
    }

    /// A client of `endpoints` logged in as `login`, kept for the next round.
    async fn connect(
        &self,
        endpoints: Vec<String>,
        login: Login<'_>,
    ) -> Result<Arc<EtcdBackend>, String> {
        let password = match &login {
            Login::Admin(auth) => auth.as_ref().map(|a| a.password.clone()),
            Login::Root { password, .. } => Some(password.clone()),
        };
        let key = (endpoints.clone(), password.unwrap_or_default());
        if let Some(b) = self
            .etcd
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return Ok(b.clone());
        }
        let mut cfg = EtcdConfig::new(endpoints.iter().cloned());
        cfg.request_timeout = self.config.etcd_timeout;
        cfg.dial_timeout = self.config.etcd_timeout;
        let connected = match login {
            Login::Admin(auth) => {
                cfg.auth = auth;
                cfg.tls = self.config.etcd_tls.clone();
                EtcdBackend::connect(cfg).await
            }
            Login::Root { password, tls } => {
                EtcdBackend::connect_as_root(cfg, tls.cloned(), &password).await
            }
        };
        let backend = Arc::new(connected.map_err(|e| format!("{} ({})", e, endpoints.join(",")))?);
        self.etcd
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, backend.clone());
        Ok(backend)
    }
}

/// A kept etcd client's endpoints and its user's password.
pub(super) type EtcdKey = (Vec<String>, String);

/// How the operator logs in to a job's etcd.
enum Login<'a> {
    /// A shared etcd: as the operator's admin user, if it has one.
    Admin(Option<edl_coord::EtcdAuth>),
    /// The job's managed etcd: as root, over the job's TLS (none: `plaintext`).
    Root {
        password: String,
        tls: Option<&'a edl_proto::tls::Tls>,
    },
}
