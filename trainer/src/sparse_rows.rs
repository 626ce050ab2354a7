//! [`SparseRows`]: the rows of one sparse table a step reads, `dim` values a row in one
//! buffer, looked up by id.
//!
//! A pull of N rows is the one buffer the wire decoded into, moved here, and an index:
//! not N vectors. Rows can be added (a local store creates them as batches touch them);
//! every row has the table's width.

use std::collections::HashMap;
use std::fmt;

/// The rows of one sparse table (see the module docs).
#[derive(Clone, Default, PartialEq)]
pub struct SparseRows {
    dim: usize,
    ids: Vec<u64>,
    values: Vec<f32>,
    /// Position of each id in `ids`.
    at: HashMap<u64, usize>,
}

impl fmt::Debug for SparseRows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SparseRows")
            .field("dim", &self.dim)
            .field("rows", &self.ids.len())
            .finish()
    }
}

impl SparseRows {
    /// No rows yet, each `dim` wide.
    pub fn new(dim: usize) -> Self {
        SparseRows {
            dim,
            ..Default::default()
        }
    }

    /// Rows `ids` with their `values`, row after row; `None` unless there are
    /// `ids.len() * dim` values. A repeated id keeps its first row.
    pub fn from_values(dim: usize, ids: Vec<u64>, values: Vec<f32>) -> Option<Self> {
        if ids.len().checked_mul(dim) != Some(values.len()) {
            return None;
        }
        let mut at = HashMap::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            at.entry(id).or_insert(i);
        }
        Some(SparseRows {
            dim,
            ids,
            values,
            at,
        })
    }

    /// Values a row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Rows held (a repeated id counts once per time it was given).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there is no row.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Whether row `id` is held.
    pub fn contains(&self, id: u64) -> bool {
        self.at.contains_key(&id)
    }

    fn span(&self, i: usize) -> std::ops::Range<usize> {
        i * self.dim..(i + 1) * self.dim
    }

    /// Row `id`'s values.
    pub fn get(&self, id: u64) -> Option<&[f32]> {
        let &i = self.at.get(&id)?;
        Some(&self.values[self.span(i)])
    }

    /// Row `id`'s values, to change.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut [f32]> {
        let &i = self.at.get(&id)?;
        let span = self.span(i);
        Some(&mut self.values[span])
    }

    /// Sets row `id` (added when missing). A row of another width is cut or padded with
    /// zeros to the table's; a table with no width yet takes the row's.
    pub fn insert(&mut self, id: u64, row: &[f32]) {
        let row = fit(row.to_vec(), self.dim_for(row.len()));
        self.get_or_insert_with(id, || row.clone())
            .copy_from_slice(&row);
    }

    fn dim_for(&self, len: usize) -> usize {
        if self.dim == 0 && self.ids.is_empty() {
            len
        } else {
            self.dim
        }
    }

    /// Row `id`, first made by `init` when missing (cut or padded as by
    /// [`SparseRows::insert`]).
    pub fn get_or_insert_with(&mut self, id: u64, init: impl FnOnce() -> Vec<f32>) -> &mut [f32] {
        let i = match self.at.get(&id) {
            Some(&i) => i,
            None => {
                let row = init();
                self.dim = self.dim_for(row.len());
                let i = self.ids.len();
                self.ids.push(id);
                self.values.extend(fit(row, self.dim));
                self.at.insert(id, i);
                i
            }
        };
        let span = self.span(i);
        &mut self.values[span]
    }

    /// The rows, in the order they were given.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &[f32])> + '_ {
        self.ids
            .iter()
            .zip(self.values.chunks_exact(self.dim.max(1)))
            .map(|(&id, v)| (id, v))
    }
}

impl FromIterator<(u64, Vec<f32>)> for SparseRows {
    /// Rows from `(id, values)` pairs, as by [`SparseRows::insert`] one after another.
    fn from_iter<I: IntoIterator<Item = (u64, Vec<f32>)>>(iter: I) -> Self {
        let mut rows = SparseRows::default();
        for (id, v) in iter {
            rows.insert(id, &v);
        }
        rows
    }
}

fn fit(mut row: Vec<f32>, dim: usize) -> Vec<f32> {
    row.resize(dim, 0.0);
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_found_changed_and_added_in_one_buffer() {
        let mut r = SparseRows::from_values(2, vec![7, 3], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!((r.dim(), r.len()), (2, 2));
        assert_eq!(r.get(3), Some(&[3.0, 4.0][..]));
        assert_eq!(r.get(5), None);
        r.get_mut(7).unwrap()[1] = 9.0;
        assert_eq!(r.get(7), Some(&[1.0, 9.0][..]));
        assert_eq!(r.get_or_insert_with(3, || unreachable!()), &[3.0, 4.0]);
        assert_eq!(r.get_or_insert_with(5, || vec![0.5, 0.25]), &[0.5, 0.25]);
        r.insert(3, &[6.0]);
        assert_eq!(r.get(3), Some(&[6.0, 0.0][..]), "a short row is padded");
        let all: Vec<(u64, Vec<f32>)> = r.iter().map(|(id, v)| (id, v.to_vec())).collect();
        assert_eq!(
            all,
            vec![
                (7, vec![1.0, 9.0]),
                (3, vec![6.0, 0.0]),
                (5, vec![0.5, 0.25])
            ]
        );
        assert!(SparseRows::from_values(2, vec![1], vec![1.0]).is_none());
        let mut fresh = SparseRows::default();
        fresh.insert(1, &[1.0, 2.0, 3.0]);
        assert_eq!((fresh.dim(), fresh.get(1)), (3, Some(&[1.0, 2.0, 3.0][..])));
    }
}
