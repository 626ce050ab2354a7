//! The job's Secrets, made by the controller while it observes a live job: its
//! credentials (the job token and its own etcd user, made with the operator's admin
//! credentials on a shared etcd, as root on its managed etcd), its TLS Secret (a CA for
//! the job and its pods' certificate) and its managed etcd's root password. Each is made once and then used as it is; one left by an earlier job of
//! the same name (another owner) is replaced.

use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::{Api, Resource, ResourceExt};

use super::Ctx;
use crate::crd::TrainingJob;
use crate::objects::{
    CREDENTIAL_KEYS, ETCD_ROOT_KEY, TLS_KEYS, credentials_secret, credentials_secret_name,
    etcd_root_secret, etcd_root_secret_name, job_etcd_user, tls_domain, tls_names, tls_secret,
    tls_secret_name,
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

/// Secret `name` of `tj` as it is now: `None` when missing, or when one left by an
/// earlier job of the same name was there (it is deleted).
async fn own_secret(
    secrets: &Api<Secret>,
    tj: &TrainingJob,
    name: &str,
) -> Result<Option<Secret>, String> {
    let found = secrets
        .get_opt(name)
        .await
        .map_err(|e| format!("read Secret {name}: {e}"))?;
    match found {
        Some(s) if left_by_another_job(&s, tj) => {
            delete_secret(secrets, &s, name).await?;
            Ok(None)
        }
        found => Ok(found),
    }
}

/// Deletes `old`, Secret `name`, if it is still that one (its uid).
async fn delete_secret(secrets: &Api<Secret>, old: &Secret, name: &str) -> Result<(), String> {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: old.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match secrets.delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(format!("delete Secret {name} of an earlier job: {e}")),
    }
}

/// The job token in `secret`, if it holds one.
fn token_of(secret: &Secret) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(CREDENTIAL_KEYS[2])?;
    String::from_utf8(bytes.0.clone()).ok()
}

/// Makes sure the Secret with `tj`'s etcd credentials exists in `ns`: found (made by an
/// earlier round, or by hand), it is used as it is; missing, the job's etcd user is
/// created (or its password reset) with `admin` (the operator's admin user on a shared
/// etcd, root on the job's managed etcd) and the Secret made with it and a new token.
/// One left by an earlier job of the same name is replaced. Returns the job's token
/// (the operator asks the job's master with it).
pub(super) async fn ensure_credentials(
    ctx: &Ctx,
    admin: &edl_coord::EtcdBackend,
    tj: &TrainingJob,
    ns: &str,
    job: &JobName,
) -> Result<Option<String>, String> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let name = credentials_secret_name(&tj.name_any());
    if let Some(s) = own_secret(&secrets, tj, &name).await? {
        return Ok(token_of(&s));
    }
    let user = job_etcd_user(job.as_str());
    let auth = admin
        .grant_prefix(&user, JobKeys::new(job).root())
        .await
        .map_err(|e| {
            let who = if tj.spec.etcd.managed {
                "root on the job's managed etcd"
            } else {
                "the operator's --etcd-user must be one that may manage users, e.g. root"
            };
            format!(
                "create etcd user {user} for {}: {e} ({who})",
                JobKeys::new(job).root()
            )
        })?;
    let token = edl_coord::random_secret();
    match secrets
        .create(
            &PostParams::default(),
            &credentials_secret(tj, Some(&auth), &token),
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
                delete_secret(&secrets, &s, &name).await?;
            }
            Err(format!(
                "Secret {name} appeared while the operator made it (the password of etcd \
                 user {user} was reset)"
            ))
        }
        Err(e) => Err(format!("create Secret {name}: {e}")),
    }
}

/// The root password of `tj`'s managed etcd, from its Secret in `ns`; a new one (and
/// its Secret) when there is none yet and `create` (a live job). The Secret is made
/// before authentication is turned on with the password, so a password in use is
/// never lost with an operator that stops between the two.
pub(super) async fn etcd_root_password(
    ctx: &Ctx,
    tj: &TrainingJob,
    ns: &str,
    create: bool,
) -> Result<String, String> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let name = etcd_root_secret_name(&tj.name_any());
    let secret = match own_secret(&secrets, tj, &name).await? {
        Some(s) => s,
        None if create => secrets
            .create(
                &PostParams::default(),
                &etcd_root_secret(tj, &edl_coord::random_secret()),
            )
            .await
            .map_err(|e| format!("create Secret {name}: {e}"))?,
        None => return Err(format!("Secret {name} is gone")),
    };
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(ETCD_ROOT_KEY))
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
        .ok_or_else(|| {
            format!(
                "Secret {name} has no {ETCD_ROOT_KEY}: the managed etcd's root password is \
                 lost (its members and claims must be deleted for a new one)"
            )
        })
}

/// Makes sure `tj`'s TLS Secret exists in `ns`: found, it is used as it is; missing (or
/// left by an earlier job of the same name), a new CA and pod certificate are made into
/// it when `create` (a live job). Returns the job's TLS setup as the operator uses it
/// to ask the job's master and its managed etcd.
pub(super) async fn ensure_tls(
    ctx: &Ctx,
    tj: &TrainingJob,
    ns: &str,
    create: bool,
) -> Result<edl_proto::tls::Tls, String> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let job = tj.name_any();
    let name = tls_secret_name(&job);
    let secret = match own_secret(&secrets, tj, &name).await? {
        Some(s) => s,
        None if create => {
            let ca = edl_proto::tls::LocalCa::generate_for(&job, tls_names(&job, ns), TLS_DAYS)
                .map_err(|e| e.to_string())?;
            secrets
                .create(&PostParams::default(), &tls_secret(tj, &ca))
                .await
                .map_err(|e| format!("create Secret {name}: {e}"))?
        }
        None => return Err(format!("Secret {name} is gone")),
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
