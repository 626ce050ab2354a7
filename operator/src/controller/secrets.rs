//! The job's Secrets, made by the controller while it observes a live job: its
//! credentials (the job token, and on a shared etcd its own etcd user, made with the
//! operator's admin credentials) and its TLS Secret (a CA for the job and its pods'
//! certificate). Each is made once and then used as it is; one left by an earlier job of
//! the same name (another owner) is replaced.

use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::{Api, Resource, ResourceExt};

use super::Ctx;
use crate::crd::TrainingJob;
use crate::objects::{
    CREDENTIAL_KEYS, TLS_KEYS, credentials_secret, credentials_secret_name, job_etcd_user,
    tls_domain, tls_secret, tls_secret_name,
};
use edl_job::{JobKeys, JobName};

/// Whether `secret` was left by an earlier TrainingJob of the same name (owned by a
/// TrainingJob that is not `tj`): its user's password is not to be trusted.
fn left_by_another_job(secret: &Secret, tj: &TrainingJob) -> bool {
    let refs = secret
        .metadata
        .owner_references
        .as_deref()
        .unwrap_or_default();
    let kind = TrainingJob::kind(&());
    refs.iter().any(|r| r.kind == kind) && !refs.iter().any(|r| Some(&r.uid) == tj.uid().as_ref())
}

/// The job token in `secret`, if it holds one.
fn token_of(secret: &Secret) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(CREDENTIAL_KEYS[2])?;
    String::from_utf8(bytes.0.clone()).ok()
}

/// Makes sure the Secret with `tj`'s etcd credentials exists in `ns`: found (made by an
/// earlier round, or by hand), it is used as it is; missing, the job's etcd user is
/// created (or its password reset) and the Secret made with it and a new token. One
/// left by an earlier job of the same name is replaced. Returns the job's token (the
/// operator asks the job's master with it).
pub(super) async fn ensure_credentials(
    ctx: &Ctx,
    tj: &TrainingJob,
    ns: &str,
    job: &JobName,
) -> Result<Option<String>, String> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let name = credentials_secret_name(job.as_str());
    let remove = |old: Secret| {
        let secrets = secrets.clone();
        let name = name.clone();
        async move {
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: old.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match secrets.delete(&name, &params).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(format!("delete Secret {name} of an earlier job: {e}")),
            }
        }
    };
    match secrets
        .get_opt(&name)
        .await
        .map_err(|e| format!("read Secret {name}: {e}"))?
    {
        Some(s) if left_by_another_job(&s, tj) => remove(s).await?,
        Some(s) => return Ok(token_of(&s)),
        None => {}
    }
    let user = job_etcd_user(job.as_str());
    // A managed etcd runs without users: the job's Secret holds its token only.
    let auth = if tj.spec.etcd.managed {
        None
    } else {
        let admin = ctx.backend(tj).await?;
        let auth = admin
            .grant_prefix(&user, JobKeys::new(job).root())
            .await
            .map_err(|e| {
                format!(
                    "create etcd user {user} for {}: {e} (the operator's --etcd-user must be \
                     one that may manage users, e.g. root)",
                    JobKeys::new(job).root()
                )
            })?;
        Some(auth)
    };
    let token = edl_coord::random_secret();
    match secrets
        .create(
            &PostParams::default(),
            &credentials_secret(tj, auth.as_ref(), &token),
        )
        .await
    {
        Ok(_) => Ok(Some(token)),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            // Made meanwhile (another replica): its password was just reset, so an own
            // one goes and the next round makes it again.
            if let Some(s) = secrets.get_opt(&name).await.ok().flatten()
                && s.metadata
                    .owner_references
                    .as_deref()
                    .unwrap_or_default()
                    .iter()
                    .any(|r| Some(&r.uid) == tj.uid().as_ref())
            {
                remove(s).await?;
            }
            Err(format!(
                "Secret {name} appeared while the operator made it (the password of etcd \
                 user {user} was reset)"
            ))
        }
        Err(e) => Err(format!("create Secret {name}: {e}")),
    }
}

/// Makes sure `tj`'s TLS Secret exists in `ns`: found, it is used as it is; missing (or
/// left by an earlier job of the same name), a new CA and pod certificate are made into
/// it. Returns the job's TLS setup as the operator uses it to ask the job's master.
pub(super) async fn ensure_tls(
    ctx: &Ctx,
    tj: &TrainingJob,
    ns: &str,
) -> Result<edl_proto::tls::Tls, String> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let job = tj.name_any();
    let name = tls_secret_name(&job);
    let found = secrets
        .get_opt(&name)
        .await
        .map_err(|e| format!("read Secret {name}: {e}"))?;
    let secret = match found {
        Some(s) if !left_by_another_job(&s, tj) => s,
        stale => {
            if let Some(old) = stale {
                let params = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: old.metadata.uid.clone(),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                match secrets.delete(&name, &params).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(format!("delete Secret {name} of an earlier job: {e}")),
                }
            }
            let ca =
                edl_proto::tls::LocalCa::generate_for(&job, vec![tls_domain(&job, ns)], TLS_DAYS)
                    .map_err(|e| e.to_string())?;
            secrets
                .create(&PostParams::default(), &tls_secret(tj, &ca))
                .await
                .map_err(|e| format!("create Secret {name}: {e}"))?
        }
    };
    let value = |k: &str| -> Result<Vec<u8>, String> {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|b| b.0.clone())
            .ok_or_else(|| format!("Secret {name} has no {k}: delete it for a new one"))
    };
    let identity = edl_proto::tls::PemIdentity {
        cert: value(TLS_KEYS[1])?,
        key: value(TLS_KEYS[2])?,
        cert_name: format!("Secret {name} {}", TLS_KEYS[1]),
        key_name: format!("Secret {name} {}", TLS_KEYS[2]),
    };
    edl_proto::tls::Tls::from_pem(
        &value(TLS_KEYS[0])?,
        &format!("Secret {name} {}", TLS_KEYS[0]),
        Some(identity),
        Some(tls_domain(&job, ns)),
        true,
    )
    .map_err(|e| format!("{e} (delete Secret {name} for a new one)"))
}

/// How long the certificates of a job's TLS Secret are valid.
const TLS_DAYS: i64 = 365;
