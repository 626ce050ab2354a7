//! The job's Secrets, made by the controller while it observes a live job: its
//! credentials (the job token and its own etcd user, made with the operator's admin
//! credentials on a shared etcd, as root on its managed etcd), its TLS Secrets (a CA
//! for the job with the operator's certificate, and one certificate per role) and its
//! managed etcd's root password. Each is made once and then used as it is; one left by an earlier job of
//! the same name (another owner) is replaced.

use std::collections::BTreeMap;

use edl_proto::tls::{JobCa, Renewal};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::{Api, Resource, ResourceExt};

use super::Ctx;
use crate::crd::TrainingJob;
use crate::objects::{
    CA_KEYS, CREDENTIAL_KEYS, ETCD_ROOT_KEY, JOB_LABEL, LEGACY_CA_KEY, Role, TLS_KEYS, ca_secret,
    ca_secret_name, credentials_secret, credentials_secret_name, etcd_root_secret,
    etcd_root_secret_name, job_etcd_user, legacy_tls_secret_name, metrics_secret,
    metrics_secret_name, role_certificate, tls_domain, tls_secret, tls_secret_name,
};
use crate::reconcile::TlsRenewals;
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

/// The namespace of `tj`.
fn namespace_of(tj: &TrainingJob) -> String {
    tj.namespace().unwrap_or_else(|| "default".to_owned())
}

/// What a request about the Secrets of namespace `ns` (`what`) failing with `e` says:
/// a refusal (403) also says how an administrator grants the operator that namespace's
/// Secrets, which each namespace needs once (docs/kubernetes.md, "RBAC").
fn secrets_error(what: &str, ns: &str, e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "{what}: {e}. The operator may not manage Secrets in namespace {ns}: bind its \
             edl-operator-credentials ClusterRole there (with deploy/'s names: kubectl -n \
             {ns} create rolebinding edl-operator-credentials --clusterrole \
             edl-operator-credentials --serviceaccount edl-system:edl-operator \
             --dry-run=client -o yaml | kubectl apply -f -)"
        ),
        _ => format!("{what}: {e}"),
    }
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
        .map_err(|e| secrets_error(&format!("read Secret {name}"), &namespace_of(tj), &e))?;
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
        Err(e) => Err(secrets_error(
            &format!("delete Secret {name} of an earlier job"),
            old.metadata.namespace.as_deref().unwrap_or("default"),
            &e,
        )),
    }
}

/// The job token in `secret`, if it holds one.
fn token_of(secret: &Secret) -> Option<String> {
    secret_text(secret, CREDENTIAL_KEYS[2])
}

/// The value of `key` in `secret`, if it is there and is text.
fn secret_text(secret: &Secret, key: &str) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(key)?;
    String::from_utf8(bytes.0.clone()).ok()
}

/// Makes sure the Secret with `tj`'s etcd credentials exists in `ns`: found (made by an
/// earlier round, or by hand), it is used as it is; missing, the job's etcd user is
/// created (or its password reset) with `admin` (the operator's admin user on a shared
/// etcd, root on the job's managed etcd) and the Secret made with it and a new token.
/// One left by an earlier job of the same name is replaced. Then its metrics Secret
/// ([`ensure_metrics_token`]). Returns the job's token (the operator asks the job's
/// master with it).
pub(super) async fn ensure_credentials(
    ctx: &Ctx,
    admin: &edl_coord::EtcdBackend,
    tj: &TrainingJob,
    ns: &str,
    job: &JobName,
) -> Result<Option<String>, String> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let token = job_credentials(&secrets, admin, tj, job).await?;
    ensure_metrics_token(&secrets, tj).await?;
    Ok(token)
}

/// Makes sure `tj`'s metrics Secret exists: the scrape-only token its processes take
/// (`EDL_METRICS_TOKEN`) and a scraper is given, instead of the job token. Found, it
/// is used as it is; one left by an earlier job of the same name is replaced.
async fn ensure_metrics_token(secrets: &Api<Secret>, tj: &TrainingJob) -> Result<(), String> {
    let name = metrics_secret_name(&tj.name_any());
    if own_secret(secrets, tj, &name).await?.is_some() {
        return Ok(());
    }
    let made = metrics_secret(tj, &edl_coord::random_secret());
    match secrets.create(&PostParams::default(), &made).await {
        Ok(_) => Ok(()),
        // Made meanwhile (another replica): that one is used.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(secrets_error(
            &format!("create Secret {name}"),
            &namespace_of(tj),
            &e,
        )),
    }
}

/// The job's credentials Secret (see [`ensure_credentials`]).
async fn job_credentials(
    secrets: &Api<Secret>,
    admin: &edl_coord::EtcdBackend,
    tj: &TrainingJob,
    job: &JobName,
) -> Result<Option<String>, String> {
    let name = credentials_secret_name(&tj.name_any());
    if let Some(s) = own_secret(secrets, tj, &name).await? {
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
                delete_secret(secrets, &s, &name).await?;
            }
            Err(format!(
                "Secret {name} appeared while the operator made it (the password of etcd \
                 user {user} was reset)"
            ))
        }
        Err(e) => Err(secrets_error(
            &format!("create Secret {name}"),
            &namespace_of(tj),
            &e,
        )),
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
            .map_err(|e| secrets_error(&format!("create Secret {name}"), ns, &e))?,
        None => return Err(format!("Secret {name} is gone")),
    };
    secret_text(&secret, ETCD_ROOT_KEY).ok_or_else(|| {
        format!(
            "Secret {name} has no {ETCD_ROOT_KEY}: the managed etcd's root password is \
                 lost (its members and claims must be deleted for a new one)"
        )
    })
}

/// Makes sure `tj`'s TLS Secrets exist in `ns`: its CA Secret (the CA and the
/// operator's certificate) and one per role (the role's certificate; the managed
/// etcd's only when it has one). Found, each is used as it is; missing (or left by an
/// earlier job of the same name) and `create` (a live job), it is made: the CA anew, or
/// taken from the one Secret an earlier operator made for every role
/// (`<job>-edl-tls`), so the pods that mount that go on talking with new ones; a
/// role's certificate issued by the CA. One list of the job's Secrets a round. Returns
/// the job's TLS as the operator uses it to ask the job's master and its managed etcd.
pub(super) async fn ensure_tls(
    ctx: &Ctx,
    tj: &TrainingJob,
    ns: &str,
    create: bool,
) -> Result<(edl_proto::tls::Tls, TlsRenewals), String> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let job = tj.name_any();
    let found = secrets
        .list(&ListParams::default().labels(&format!("{JOB_LABEL}={job}")))
        .await
        .map_err(|e| secrets_error("list the job's Secrets", ns, &e))?;
    let mut own = BTreeMap::new();
    for s in found.items {
        let name = s.name_any();
        if left_by_another_job(&s, tj) {
            delete_secret(&secrets, &s, &name).await?;
        } else {
            own.insert(name, s);
        }
    }
    let ca_name = ca_secret_name(&job);
    let ca_secret = match own.get(&ca_name) {
        Some(s) => s.clone(),
        None if create => {
            let ca = match legacy_ca(&own, &job)? {
                Some(ca) => ca,
                None => {
                    JobCa::generate(&format!("{ns}.{job}"), CA_DAYS).map_err(|e| e.to_string())?
                }
            };
            let (cn, names, usage) = role_certificate(&job, ns, None);
            let operator = ca
                .issue(&cn, names, usage, LEAF_DAYS)
                .map_err(|e| e.to_string())?;
            secrets
                .create(&PostParams::default(), &ca_secret(tj, &ca, &operator))
                .await
                .map_err(|e| secrets_error(&format!("create Secret {ca_name}"), ns, &e))?
        }
        // An ended job an earlier operator made: its one Secret has a certificate the
        // operator may use to reach the job's managed etcd.
        None => match own.get(&legacy_tls_secret_name(&job)) {
            // The one certificate of every pod: a client's too.
            Some(legacy) => {
                let name = legacy_tls_secret_name(&job);
                let tls = tls_of(legacy, &name, TLS_KEYS, &job, ns)?;
                return Ok((tls, TlsRenewals::default()));
            }
            None => return Err(format!("Secret {ca_name} is gone")),
        },
    };
    let value = |k: &str| -> Result<Vec<u8>, String> {
        ca_secret
            .data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|b| b.0.clone())
            .ok_or_else(|| format!("Secret {ca_name} has no {k}: delete it for a new one"))
    };
    let text = |k: &str| -> Result<String, String> {
        String::from_utf8(value(k)?).map_err(|_| format!("Secret {ca_name} {k} is not text"))
    };
    if create {
        let roles = Role::ALL
            .into_iter()
            .filter(|r| *r != Role::Etcd || tj.spec.etcd.managed);
        let mut ca = None;
        for role in roles {
            let name = tls_secret_name(&job, role);
            if own.contains_key(&name) {
                continue;
            }
            if ca.is_none() {
                ca = Some(
                    JobCa::from_pem(&text(CA_KEYS[0])?, &text(CA_KEYS[1])?)
                        .map_err(|e| format!("Secret {ca_name}: {e}"))?,
                );
            }
            let ca = ca.as_ref().expect("read above");
            let (cn, names, usage) = role_certificate(&job, ns, Some(role));
            let issued = ca
                .issue(&cn, names, usage, LEAF_DAYS)
                .map_err(|e| e.to_string())?;
            match secrets
                .create(
                    &PostParams::default(),
                    &tls_secret(tj, role, &ca.ca_pem, &issued),
                )
                .await
            {
                Ok(_) => {}
                // Made meanwhile (another replica), from the same CA.
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(secrets_error(&format!("create Secret {name}"), ns, &e)),
            }
        }
    }
    let (ca_secret, renewals) = renew_certificates(&secrets, tj, ca_secret, &own, ns).await?;
    let tls = tls_of(
        &ca_secret,
        &ca_name,
        [CA_KEYS[0], CA_KEYS[2], CA_KEYS[3]],
        &job,
        ns,
    )
    .map_err(|e| format!("{e} (delete Secret {ca_name} for a new one)"))?;
    Ok((tls, renewals))
}

/// Issues again each of `tj`'s certificates that has a third of its life left or less
/// (every role's Secret among `own`, and the operator's own in `ca_secret`), from the
/// job's CA, and replaces its Secret: an update at the Secret's resourceVersion, so of
/// two replicas renewing at once one wins (409) and the other keeps the winner's. A
/// role's pods see the new files once the kubelet refreshes their Secret volume (within
/// about a minute on a real cluster) and present the new certificate from their next
/// handshake (edl-proto reads its files again when they change; etcd reads them at
/// each handshake): no restart. Returns the CA Secret as it is now, with what was done.
async fn renew_certificates(
    secrets: &Api<Secret>,
    tj: &TrainingJob,
    mut ca_secret: Secret,
    own: &BTreeMap<String, Secret>,
    ns: &str,
) -> Result<(Secret, TlsRenewals), String> {
    let job = tj.name_any();
    let ca_name = ca_secret_name(&job);
    let Some(ca_pem) = secret_text(&ca_secret, CA_KEYS[0]) else {
        return Err(format!(
            "Secret {ca_name} has no {}: delete it for a new one",
            CA_KEYS[0]
        ));
    };
    // Needed only to renew one (a CA Secret made by hand may lack it).
    let ca_key = secret_text(&ca_secret, CA_KEYS[1]);
    let now = std::time::SystemTime::now();
    let mut renewals = TlsRenewals::default();
    // (the Secret, its role: None for the operator's, its certificate's and key's keys)
    let mut held: Vec<(Secret, Option<Role>, [&str; 2])> =
        vec![(ca_secret.clone(), None, [CA_KEYS[2], CA_KEYS[3]])];
    for role in Role::ALL {
        if let Some(s) = own.get(&tls_secret_name(&job, role)) {
            held.push((s.clone(), Some(role), [TLS_KEYS[1], TLS_KEYS[2]]));
        }
    }
    let mut ca = None;
    for (mut secret, role, [cert_key, key_key]) in held {
        let name = secret.name_any();
        let Some(cert) = secret_text(&secret, cert_key) else {
            continue;
        };
        match edl_proto::tls::renewal(&cert, &ca_pem, now) {
            Ok(Renewal::Keep) => continue,
            Ok(Renewal::CaEnds(ends)) => {
                renewals.ca_ends = Some(rfc3339(ends));
                continue;
            }
            Ok(Renewal::Renew) => {}
            // Not ours to read (made by hand): left as it is.
            Err(e) => {
                tracing::warn!(job = %job, secret = %name, error = %e, "a certificate that does not read is not renewed");
                continue;
            }
        }
        if ca.is_none() {
            let Some(key) = &ca_key else {
                // Made by hand without it: what is there is used until it ends.
                tracing::warn!(
                    job = %job,
                    secret = %name,
                    "a certificate is due for renewal, but the job's CA Secret has no key"
                );
                continue;
            };
            let read = JobCa::from_pem(&ca_pem, key);
            ca = Some(read.map_err(|e| format!("Secret {ca_name}: {e}"))?);
        }
        let ca = ca.as_ref().expect("read above");
        let (cn, names, usage) = role_certificate(&job, ns, role);
        let issued = ca
            .issue(&cn, names, usage, LEAF_DAYS)
            .map_err(|e| e.to_string())?;
        let data = secret.data.get_or_insert_with(BTreeMap::new);
        data.insert(
            cert_key.to_owned(),
            ByteString(issued.cert_pem.clone().into_bytes()),
        );
        data.insert(key_key.to_owned(), ByteString(issued.key_pem.into_bytes()));
        match secrets
            .replace(&name, &PostParams::default(), &secret)
            .await
        {
            Ok(replaced) => {
                let ends = edl_proto::tls::validity_of(&issued.cert_pem)
                    .map(|(_, end)| rfc3339(end))
                    .unwrap_or_default();
                tracing::info!(job = %job, secret = %name, until = %ends, "certificate renewed");
                renewals.renewed.push((name, ends));
                if role.is_none() {
                    ca_secret = replaced;
                }
            }
            // Renewed meanwhile (another replica): the next round reads that one.
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => {
                return Err(secrets_error(
                    &format!("renew the certificate in Secret {name}"),
                    ns,
                    &e,
                ));
            }
        }
    }
    Ok((ca_secret, renewals))
}

/// `t` as RFC 3339 (UTC).
fn rfc3339(t: std::time::SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| format!("{t:?}"))
}

/// The operator's TLS to `job` (in `ns`) from `secret` (named `name`): the CA's
/// certificate and the operator's certificate and key under `keys`, in that order.
fn tls_of(
    secret: &Secret,
    name: &str,
    [ca, cert, key]: [&str; 3],
    job: &str,
    ns: &str,
) -> Result<edl_proto::tls::Tls, String> {
    let value = |k: &str| -> Result<Vec<u8>, String> {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|b| b.0.clone())
            .ok_or_else(|| format!("Secret {name} has no {k}"))
    };
    let identity = edl_proto::tls::PemIdentity {
        cert: value(cert)?,
        key: value(key)?,
        cert_name: format!("Secret {name} {cert}"),
        key_name: format!("Secret {name} {key}"),
    };
    edl_proto::tls::Tls::from_pem(
        &value(ca)?,
        &format!("Secret {name} {ca}"),
        Some(identity),
        Some(tls_domain(job, ns)),
        true,
    )
    .map_err(|e| e.to_string())
}

/// The CA of the one TLS Secret an earlier operator made for every role of `job`
/// (`<job>-edl-tls`, among `own`), if there is one.
fn legacy_ca(own: &BTreeMap<String, Secret>, job: &str) -> Result<Option<JobCa>, String> {
    let name = legacy_tls_secret_name(job);
    let Some(s) = own.get(&name) else {
        return Ok(None);
    };
    match (secret_text(s, TLS_KEYS[0]), secret_text(s, LEGACY_CA_KEY)) {
        (Some(ca), Some(key)) => JobCa::from_pem(&ca, &key)
            .map(Some)
            .map_err(|e| format!("Secret {name} (an earlier operator's): {e}")),
        // Without its key, the CA cannot issue: a new one (the pods that mount the
        // old Secret cannot talk with new ones, as before when it was lost).
        _ => Ok(None),
    }
}

/// How long a job's CA is valid: longer than any job runs, as its certificates cannot
/// outlive it and replacing it means new Secrets for every pod.
const CA_DAYS: i64 = 3650;

/// How long the certificates a job's CA issues are valid; each is issued again with a
/// third of its life left ([`renew_certificates`]).
const LEAF_DAYS: i64 = 90;
