//! [`Mode`]: how the pservers apply the trainers' gradients (asynchronously, or in
//! synchronous steps).

use serde::{Deserialize, Serialize};

/// How updates are applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Mode {
    /// Each push is applied on arrival.
    Async,
    /// A step aggregates the gradients of the trainers taking part in it and applies
    /// their mean once every one of them pushed (or left, or `step_timeout_ms` passed
    /// since the step's first push: the missing trainers are dropped from it).
    Sync {
        /// Bound on how long a step waits for a trainer that is alive but silent.
        #[serde(default = "default_step_timeout_ms")]
        step_timeout_ms: u64,
    },
}

fn default_step_timeout_ms() -> u64 {
    60_000
}

impl Mode {
    /// Sync mode with the default step timeout (60 s).
    pub fn sync() -> Self {
        Mode::Sync {
            step_timeout_ms: default_step_timeout_ms(),
        }
    }

    /// Whether this is sync mode.
    pub fn is_sync(&self) -> bool {
        matches!(self, Mode::Sync { .. })
    }

    /// A short name (`async`, `sync`).
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Async => "async",
            Mode::Sync { .. } => "sync",
        }
    }
}
