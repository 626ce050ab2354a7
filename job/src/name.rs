//! [`JobName`]: the one job-name type.
//!
//! A job name is a single etcd path segment and a directory name (run directories,
//! checkpoint folders), so it is checked once, where it enters the system (a command-line
//! argument, a job spec, a stored record), and carried as a [`JobName`] from then on.
//!
//! Invariant: a [`JobName`] is 1 to [`MAX_LEN`] characters of ASCII letters, digits, `-`,
//! `_` and `.`, and is neither `.` nor `..` (so it can never leave its folder or its key
//! prefix).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest job name.
pub const MAX_LEN: usize = 128;

/// A validated job name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobName(String);

/// A string that is not a valid job name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid job name {0:?}: use 1 to 128 letters, digits, '-', '_' and '.' (not '.' or '..')")]
pub struct InvalidJobName(pub String);

impl JobName {
    /// Checks `name` and wraps it.
    pub fn new(name: impl Into<String>) -> Result<JobName, InvalidJobName> {
        let name = name.into();
        if Self::is_valid(&name) {
            Ok(JobName(name))
        } else {
            Err(InvalidJobName(name))
        }
    }

    /// Whether `name` is a valid job name.
    pub fn is_valid(name: &str) -> bool {
        !name.is_empty()
            && name.len() <= MAX_LEN
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && name != "."
            && name != ".."
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Whether `id` is usable as a member id (a trainer's id: one etcd path segment under
/// `trainers/`): 1 to 200 characters, no `/`, no control characters.
pub fn valid_member_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 200 && !id.contains('/') && id.chars().all(|c| !c.is_control())
}

impl fmt::Display for JobName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for JobName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for JobName {
    type Err = InvalidJobName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobName::new(s)
    }
}

impl TryFrom<String> for JobName {
    type Error = InvalidJobName;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        JobName::new(s)
    }
}

impl TryFrom<&str> for JobName {
    type Error = InvalidJobName;

    fn try_from(s: &str) -> Result<Self, Self::Error> {
        JobName::new(s)
    }
}

impl PartialEq<str> for JobName {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for JobName {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl Serialize for JobName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for JobName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        JobName::new(s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_path_segments_and_rejects_the_rest() {
        for ok in [
            "mnist",
            "a",
            "job-1_x.v2",
            &"x".repeat(MAX_LEN),
            "..a",
            "a..",
        ] {
            assert!(JobName::new(ok).is_ok(), "{ok:?}");
        }
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "a b",
            "ü",
            "a\0",
            &"x".repeat(MAX_LEN + 1),
        ] {
            let e = JobName::new(bad).unwrap_err();
            assert_eq!(e.0, bad);
            assert!(e.to_string().contains("invalid job name"), "{e}");
        }
    }

    #[test]
    fn member_ids_are_single_segments() {
        assert!(valid_member_id("trainer-1.2"));
        assert!(!valid_member_id(""));
        assert!(!valid_member_id("a/b"));
        assert!(!valid_member_id("a\nb"));
        assert!(!valid_member_id(&"x".repeat(201)));
    }

    #[test]
    fn deserializing_validates() {
        let n: JobName = serde_json::from_str("\"wine\"").unwrap();
        assert_eq!(n, "wine");
        let e = serde_json::from_str::<JobName>("\"../etc\"").unwrap_err();
        assert!(e.to_string().contains("invalid job name"), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn valid_names_never_contain_a_separator(s in "[a-z./_ -]{0,8}") {
            if let Ok(n) = JobName::new(s.clone()) {
                proptest::prop_assert!(!n.as_str().contains('/'));
                proptest::prop_assert!(n.as_str() != "." && n.as_str() != "..");
                proptest::prop_assert_eq!(n.as_str(), s.as_str());
            }
        }
    }
}
