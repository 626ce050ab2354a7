//! [`PerPush`]: how many batches a trainer sums into one push (`train.batches_per_push`).

use std::fmt;

use serde::{Deserialize, Serialize};

/// The most batches an adaptive push sums: the staleness cap (the other trainers see a
/// trainer's gradients at most this many batches late; its own batches are applied to
/// its working copy at once).
pub const ADAPTIVE_MAX_BATCHES: u32 = 16;

/// How many batches a trainer sums into one push: `batches_per_push = N` or
/// `batches_per_push = "adaptive"` (the default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Raw", into = "Raw")]
pub enum PerPush {
    /// Asynchronous trainers with a stateless update rule (plain SGD: the pipeline) sum
    /// the batches they computed during the previous push's round trip (its push and the
    /// pull after it), up to
    /// [`ADAPTIVE_MAX_BATCHES`], on a task's first attempt in a pass, and push batch by
    /// batch on a later attempt (so that no push of it partly overlaps the first
    /// attempt's). Every other trainer pushes batch by batch.
    #[default]
    Adaptive,
    /// Groups of this many consecutive batches of a task (asynchronous mode), the same
    /// groups in every attempt at it.
    Fixed(u32),
}

impl PerPush {
    /// Whether this is the default (not written when a spec is stored).
    pub fn is_adaptive(&self) -> bool {
        matches!(self, PerPush::Adaptive)
    }
}

impl fmt::Display for PerPush {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PerPush::Adaptive => f.write_str("adaptive"),
            PerPush::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// The form in a spec: a number or the word.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum Raw {
    Fixed(u32),
    Word(String),
}

impl TryFrom<Raw> for PerPush {
    type Error = String;

    fn try_from(r: Raw) -> Result<Self, String> {
        match r {
            Raw::Fixed(n) => Ok(PerPush::Fixed(n)),
            Raw::Word(w) if w == "adaptive" => Ok(PerPush::Adaptive),
            Raw::Word(w) => Err(format!(
                "batches_per_push is a number of batches or \"adaptive\", not {w:?}"
            )),
        }
    }
}

impl From<PerPush> for Raw {
    fn from(p: PerPush) -> Raw {
        match p {
            PerPush::Adaptive => Raw::Word("adaptive".into()),
            PerPush::Fixed(n) => Raw::Fixed(n),
        }
    }
}
