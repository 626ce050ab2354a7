//! The end of a pass: it ends exactly when no task is todo or pending (failed tasks
//! never block it). Only the [`Meta`](super::Meta) record changes then (its `pass`
//! grows); every task becomes todo in the new pass (failed, when it failed for good in
//! that pass before a rewind: a pass trained again does not retry it), or the job is
//! finished after the last pass. An empty dataset finishes every pass at once.

use super::Queue;

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
        let pass = self.meta.pass;
        for i in 0..self.tasks.len() {
            let failed = self.failed_in(pass, i);
            // As `restore` makes it from the stored record of an older pass.
            self.tasks[i].enter_pass(pass, failed);
            if !failed {
                self.todo.push_back(i);
            }
        }
        if self.todo.is_empty() {
            // An empty dataset finishes every pass at once; so does a pass whose every
            // task failed for good in it before a rewind.
            self.check_pass_end();
        }
    }
}
