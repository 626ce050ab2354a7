//! The end of a pass: it ends exactly when no task is todo or pending (failed tasks
//! never block it). Only the [`Meta`](super::Meta) record changes then (its `pass`
//! grows); every task becomes todo in the new pass, or the job is finished after the
//! last pass. An empty dataset finishes every pass at once.

use super::{Queue, TaskState};

impl Queue {
    /// Ends the pass when nothing is todo or pending.
    pub(super) fn check_pass_end(&mut self) {
        if self.meta.finished || !self.todo.is_empty() || !self.pending.is_empty() {
            return;
        }
        let ended = self.meta.pass;
        self.meta.counters.passes_completed += 1;
        self.meta_dirty = true;
        if ended.saturating_add(1) >= self.cfg.passes {
            self.meta.finished = true;
            tracing::info!(pass = ended, "last pass finished");
            return;
        }
        self.meta.pass = ended + 1;
        tracing::info!(pass = ended, next = self.meta.pass, "pass finished");
        for (i, t) in self.tasks.iter_mut().enumerate() {
            t.pass = self.meta.pass;
            t.state = TaskState::Todo;
            t.failures = 0;
            t.losses = 0;
            t.last_error = None;
            self.todo.push_back(i);
        }
        if self.tasks.is_empty() {
            // An empty dataset finishes every pass at once.
            self.check_pass_end();
        }
    }
}
