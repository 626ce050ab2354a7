//! [`Working`]: the parameters the compute thread computes on, between pulls.
//!
//! The compute thread applies its own gradients to its working copy as it computes them
//! (the pservers' update rule, run locally), so the next batch already sees them, and
//! hands their sums to the pservers in pushes numbered 1, 2, ... A pull issued after
//! push `k` was applied lands later: it holds the pservers' values through push `k` (and
//! the other trainers' pushes), but not this trainer's later batches. `Working` rebases
//! the working copy on it without losing those batches.
//!
//! For every push not yet absorbed, it keeps a *mark*: the working values at the moment
//! the push was handed over; the first mark is the *base*, the newest push a landed pull
//! absorbed (0 and the first pulled values at the start).
//!
//! Invariants (checked by the tests below):
//! - `work = base + (the local updates of the batches after the base push)`: when a pull
//!   absorbing push `k` lands with values `P`, the offset `P - mark(k)` is added to the
//!   working values and to every later mark, and `P` becomes mark `k`;
//! - a landing never moves the base backwards: a pull absorbing less than the base is
//!   dropped (its buffer is recycled);
//! - an advance to push `k` (the pservers said they hold mark `k`: a lone trainer's push
//!   under an additive rule, see `comm`) makes mark `k` the base and changes no working
//!   value; whatever it claimed, the next landing rebases on the values pulled;
//! - with no other trainer and an update rule that adds, the working values equal the
//!   pservers' values plus the updates not yet pushed or applied, whatever the order of
//!   pushes, applications and landings.
//!
//! A push applied *while* a pull was in flight may be in the pulled values and in the
//! local offset at once: the next landing that absorbs it takes it out again (the
//! offset is relative to its mark). Buffers are recycled, never freed while running.

use std::collections::VecDeque;

/// Dense values, one vector per parameter.
pub(crate) type Values = Vec<Vec<f32>>;

/// The working parameters and the marks of the pushes not yet absorbed.
#[derive(Debug)]
pub(crate) struct Working {
    work: crate::model::Params,
    /// (push number, working values when it was handed over), oldest first; never empty
    /// (the first is the base).
    marks: VecDeque<(u64, Values)>,
    /// Buffers to reuse (for marks and pulls).
    spare: Vec<Values>,
    /// Pulls landed and rebased on.
    pub(crate) rebases: u64,
}

impl Working {
    /// Starts from `initial` (pulled before any push): the base is push 0.
    pub(crate) fn new(initial: Values) -> Self {
        let work = crate::model::Params {
            dense: initial.clone(),
            sparse: Default::default(),
        };
        Working {
            work,
            marks: VecDeque::from([(0, initial)]),
            spare: Vec::new(),
            rebases: 0,
        }
    }

    /// The working parameters (the compute thread updates them in place).
    pub(crate) fn params(&mut self) -> &mut crate::model::Params {
        &mut self.work
    }

    /// The base push: the newest push a landed pull absorbed.
    #[cfg(test)]
    pub(crate) fn base(&self) -> u64 {
        self.marks.front().map_or(0, |m| m.0)
    }

    /// Push `number` (above every earlier one) was just handed over: remembers the
    /// working values as its mark.
    pub(crate) fn mark(&mut self, number: u64) {
        debug_assert!(self.marks.back().is_none_or(|m| m.0 < number));
        let mut buf = self.spare.pop().unwrap_or_default();
        copy_values(&mut buf, &self.work.dense);
        self.marks.push_back((number, buf));
    }

    /// The pservers hold mark `number` (see the module docs): it becomes the base, the
    /// older marks are recycled. Returns whether it was a mark above the base.
    pub(crate) fn advance(&mut self, number: u64) -> bool {
        match self.marks.iter().position(|m| m.0 == number) {
            Some(i) if i > 0 => {
                for old in self.marks.drain(..i) {
                    self.spare.push(old.1);
                }
                true
            }
            _ => false,
        }
    }

    /// A buffer to pull into (recycled).
    pub(crate) fn spare(&mut self) -> Values {
        self.spare.pop().unwrap_or_default()
    }

    /// A pull that absorbed pushes `1..=absorbed` landed with `pulled`: rebases the
    /// working values on it (see the module docs). Returns whether it was used.
    pub(crate) fn land(&mut self, mut pulled: Values, absorbed: u64) -> bool {
        let Some(i) = self.marks.iter().position(|m| m.0 == absorbed) else {
            // Older than the base (or a push not handed over: never, the compute thread
            // marks each push as it hands it over).
            self.spare.push(pulled);
            return false;
        };
        if !same_shape(&pulled, &self.work.dense) {
            self.spare.push(pulled);
            return false;
        }
        for old in self.marks.drain(..i) {
            self.spare.push(old.1);
        }
        let (mark, rest) = {
            let (front, back) = self.marks.as_mut_slices();
            match front.split_first_mut() {
                Some((first, after)) => (first, [after, back]),
                None => unreachable!("position found a mark"),
            }
        };
        // The offset P - mark(k), computed into the mark's buffer, then added to the
        // working values and to every later mark; P becomes mark k.
        for (p, (m, w)) in mark
            .1
            .iter_mut()
            .zip(pulled.iter().zip(&mut self.work.dense))
        {
            for ((o, &pv), wv) in p.iter_mut().zip(m).zip(w.iter_mut()) {
                *o = pv - *o;
                *wv += *o;
            }
        }
        for later in rest.into_iter().flatten() {
            for (l, o) in later.1.iter_mut().zip(&mark.1) {
                for (lv, &ov) in l.iter_mut().zip(o) {
                    *lv += ov;
                }
            }
        }
        std::mem::swap(&mut mark.1, &mut pulled);
        self.spare.push(pulled);
        self.rebases += 1;
        true
    }
}

fn same_shape(a: &Values, b: &Values) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.len() == y.len())
}

/// Copies `src` into `dst`, reusing its allocations.
pub(crate) fn copy_values(dst: &mut Values, src: &Values) {
    dst.resize_with(src.len(), Vec::new);
    for (d, s) in dst.iter_mut().zip(src) {
        d.clear();
        d.extend_from_slice(s);
    }
}

#[cfg(test)]
mod tests;
