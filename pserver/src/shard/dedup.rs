//! Deduplication of async pushes: the steps applied per push session, so that a
//! retried push is applied at most once.
//!
//! Invariants: within a session, a step is [`DedupMark::Fresh`] at most once; a step more
//! than [`DEDUP_WINDOW`] behind the session's newest is [`DedupMark::TooOld`] (never applied:
//! whether it was can no longer be told). At most [`MAX_SESSIONS`] sessions are
//! remembered; beyond that the least recently used are forgotten (a session's retries
//! come within seconds).

use std::collections::HashMap;

/// Push sessions remembered for deduplication; the least recently used are forgotten
/// beyond this (a session's retries come within seconds).
const MAX_SESSIONS: usize = 4096;

/// Steps remembered per push session: a push this far behind its session's newest is
/// refused, since whether it was applied can no longer be told.
pub const DEDUP_WINDOW: u64 = 64;

/// What the deduplication table says of a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DedupMark {
    /// Not seen before: apply it.
    Fresh,
    /// Applied before (a retry).
    Repeat,
    /// Older than the window behind the session's newest step.
    TooOld {
        /// The session's newest step.
        newest: u64,
    },
}

/// Sliding window of the last [`DEDUP_WINDOW`] steps of one push session, with those
/// applied marked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Window {
    max: u64,
    seen: u64,
    used: u64,
}

impl Window {
    /// Marks `step`.
    fn mark(&mut self, step: u64) -> DedupMark {
        if step > self.max {
            let shift = step - self.max;
            self.seen = if shift >= DEDUP_WINDOW {
                0
            } else {
                self.seen << shift
            };
            self.seen |= 1;
            self.max = step;
            return DedupMark::Fresh;
        }
        let d = self.max - step;
        if d >= DEDUP_WINDOW {
            return DedupMark::TooOld { newest: self.max };
        }
        let bit = 1u64 << d;
        let new = self.seen & bit == 0;
        self.seen |= bit;
        if new {
            DedupMark::Fresh
        } else {
            DedupMark::Repeat
        }
    }
}

/// The steps applied per (trainer, session).
#[derive(Debug, Default)]
pub(super) struct Dedup {
    sessions: HashMap<(String, u64), Window>,
    clock: u64,
}

impl Dedup {
    /// The windows of every session, in order (for comparing replicas).
    #[cfg(test)]
    pub(super) fn entries(&self) -> Vec<(String, u64, u64, u64)> {
        let mut v: Vec<_> = self
            .sessions
            .iter()
            .map(|((t, s), w)| (t.clone(), *s, w.max, w.seen))
            .collect();
        v.sort();
        v
    }

    /// The table's bytes (in a replica's snapshot).
    pub(super) fn encode(&self, b: &mut Vec<u8>) {
        use bytes::BufMut;
        b.put_u64_le(self.clock);
        b.put_u32_le(self.sessions.len() as u32);
        for ((trainer, session), w) in &self.sessions {
            b.put_u32_le(trainer.len() as u32);
            b.put_slice(trainer.as_bytes());
            b.put_u64_le(*session);
            b.put_u64_le(w.max);
            b.put_u64_le(w.seen);
            b.put_u64_le(w.used);
        }
    }

    /// A table read back from [`Dedup::encode`]'s bytes; `None` if they are damaged.
    pub(super) fn decode(b: &mut bytes::Bytes) -> Option<Dedup> {
        use bytes::Buf;
        let clock = b.try_get_u64_le().ok()?;
        let n = b.try_get_u32_le().ok()? as usize;
        if n > MAX_SESSIONS + 1 {
            return None;
        }
        let mut sessions = HashMap::with_capacity(n);
        for _ in 0..n {
            let len = b.try_get_u32_le().ok()? as usize;
            if b.remaining() < len {
                return None;
            }
            let trainer = String::from_utf8(b.split_to(len).to_vec()).ok()?;
            let session = b.try_get_u64_le().ok()?;
            let w = Window {
                max: b.try_get_u64_le().ok()?,
                seen: b.try_get_u64_le().ok()?,
                used: b.try_get_u64_le().ok()?,
            };
            sessions.insert((trainer, session), w);
        }
        Some(Dedup { sessions, clock })
    }

    /// What [`Dedup::mark`] would say of `step`, changing nothing.
    pub(super) fn peek(&self, trainer: &str, session: u64, step: u64) -> DedupMark {
        let mut w = self
            .sessions
            .get(&(trainer.to_owned(), session))
            .copied()
            .unwrap_or_default();
        w.mark(step)
    }

    /// Marks `step` of `trainer`'s `session`.
    pub(super) fn mark(&mut self, trainer: &str, session: u64, step: u64) -> DedupMark {
        self.clock += 1;
        let w = self
            .sessions
            .entry((trainer.to_owned(), session))
            .or_default();
        w.used = self.clock;
        let mark = w.mark(step);
        if self.sessions.len() > MAX_SESSIONS {
            let mut used: Vec<u64> = self.sessions.values().map(|w| w.used).collect();
            used.sort_unstable();
            let cut = used[used.len() / 4];
            self.sessions.retain(|_, w| w.used > cut);
        }
        mark
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dedup_window_accepts_reordering_and_rejects_repeats() {
        let mut d = Dedup::default();
        assert_eq!(d.mark("t", 1, 3), DedupMark::Fresh);
        assert_eq!(d.mark("t", 1, 1), DedupMark::Fresh);
        assert_eq!(d.mark("t", 1, 2), DedupMark::Fresh);
        assert_eq!(d.mark("t", 1, 2), DedupMark::Repeat);
        assert_eq!(
            d.mark("t", 2, 2),
            DedupMark::Fresh,
            "another session of the same trainer"
        );
        assert_eq!(d.mark("t", 1, 100), DedupMark::Fresh);
        assert_eq!(
            d.mark("t", 1, 3),
            DedupMark::TooOld { newest: 100 },
            "too old to tell: refused"
        );
        assert_eq!(d.mark("t", 1, 37), DedupMark::Fresh, "inside the window");
        assert_eq!(d.mark("t", 1, 100), DedupMark::Repeat);
        assert_eq!(d.mark("t", 2, 2), DedupMark::Repeat);
        for s in 0..(MAX_SESSIONS as u64 + 10) {
            d.mark("u", 10 + s, 1);
        }
        assert!(d.sessions.len() <= MAX_SESSIONS);
        assert_eq!(
            d.mark("u", 10 + MAX_SESSIONS as u64 + 9, 1),
            DedupMark::Repeat,
            "recent sessions kept"
        );
    }
}
