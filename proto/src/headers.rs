//! The one metadata scheme of edl's gRPC services (the master's and the pservers'):
//! every key is `x-edl-<name>`.
//!
//! - On requests: who is asking — [`JOB`] and, when the job has one, [`TOKEN`]
//!   ([`set_credentials`], [`credentials`]). A service checks them with [`Credentials`],
//!   a tonic interceptor: it sees only the headers and runs before the request's body is
//!   read or decoded, so a peer without the token gets `Unauthenticated` and costs no
//!   more than HTTP/2's flow-control window. The token is compared in constant time.
//! - On error statuses: machine-readable details next to the code and message —
//!   [`ERROR_KIND`] (the service's error kind, e.g. `stale-step`), [`NEXT_STEP`] (a
//!   stale sync push: the step to push at), [`LEADER`] (a standby master: where the
//!   leader is) ([`set_detail`], [`detail`]). The pservers' bulk path carries the same
//!   details in its own frames and turns them back into the same status.

use tonic::Status;
use tonic::metadata::MetadataMap;

/// Request key: the job the request is for.
pub const JOB: &str = "x-edl-job";
/// Request key: the job's shared token (when it has one).
pub const TOKEN: &str = "x-edl-token";
/// Status key: the service's machine-readable error kind.
pub const ERROR_KIND: &str = "x-edl-error";
/// Status key: the step a stale sync push should be sent at.
pub const NEXT_STEP: &str = "x-edl-next-step";
/// Status key: the leading master's address, on a standby's refusal.
pub const LEADER: &str = "x-edl-leader";
/// The [`ERROR_KIND`] of a master's refusal while its job is paused (etcd is full):
/// clients wait for as long as it lasts.
pub const KIND_PAUSED: &str = "paused";
/// The [`ERROR_KIND`] of the elected master's refusal while it loads the queue from etcd
/// (a failover of a job of a million tasks takes tens of seconds): clients wait for as
/// long as it lasts, as for [`KIND_PAUSED`].
pub const KIND_LOADING: &str = "loading";

/// Puts the job (and the token, if any) on a request's metadata. Values that cannot be
/// metadata (control characters) are left out: the server then refuses the request.
pub fn set_credentials(md: &mut MetadataMap, job: &str, token: Option<&str>) {
    if let Ok(v) = job.parse() {
        md.insert(JOB, v);
    }
    if let Some(t) = token
        && let Ok(v) = t.parse()
    {
        md.insert(TOKEN, v);
    }
}

/// The job (empty when missing) and token a request carries.
pub fn credentials(md: &MetadataMap) -> (&str, Option<&str>) {
    let job = md.get(JOB).and_then(|v| v.to_str().ok()).unwrap_or("");
    let token = md.get(TOKEN).and_then(|v| v.to_str().ok());
    (job, token)
}

/// What a service accepts: requests for its job, with its token when it has one; and
/// `/metrics` scrapes with the job's scrape-only token when it has one (else the job
/// token), so that a scraper never holds, nor sends in the clear, the token every RPC
/// carries.
#[derive(Clone)]
pub struct Credentials {
    service: &'static str,
    job: String,
    token: Option<String>,
    metrics_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("service", &self.service)
            .field("job", &self.job)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field(
                "metrics_token",
                &self.metrics_token.as_ref().map(|_| "<set>"),
            )
            .finish()
    }
}

impl Credentials {
    /// The credentials of `service` (`master`, `pserver`: for messages) of `job`.
    pub fn new(service: &'static str, job: impl Into<String>, token: Option<String>) -> Self {
        Credentials {
            service,
            job: job.into(),
            token,
            metrics_token: None,
        }
    }

    /// With `metrics_token` (`EDL_METRICS_TOKEN`) as the one token a `/metrics` scrape
    /// may carry: it grants nothing else, and the job token is then refused there.
    pub fn with_metrics_token(mut self, metrics_token: Option<String>) -> Self {
        self.metrics_token = metrics_token;
        self
    }

    /// Checks a request's job and token: the message of the refusal, if refused.
    pub fn check_values(&self, job: &str, token: Option<&str>) -> Result<(), String> {
        if job != self.job {
            return Err(format!(
                "this {} serves job {:?}, the request is for {job:?}",
                self.service, self.job
            ));
        }
        if let Some(want) = &self.token
            && !token.is_some_and(|t| constant_time_eq(t.as_bytes(), want.as_bytes()))
        {
            return Err("wrong or missing job token".to_owned());
        }
        Ok(())
    }

    /// Checks an HTTP `Authorization` header (a `/metrics` scrape): it must be `Bearer
    /// <metrics token>` with a metrics token, else `Bearer <job token>` with a job token;
    /// without either, anything passes.
    pub fn check_bearer(&self, authorization: Option<&[u8]>) -> bool {
        let Some(want) = self.metrics_token.as_ref().or(self.token.as_ref()) else {
            return true;
        };
        authorization
            .and_then(|a| a.strip_prefix(b"Bearer "))
            .is_some_and(|t| constant_time_eq(t, want.as_bytes()))
    }

    /// Checks a request's metadata.
    pub fn check(&self, md: &MetadataMap) -> Result<(), Status> {
        let (job, token) = credentials(md);
        self.check_values(job, token)
            .map_err(Status::unauthenticated)
    }
}

impl tonic::service::Interceptor for Credentials {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        self.check(req.metadata())?;
        Ok(req)
    }
}

/// Most HTTP/2 streams a peer may have open at once on one connection to a master or
/// pserver (each stream's unread body is bounded by the flow-control windows).
pub const MAX_CONCURRENT_STREAMS: u32 = 256;
/// Largest header block a master or pserver accepts (job, token, deadline: a few hundred
/// bytes).
pub const MAX_HEADER_LIST_BYTES: u32 = 16 << 10;

/// Whether `a == b`, in a time that depends on their lengths only, not on where they
/// differ (a token compared byte by byte with an early exit tells a timing attacker how
/// much of a guess is right).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    std::hint::black_box(diff) == 0
}

/// Adds detail `key` = `value` to an error status (left out if `value` cannot be
/// metadata).
pub fn set_detail(status: &mut Status, key: &'static str, value: &str) {
    if let Ok(v) = value.parse() {
        status.metadata_mut().insert(key, v);
    }
}

/// Detail `key` of an error status.
pub fn detail<'a>(status: &'a Status, key: &str) -> Option<&'a str> {
    status.metadata().get(key).and_then(|v| v.to_str().ok())
}

/// Whether a call that ended with `status` is worth making again (at the same server or
/// at one that took its place): the server was unreachable, timed out, or went away, or
/// the connection itself failed — a status made from a transport error, such as the
/// GOAWAY of a server shutting down (which tonic reports as `Internal`), is the
/// connection's word, not the service's. Every edl RPC is safe to repeat.
pub fn transient(status: &Status) -> bool {
    use std::error::Error as _;
    matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
    ) || status
        .source()
        .is_some_and(|e| e.is::<tonic::transport::Error>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_and_details_round_trip() {
        let mut req = tonic::Request::new(());
        set_credentials(req.metadata_mut(), "mnist", Some("s3cret"));
        assert_eq!(credentials(req.metadata()), ("mnist", Some("s3cret")));
        let mut req = tonic::Request::new(());
        set_credentials(req.metadata_mut(), "mnist", None);
        assert_eq!(credentials(req.metadata()), ("mnist", None));
        assert_eq!(credentials(&MetadataMap::new()), ("", None));

        let mut s = Status::aborted("stale");
        set_detail(&mut s, ERROR_KIND, "stale-step");
        set_detail(&mut s, NEXT_STEP, "7");
        set_detail(&mut s, LEADER, "bad\nvalue");
        assert_eq!(detail(&s, ERROR_KIND), Some("stale-step"));
        assert_eq!(detail(&s, NEXT_STEP), Some("7"));
        assert_eq!(detail(&s, LEADER), None, "not a metadata value: left out");
    }

    #[test]
    fn a_server_gone_is_transient_and_a_refusal_is_not() {
        for s in [
            Status::unavailable("down"),
            Status::deadline_exceeded("slow"),
            Status::unknown("reset"),
            Status::cancelled("gone"),
        ] {
            assert!(transient(&s), "{s:?}");
        }
        for s in [
            Status::internal("a bug in the service"),
            Status::aborted("stale"),
            Status::invalid_argument("bad"),
            Status::unauthenticated("no token"),
        ] {
            assert!(!transient(&s), "{s:?}");
        }
    }

    #[test]
    fn credentials_refuse_another_job_and_a_wrong_or_missing_token() {
        use tonic::service::Interceptor;
        let mut c = Credentials::new("pserver", "mnist", Some("s3cret".into()));
        let req = |job: &str, token: Option<&str>| {
            let mut r = tonic::Request::new(());
            set_credentials(r.metadata_mut(), job, token);
            r
        };
        assert!(c.call(req("mnist", Some("s3cret"))).is_ok());
        for (job, token, says) in [
            ("other", Some("s3cret"), "serves job \"mnist\""),
            ("mnist", Some("s3cre"), "wrong or missing"),
            ("mnist", Some("s3cret!"), "wrong or missing"),
            ("mnist", None, "wrong or missing"),
        ] {
            let err = c.call(req(job, token)).unwrap_err();
            assert_eq!(err.code(), tonic::Code::Unauthenticated);
            assert!(err.message().contains(says), "{err}");
        }
        // Without a token, the job alone is checked.
        let mut open = Credentials::new("master", "mnist", None);
        assert!(open.call(req("mnist", None)).is_ok());
        assert!(open.call(req("mnist", Some("anything"))).is_ok());
        assert!(
            !format!("{c:?}").contains("s3cret"),
            "the token is not in Debug"
        );
        // A scrape: the job token, until a scrape-only token is set; then that alone.
        let bearer = |t: &str| format!("Bearer {t}").into_bytes();
        assert!(c.check_bearer(Some(&bearer("s3cret"))));
        assert!(!c.check_bearer(None) && !c.check_bearer(Some(b"s3cret")));
        let scrape = c.clone().with_metrics_token(Some("m3trics".into()));
        assert!(scrape.check_bearer(Some(&bearer("m3trics"))));
        assert!(
            !scrape.check_bearer(Some(&bearer("s3cret"))),
            "the job token is refused where a scrape-only token is set"
        );
        assert!(!format!("{scrape:?}").contains("m3trics"));
        let mut scrape = scrape;
        assert!(
            scrape.call(req("mnist", Some("m3trics"))).is_err(),
            "the scrape-only token grants no RPC"
        );
        assert!(open.check_bearer(None));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(constant_time_eq(b"", b""));
    }
}
