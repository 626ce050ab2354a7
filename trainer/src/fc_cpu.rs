//! The fully connected networks' step on the CPU in f32, computed straight on the
//! parameter slices with `gemm` (the matrix kernels candle itself uses on the CPU).
//!
//! candle's autograd costs a fully connected step several passes over every parameter
//! and gradient besides the math: the parameters are copied into variables, every
//! gradient is accumulated into a zeroed buffer (a memset and an add), and the result is
//! copied out again. On the peer benchmark's 784-256-10 MLP those passes took about as
//! long as the matrix products. Here a step reads the parameters where they are and
//! writes each gradient once, into the vectors it returns.
//!
//! The math is the same as the candle path's (it is the reference in the tests, and the
//! finite-difference checks run through this one): layers `h = relu(x·W + b)` but the
//! last, then mean squared error on one output or mean softmax cross-entropy.
//! Matrices are row-major; `W` of a layer is `[in, out]`.
//!
//! The products run on the calling thread (`Parallelism::None`): trainers on one
//! machine are separate processes, each with one core's worth of math.

use candle_core::Tensor;
use gemm::Parallelism;

use crate::error::Result;
use crate::model::Target;

/// The loss and its targets.
pub(crate) enum Loss<'a> {
    /// Mean squared error of the single output against these values.
    Mse(&'a [f32]),
    /// Mean softmax cross-entropy against these class ids.
    SoftmaxCe(&'a [u32]),
}

/// The one `unsafe` block of the crate (the workspace denies `unsafe_code`): `gemm`
/// takes raw pointers and strides.
///
/// `c = a · b` (or `c += a · b` when `acc`) with `c` row-major `[m, n]`; `a` is `[m, k]`
/// (stored transposed as `[k, m]` when `ta`) and `b` is `[k, n]` (stored transposed as
/// `[n, k]` when `tb`).
#[allow(clippy::too_many_arguments, unsafe_code)]
fn matmul(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    c: &mut [f32],
    acc: bool,
) {
    assert!(a.len() == m * k && b.len() == k * n && c.len() == m * n);
    let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (b_rs, b_cs) = if tb { (1, k as isize) } else { (n as isize, 1) };
    // SAFETY: the lengths asserted above make every element the strides address lie
    // within its slice; `c` is borrowed mutably, so it aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            acc,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// The layers' outputs for `n` inputs `x` (`[n, widths[0]]`): one `[n, widths[i + 1]]`
/// per layer, after the ReLU but for the last (the network's outputs).
pub(crate) fn forward(widths: &[usize], params: &[Vec<f32>], x: &[f32], n: usize) -> Vec<Vec<f32>> {
    let layers = widths.len() - 1;
    let mut outs: Vec<Vec<f32>> = Vec::with_capacity(layers);
    for i in 0..layers {
        let (din, dout) = (widths[i], widths[i + 1]);
        let input = if i == 0 { x } else { &outs[i - 1] };
        let mut z = vec![0f32; n * dout];
        matmul(
            n,
            dout,
            din,
            input,
            false,
            &params[2 * i],
            false,
            &mut z,
            false,
        );
        let bias = &params[2 * i + 1];
        let relu = i + 1 < layers;
        for row in z.chunks_exact_mut(dout) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
                if relu && *v < 0.0 {
                    *v = 0.0;
                }
            }
        }
        outs.push(z);
    }
    outs
}

/// The mean loss of outputs `out` (`[n, classes]`, or `[n, 1]` for [`Loss::Mse`]) and,
/// into `grad` when given, its gradient with respect to them.
pub(crate) fn loss(out: &[f32], n: usize, target: &Loss<'_>, mut grad: Option<&mut [f32]>) -> f64 {
    let width = out.len() / n;
    let scale = 1.0 / n as f32;
    let mut total = 0f64;
    match target {
        Loss::Mse(y) => {
            for r in 0..n {
                let d = out[r] - y[r];
                total += f64::from(d * d);
                if let Some(g) = grad.as_deref_mut() {
                    g[r] = 2.0 * d * scale;
                }
            }
        }
        Loss::SoftmaxCe(ids) => {
            for (r, row) in out.chunks_exact(width).enumerate() {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
                let class = ids[r] as usize;
                total += f64::from(max + sum.ln() - row[class]);
                if let Some(g) = grad.as_deref_mut() {
                    let g = &mut g[r * width..(r + 1) * width];
                    for (j, (gj, &v)) in g.iter_mut().zip(row).enumerate() {
                        let p = (v - max).exp() / sum;
                        *gj = (p - f32::from(u8::from(j == class))) * scale;
                    }
                }
            }
        }
    }
    total / n as f64
}

/// One step: the mean loss and the gradients in parameter order (`w0, b0, w1, b1, ...`).
pub(crate) fn step(
    widths: &[usize],
    params: &[Vec<f32>],
    x: &[f32],
    n: usize,
    target: &Loss<'_>,
) -> (f64, Vec<Vec<f32>>) {
    let (value, grads, _) = backward(widths, params, x, n, target, false);
    (value, grads)
}

/// [`step`], and the gradient with respect to the inputs `x` (`[n, widths[0]]`): for a
/// network whose inputs are themselves trained (embeddings).
pub(crate) fn step_with_input_grad(
    widths: &[usize],
    params: &[Vec<f32>],
    x: &[f32],
    n: usize,
    target: &Loss<'_>,
) -> (f64, Vec<Vec<f32>>, Vec<f32>) {
    backward(widths, params, x, n, target, true)
}

fn backward(
    widths: &[usize],
    params: &[Vec<f32>],
    x: &[f32],
    n: usize,
    target: &Loss<'_>,
    input_grad: bool,
) -> (f64, Vec<Vec<f32>>, Vec<f32>) {
    let layers = widths.len() - 1;
    let outs = forward(widths, params, x, n);
    let mut dz = vec![0f32; n * widths[layers]];
    let value = loss(&outs[layers - 1], n, target, Some(&mut dz));
    let mut grads: Vec<Vec<f32>> = vec![Vec::new(); 2 * layers];
    let mut dx = Vec::new();
    for i in (0..layers).rev() {
        let (din, dout) = (widths[i], widths[i + 1]);
        let input = if i == 0 { x } else { &outs[i - 1] };
        let mut gw = vec![0f32; din * dout];
        matmul(din, dout, n, input, true, &dz, false, &mut gw, false);
        let mut gb = vec![0f32; dout];
        for row in dz.chunks_exact(dout) {
            for (g, v) in gb.iter_mut().zip(row) {
                *g += v;
            }
        }
        grads[2 * i] = gw;
        grads[2 * i + 1] = gb;
        if i > 0 || input_grad {
            // Through this layer's weights, then the previous layer's ReLU (its output
            // is positive exactly where its input was); the inputs have none.
            let mut da = vec![0f32; n * din];
            matmul(
                n,
                din,
                dout,
                &dz,
                false,
                &params[2 * i],
                true,
                &mut da,
                false,
            );
            if i == 0 {
                dx = da;
                break;
            }
            for (d, &h) in da.iter_mut().zip(&outs[i - 1]) {
                if h <= 0.0 {
                    *d = 0.0;
                }
            }
            dz = da;
        }
    }
    (value, grads, dx)
}

/// [`step`] on a batch's tensors (f32 on the CPU).
pub(crate) fn step_batch(
    widths: &[usize],
    params: &[Vec<f32>],
    x: &Tensor,
    target: &Target,
    n: usize,
) -> Result<(f64, Vec<Vec<f32>>)> {
    with_host(x, |x| {
        with_target(target, |t| step(widths, params, x, n, &t))
    })?
}

/// The mean loss and the correct predictions (0 for regression) of a batch.
pub(crate) fn evaluate_batch(
    widths: &[usize],
    params: &[Vec<f32>],
    x: &Tensor,
    target: &Target,
    n: usize,
) -> Result<(f64, u64)> {
    with_host(x, |x| {
        with_target(target, |t| {
            let outs = forward(widths, params, x, n);
            let out = &outs[outs.len() - 1];
            let mean = loss(out, n, &t, None);
            let correct = match t {
                Loss::Mse(_) => 0,
                Loss::SoftmaxCe(ids) => {
                    let width = out.len() / n;
                    out.chunks_exact(width)
                        .zip(ids)
                        .filter(|(row, y)| argmax(row) == **y as usize)
                        .count() as u64
                }
            };
            (mean, correct)
        })
    })?
}

/// The index of the largest value (the first of ties, as candle's `argmax`).
pub(crate) fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Calls `f` with the values of an f32 tensor on the CPU, borrowed when contiguous.
fn with_host<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&cpu.as_slice::<f32>()?[a..b]));
        }
    }
    Ok(f(&t.flatten_all()?.to_vec1::<f32>()?))
}

/// Calls `f` with the batch's targets as [`Loss`].
fn with_target<R>(target: &Target, f: impl FnOnce(Loss<'_>) -> R) -> Result<R> {
    match target {
        Target::Values(y) => with_host(y, |y| f(Loss::Mse(y))),
        Target::Classes { ids, .. } => Ok(f(Loss::SoftmaxCe(ids))),
    }
}
