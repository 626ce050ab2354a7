//! The skip-gram step on the CPU in f32, without autograd: one pass over the batch's
//! pairs reads the gathered rows where they are and accumulates each gradient once.
//!
//! candle's autograd builds the same loss from `index_select`, broadcast products and
//! sums; every one of them allocates its output and its gradient, and the backward pass
//! scatters through `index_add`. For a 64-wide embedding these passes cost many times
//! the arithmetic. The math is the candle path's (it is the reference in the tests):
//! for a pair with centre row `v`, context row `u_o` and negative rows `u_k`,
//! `loss = softplus(-u_o.v) + sum_k softplus(u_k.v)`, and the batch loss is the mean
//! over pairs, so every gradient carries a factor `1 / pairs`.

/// Numerically stable `log(1 + exp(x))`.
fn softplus(x: f32) -> f64 {
    let x = f64::from(x);
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// `1 / (1 + exp(-x))`, stable for large `|x|`.
fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += a * x`.
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The pairs of a batch, as indices into the gathered rows.
pub(crate) struct Pairs<'a> {
    pub(crate) dim: usize,
    /// Index into the `emb_in` rows of each pair's centre.
    pub(crate) center: &'a [u32],
    /// Index into the `emb_out` rows of each pair's context word.
    pub(crate) context: &'a [u32],
    /// `negatives` indices into the `emb_out` rows for each pair, pair after pair.
    pub(crate) negative: &'a [u32],
}

impl Pairs<'_> {
    fn negatives(&self) -> usize {
        self.negative.len() / self.center.len().max(1)
    }

    /// The mean loss over the pairs of rows `e_in` (`[rows_in, dim]`) and `e_out`
    /// (`[rows_out, dim]`); with `grads`, their gradients (zeroed, the same shapes)
    /// are written too. Every index must lie within its rows (the batch was made so).
    pub(crate) fn loss(
        &self,
        e_in: &[f32],
        e_out: &[f32],
        mut grads: Option<(&mut [f32], &mut [f32])>,
    ) -> f64 {
        let (d, k) = (self.dim, self.negatives());
        let pairs = self.center.len();
        if pairs == 0 {
            return 0.0;
        }
        let scale = 1.0 / pairs as f32;
        let row = |t: &[f32], i: u32| -> std::ops::Range<usize> {
            let i = i as usize * d;
            debug_assert!(i + d <= t.len());
            i..i + d
        };
        let mut gv = vec![0f32; d];
        let mut total = 0f64;
        for p in 0..pairs {
            let v = &e_in[row(e_in, self.center[p])];
            let negs = &self.negative[p * k..(p + 1) * k];
            gv.iter_mut().for_each(|g| *g = 0.0);
            // The context word: d/ds softplus(-s) = sigmoid(s) - 1.
            let words =
                std::iter::once((self.context[p], -1.0f32)).chain(negs.iter().map(|&n| (n, 1.0)));
            for (o, sign) in words {
                let u = &e_out[row(e_out, o)];
                let s = dot(u, v);
                total += softplus(sign * s);
                if let Some((_, g_out)) = grads.as_mut() {
                    let g = (sigmoid(s) - if sign < 0.0 { 1.0 } else { 0.0 }) * scale;
                    axpy(g, u, &mut gv);
                    axpy(g, v, &mut g_out[row(e_out, o)]);
                }
            }
            if let Some((g_in, _)) = grads.as_mut() {
                let r = row(e_in, self.center[p]);
                axpy(1.0, &gv, &mut g_in[r]);
            }
        }
        total / pairs as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loss of one pair by its formula, and its gradients by central differences.
    #[test]
    fn one_pair_matches_its_formula_and_finite_differences() {
        let d = 3;
        let e_in = vec![0.3, -0.2, 0.5, 0.1, 0.4, -0.6];
        let e_out = vec![0.2, 0.1, -0.3, -0.5, 0.25, 0.05, 0.7, -0.1, 0.2];
        let pairs = Pairs {
            dim: d,
            center: &[1, 0],
            context: &[2, 0],
            negative: &[0, 1, 2, 1],
        };
        let mut g_in = vec![0.0; e_in.len()];
        let mut g_out = vec![0.0; e_out.len()];
        let loss = pairs.loss(&e_in, &e_out, Some((&mut g_in, &mut g_out)));
        let sp = |x: f32| softplus(x);
        let v1 = &e_in[3..6];
        let v0 = &e_in[0..3];
        let u = |i: usize| &e_out[i * 3..i * 3 + 3];
        let want = (sp(-dot(u(2), v1))
            + sp(dot(u(0), v1))
            + sp(dot(u(1), v1))
            + sp(-dot(u(0), v0))
            + sp(dot(u(2), v0))
            + sp(dot(u(1), v0)))
            / 2.0;
        assert!((loss - want).abs() < 1e-6, "{loss} against {want}");
        let h = 1e-3f32;
        for (which, grad) in [(0, &g_in), (1, &g_out)] {
            for i in 0..grad.len() {
                let (mut a, mut b) = (e_in.clone(), e_out.clone());
                let t = if which == 0 { &mut a } else { &mut b };
                t[i] += h;
                let up = pairs.loss(&a, &b, None);
                let t = if which == 0 { &mut a } else { &mut b };
                t[i] -= 2.0 * h;
                let down = pairs.loss(&a, &b, None);
                let fd = (up - down) / (2.0 * f64::from(h));
                assert!(
                    (fd - f64::from(grad[i])).abs() < 1e-3,
                    "table {which} [{i}]: {fd} against {}",
                    grad[i]
                );
            }
        }
    }

    #[test]
    fn extreme_scores_stay_finite() {
        let pairs = Pairs {
            dim: 1,
            center: &[0],
            context: &[0],
            negative: &[1],
        };
        let mut g = (vec![0.0; 1], vec![0.0; 2]);
        let loss = pairs.loss(&[100.0], &[-100.0, 100.0], Some((&mut g.0, &mut g.1)));
        assert!(loss.is_finite() && loss > 1e4, "{loss}");
        assert!(g.0.iter().chain(&g.1).all(|x| x.is_finite()), "{g:?}");
    }
}
