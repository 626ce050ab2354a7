//! Storage errors: each names the URL (or path) it is about, and says the fix where
//! there is one.

/// A storage result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong with a location or an object.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not a path or URL edl can use.
    #[error("{url}: {why}")]
    BadUrl {
        /// The text given.
        url: String,
        /// Why not, and what would do.
        why: String,
    },
    /// The store needs credentials that the environment does not give.
    #[error("{url}: no credentials for {store}: {fix}")]
    Credentials {
        /// The location.
        url: String,
        /// The store (`S3`, ...).
        store: &'static str,
        /// Which variables to set.
        fix: &'static str,
    },
    /// The object (or file) is not there.
    #[error("{url}: not found")]
    NotFound {
        /// The object's URL.
        url: String,
    },
    /// The store refused the request (credentials, permissions).
    #[error("{url}: refused: {message}")]
    Refused {
        /// The object's URL.
        url: String,
        /// The store's answer.
        message: String,
    },
    /// The object ends before the bytes asked for: it is shorter than it was.
    #[error("{url}: bytes {start}..{end} asked for, but the object ends at byte {ends}")]
    Truncated {
        /// The object's URL.
        url: String,
        /// The first byte asked for.
        start: u64,
        /// The end of the bytes asked for.
        end: u64,
        /// Where the object ends.
        ends: u64,
    },
    /// The store could not be reached or failed; a retry may succeed.
    #[error("{url}: {message}")]
    Unavailable {
        /// The object's URL.
        url: String,
        /// What happened.
        message: String,
    },
}

impl Error {
    /// Whether a retry (later) may succeed: the store was unreachable or failed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }

    /// The error of a request about `url`.
    pub(crate) fn from_store(url: &str, e: object_store::Error) -> Error {
        use object_store::Error as E;
        match e {
            E::NotFound { .. } => Error::NotFound {
                url: url.to_owned(),
            },
            E::PermissionDenied { source, .. } | E::Unauthenticated { source, .. } => {
                Error::Refused {
                    url: url.to_owned(),
                    message: chain(source.as_ref()),
                }
            }
            other => Error::Unavailable {
                url: url.to_owned(),
                message: chain(&other),
            },
        }
    }
}

/// An error with its causes (a transport error says little alone).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
