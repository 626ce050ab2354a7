//! etcd's users and roles, for isolating jobs that share one etcd: each job gets a
//! user whose only role may read and write the job's prefix and nothing else.
//!
//! - [`EtcdBackend::enable_auth`] turns authentication on (as `etcdctl user add root &&
//!   etcdctl auth enable`), for an etcd that a tool started itself (`edl run`'s private
//!   etcd, tests).
//! - [`EtcdBackend::connect_as_root`] connects as root to an etcd a tool manages,
//!   turning authentication on first when it is still off (a job's managed etcd).
//! - [`EtcdBackend::grant_prefix`] creates (or resets) a user and a role of the same
//!   name with read-write permission on one key prefix; [`EtcdBackend::revoke_user`]
//!   deletes them. Both need a backend connected as a user that may manage users
//!   (`root`).
//!
//! etcd checks a permission on every request of an authenticated user: a key outside
//! the prefix is refused with `PermissionDenied` ([`Error::PermissionDenied`]).

use edl_proto::etcd::authpb;
use edl_proto::etcd::etcdserverpb::{self as pb, auth_client::AuthClient};

use super::codec::prefix_end;
use super::failure::{Failure, Resend};
use super::{EtcdAuth, EtcdBackend, EtcdConfig};
use crate::error::{Error, Result};

/// 32 random bytes in hex: a password or a token.
pub fn random_secret() -> String {
    (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

/// Whether etcd refused a login because its authentication is off
/// (`ErrAuthNotEnabled`).
fn auth_not_enabled(e: &Error) -> bool {
    e.to_string().contains("authentication is not enabled")
}

/// Whether etcd refused because the user or role already exists.
fn exists(f: &Failure) -> bool {
    f.error.to_string().contains("already exists")
}

impl EtcdBackend {
    /// Connects as `root` with `root_password` to an etcd that a tool manages (the
    /// operator's managed etcd of a job), over `tls` if given (`cfg.tls` otherwise),
    /// turning authentication on first with that password if it is still off (a new
    /// cluster). Safe to repeat after a failure at any step: the password is the one
    /// kept by the caller, and a root user already there keeps it.
    pub async fn connect_as_root(
        cfg: EtcdConfig,
        tls: Option<edl_proto::tls::Tls>,
        root_password: &str,
    ) -> Result<EtcdBackend> {
        let connect = |cfg: EtcdConfig| {
            let tls = tls.clone();
            async move {
                match tls {
                    Some(t) => EtcdBackend::connect_with_tls(cfg, t).await,
                    None => EtcdBackend::connect(cfg).await,
                }
            }
        };
        let open = EtcdConfig {
            auth: None,
            ..cfg.clone()
        };
        let root = cfg.with_auth("root", root_password);
        match connect(root.clone()).await {
            Err(e) if auth_not_enabled(&e) => {}
            done => return done,
        }
        connect(open).await?.enable_auth(root_password).await?;
        connect(root).await
    }

    /// Turns authentication on, with user `root` (role `root`) and `root_password`.
    /// Call it on an etcd without authentication, connected without credentials.
    pub async fn enable_auth(&self, root_password: &str) -> Result<()> {
        let password = root_password.to_owned();
        self.call("enable auth", Resend::IfNotSent, move |c| {
            let password = password.clone();
            async move {
                let mut auth = AuthClient::with_interceptor(c.channel.clone(), c.meta.clone());
                if let Err(s) = auth
                    .user_add(pb::AuthUserAddRequest {
                        name: "root".into(),
                        password,
                        ..Default::default()
                    })
                    .await
                {
                    let f = Failure::from(s);
                    if !exists(&f) {
                        return Err(f);
                    }
                }
                if let Err(s) = auth
                    .role_add(pb::AuthRoleAddRequest {
                        name: "root".into(),
                    })
                    .await
                {
                    let f = Failure::from(s);
                    if !exists(&f) {
                        return Err(f);
                    }
                }
                auth.user_grant_role(pb::AuthUserGrantRoleRequest {
                    user: "root".into(),
                    role: "root".into(),
                })
                .await?;
                auth.auth_enable(pb::AuthEnableRequest {}).await?;
                Ok(())
            }
        })
        .await
    }

    /// Creates user `user` with a new random password (or gives an existing one a new
    /// password), and a role of the same name that may read and write the keys under
    /// `prefix` and nothing else; the user's credentials. Needs a backend connected as a
    /// user that may manage users.
    pub async fn grant_prefix(&self, user: &str, prefix: &str) -> Result<EtcdAuth> {
        if prefix.is_empty() || user.is_empty() {
            return Err(Error::InvalidArgument(
                "a user and a non-empty prefix are needed".into(),
            ));
        }
        let password = random_secret();
        let (name, prefix, pw) = (user.to_owned(), prefix.to_owned(), password.clone());
        self.call("grant a prefix", Resend::IfNotSent, move |c| {
            let (user, prefix, password) = (name.clone(), prefix.clone(), pw.clone());
            async move {
                let mut auth = AuthClient::with_interceptor(c.channel.clone(), c.meta.clone());
                if let Err(s) = auth
                    .role_add(pb::AuthRoleAddRequest { name: user.clone() })
                    .await
                {
                    let f = Failure::from(s);
                    if !exists(&f) {
                        return Err(f);
                    }
                }
                auth.role_grant_permission(pb::AuthRoleGrantPermissionRequest {
                    name: user.clone(),
                    perm: Some(authpb::Permission {
                        perm_type: authpb::permission::Type::Readwrite as i32,
                        key: prefix.as_bytes().to_vec(),
                        range_end: prefix_end(prefix.as_bytes()),
                    }),
                })
                .await?;
                if let Err(s) = auth
                    .user_add(pb::AuthUserAddRequest {
                        name: user.clone(),
                        password: password.clone(),
                        ..Default::default()
                    })
                    .await
                {
                    let f = Failure::from(s);
                    if !exists(&f) {
                        return Err(f);
                    }
                    auth.user_change_password(pb::AuthUserChangePasswordRequest {
                        name: user.clone(),
                        password: password.clone(),
                        ..Default::default()
                    })
                    .await?;
                }
                auth.user_grant_role(pb::AuthUserGrantRoleRequest {
                    user: user.clone(),
                    role: user.clone(),
                })
                .await?;
                Ok(())
            }
        })
        .await?;
        Ok(EtcdAuth {
            user: user.to_owned(),
            password,
        })
    }

    /// Deletes user `user` and the role of the same name ([`grant_prefix`]'s), if they
    /// exist. Needs a backend connected as a user that may manage users.
    ///
    /// [`grant_prefix`]: EtcdBackend::grant_prefix
    pub async fn revoke_user(&self, user: &str) -> Result<()> {
        if user.is_empty() || user == "root" {
            return Err(Error::InvalidArgument(format!(
                "{user:?}: not a job's user"
            )));
        }
        let name = user.to_owned();
        self.call("delete a user", Resend::IfNotSent, move |c| {
            let user = name.clone();
            async move {
                let mut auth = AuthClient::with_interceptor(c.channel.clone(), c.meta.clone());
                if let Err(s) = auth
                    .user_delete(pb::AuthUserDeleteRequest { name: user.clone() })
                    .await
                {
                    let f = Failure::from(s);
                    if !missing(&f) {
                        return Err(f);
                    }
                }
                if let Err(s) = auth
                    .role_delete(pb::AuthRoleDeleteRequest { role: user.clone() })
                    .await
                {
                    let f = Failure::from(s);
                    if !missing(&f) {
                        return Err(f);
                    }
                }
                Ok(())
            }
        })
        .await
    }
}

/// Whether etcd refused because the user or role is not there.
fn missing(f: &Failure) -> bool {
    f.error.to_string().contains("not found")
}
