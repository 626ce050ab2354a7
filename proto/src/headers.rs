//! The one metadata scheme of edl's gRPC services (the master's and the pservers'):
//! every key is `x-edl-<name>`.
//!
//! - On requests: who is asking — [`JOB`] and, when the job has one, [`TOKEN`]
//!   ([`set_credentials`], [`credentials`]).
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
}
