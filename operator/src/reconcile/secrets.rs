//! The job's credentials and TLS Secret into CredentialsReady and TLSReady. No job
//! process starts without them.

use super::draft::Draft;
use super::{JobCredentials, JobTls};
use crate::objects;

impl Draft<'_> {
    /// The job's credentials, when the operator makes them, into the
    /// `CredentialsReady` condition; why they could not be made, if so.
    pub(super) fn credentials(&mut self) -> Option<String> {
        match &self.obs.credentials {
            JobCredentials::NotIssued => None,
            JobCredentials::Ready => {
                let message = format!(
                    "the job's processes use the etcd user and token of Secret {}",
                    objects::credentials_secret_name(&self.job)
                );
                self.condition("CredentialsReady", true, "Issued", message);
                None
            }
            JobCredentials::Failed(why) => {
                let message = format!("cannot make the job's etcd credentials: {why}");
                if self.condition(
                    "CredentialsReady",
                    false,
                    "CredentialsFailed",
                    message.clone(),
                ) {
                    self.plan.event(true, "CredentialsFailed", message.clone());
                }
                Some(message)
            }
        }
    }

    /// The job's TLS Secret into the `TLSReady` condition; why it could not be made,
    /// if so (one event).
    pub(super) fn tls(&mut self) -> Option<String> {
        match &self.obs.tls {
            JobTls::Plaintext => None,
            JobTls::Ready(renewals) => {
                // One event a round (an event repeated soon after is a series of the
                // first, its note kept).
                if !renewals.renewed.is_empty() {
                    let renewed: Vec<String> = renewals
                        .renewed
                        .iter()
                        .map(|(secret, ends)| format!("Secret {secret} (valid until {ends})"))
                        .collect();
                    self.plan.event(
                        false,
                        "CertificateRenewed",
                        format!(
                            "certificates issued again: {}; the pods present them from their \
                             next connection, without a restart",
                            renewed.join(", ")
                        ),
                    );
                }
                let (reason, message) = match &renewals.ca_ends {
                    None => (
                        "Issued",
                        format!(
                            "the job's pods talk over mutual TLS, each role with its own \
                             certificate (Secrets {}-edl-tls-<role>) of the CA of Secret {}, \
                             renewed with a third of its life left",
                            self.job,
                            objects::ca_secret_name(&self.job)
                        ),
                    ),
                    Some(ends) => (
                        "CAEnding",
                        format!(
                            "the job's CA (Secret {}) ends at {ends} and its certificates \
                             cannot be renewed past it: the job's pods cannot talk after \
                             that. Suspend the job, delete Secret {} and the job's \
                             {}-edl-tls-<role> Secrets (a new CA is made), and resume it",
                            objects::ca_secret_name(&self.job),
                            objects::ca_secret_name(&self.job),
                            self.job,
                        ),
                    ),
                };
                let warn = renewals.ca_ends.is_some();
                if self.condition("TLSReady", true, reason, message.clone()) && warn {
                    self.plan.event(true, "CAEnding", message);
                }
                None
            }
            JobTls::Failed(why) => {
                let message = format!(
                    "cannot make the job's TLS Secret: {why} (or set spec.plaintext to run \
                     the job without TLS between its pods)"
                );
                if self.condition("TLSReady", false, "TLSFailed", message.clone()) {
                    self.plan.event(true, "TLSFailed", message.clone());
                }
                Some(message)
            }
        }
    }
}
