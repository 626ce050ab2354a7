//! Failed attempts: etcd's gRPC statuses and transport errors mapped to [`Error`],
//! with whether the request certainly never left (so a write may be re-sent).

use crate::error::Error;

/// A failed attempt: the error, and whether the request certainly never left
/// (so even a write may be re-sent).
pub(super) struct Failure {
    pub(super) error: Error,
    pub(super) not_sent: bool,
    /// etcd refused the connection's auth token (expired): authenticate again and
    /// re-send (the request was not applied).
    pub(super) stale_token: bool,
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure {
            error,
            not_sent: false,
            stale_token: false,
        }
    }
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Self {
        status_failure(&s)
    }
}

/// Whether an attempt may be re-sent to another endpoint.
#[derive(Copy, Clone, PartialEq, Eq)]
pub(super) enum Resend {
    /// Reads, renewals, watch creation: re-sending is harmless.
    Always,
    /// Writes: only if the request never left.
    IfNotSent,
}

pub(super) fn status_failure(s: &tonic::Status) -> Failure {
    use std::error::Error as _;
    use tonic::Code;
    let mut not_sent = false;
    let mut source = s.source();
    while let Some(err) = source {
        if err.is::<tonic::ConnectError>() {
            not_sent = true;
            break;
        }
        source = err.source();
    }
    let mut msg = s.message().to_owned();
    if let Some(src) = s.source() {
        let chain = error_chain(src);
        if !msg.contains(&chain) {
            msg = if msg.is_empty() {
                chain
            } else {
                format!("{msg}: {chain}")
            };
        }
    }
    let error = match s.code() {
        // gRPC's own size limit (etcd's --max-request-bytes plus 512 KiB): the request
        // can never succeed, like etcd's "request is too large".
        Code::ResourceExhausted if msg.contains("larger than max") => {
            Error::InvalidArgument(format!("etcdserver: request is too large ({msg})"))
        }
        // etcd's ErrGRPCNoSpace: its NOSPACE alarm is raised (the same on every member).
        Code::ResourceExhausted if msg.contains("database space exceeded") => {
            Error::NoSpace { msg }
        }
        // etcd's Maintenance API returns its auth store's error unconverted (code
        // Unknown): a refusal, not an outage.
        Code::Unknown if msg.starts_with("auth: permission denied") => Error::PermissionDenied(msg),
        Code::Unavailable
        | Code::ResourceExhausted
        | Code::Unknown
        | Code::Cancelled
        | Code::Aborted
        | Code::DeadlineExceeded => Error::unavailable(String::new(), msg),
        Code::NotFound if msg.contains("lease not found") => Error::LeaseLost,
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            Error::InvalidArgument(msg)
        }
        Code::Unauthenticated | Code::PermissionDenied => Error::PermissionDenied(msg),
        code => Error::Etcd(format!("{code:?}: {msg}")),
    };
    // etcd's ErrGRPCInvalidAuthToken.
    let stale_token =
        s.code() == Code::Unauthenticated && s.message().contains("invalid auth token");
    Failure {
        error,
        not_sent,
        stale_token,
    }
}

/// An error with its root cause (transport errors say little alone).
pub(super) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut root = None;
    let mut source = e.source();
    while let Some(s) = source {
        root = Some(s);
        source = s.source();
    }
    if let Some(root) = root {
        let text = root.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

/// Fills in the endpoint of an `Unavailable` error.
pub(super) fn with_endpoint(mut e: Error, endpoint: &str) -> Error {
    if let Error::Unavailable { endpoints, .. } = &mut e {
        endpoints.retain(|s| !s.is_empty());
        if endpoints.is_empty() {
            endpoints.push(endpoint.to_owned());
        }
    }
    e
}

pub(super) fn unavailable_msg(e: &Error) -> String {
    match e {
        Error::Unavailable { msg, .. } => msg.clone(),
        other => other.to_string(),
    }
}
