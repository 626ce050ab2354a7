//! The CTR-DNN's step and evaluation through candle, on any device (a GPU in a CUDA
//! build): the same network and loss as the CPU path (`fc_cpu`), with the input's
//! gradient taken by autograd so the rows get theirs. The inputs are assembled on the
//! host (the rows come from the pservers there) and uploaded once per batch; the
//! gradients come back once per batch.

use candle_core::{D, DType, Device, Tensor, Var};

use crate::error::Result;

/// The network's logits `[n, 2]` for inputs `x` `[n, widths[0]]`: ReLU after every layer
/// but the last.
fn logits(x: &Tensor, layers: &[(Tensor, Tensor)]) -> candle_core::Result<Tensor> {
    let mut h = x.clone();
    for (i, (w, b)) in layers.iter().enumerate() {
        h = h.matmul(w)?.broadcast_add(b)?;
        if i + 1 < layers.len() {
            h = h.relu()?;
        }
    }
    Ok(h)
}

fn upload(
    widths: &[usize],
    dense: &[Vec<f32>],
    device: &Device,
) -> candle_core::Result<Vec<(Var, Var)>> {
    widths
        .windows(2)
        .zip(dense.chunks_exact(2))
        .map(|(w, p)| {
            Ok((
                Var::from_slice(&p[0], (w[0], w[1]), device)?,
                Var::from_slice(&p[1], w[1], device)?,
            ))
        })
        .collect()
}

/// Mean softmax cross-entropy, the dense gradients (`fc{i}.w`, `fc{i}.b`, ...) and the
/// gradient of the inputs `[n * widths[0]]`.
pub(super) fn step(
    widths: &[usize],
    dense: &[Vec<f32>],
    x: Vec<f32>,
    labels: &[u32],
    device: &Device,
) -> Result<(f64, Vec<Vec<f32>>, Vec<f32>)> {
    let n = labels.len();
    let x = Var::from_vec(x, (n, widths[0]), device)?;
    let vars = upload(widths, dense, device)?;
    let layers: Vec<_> = vars
        .iter()
        .map(|(w, b)| (w.as_tensor().clone(), b.as_tensor().clone()))
        .collect();
    let out = logits(x.as_tensor(), &layers)?;
    let y = Tensor::from_slice(labels, n, device)?;
    let loss = candle_nn::loss::cross_entropy(&out, &y)?;
    let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    if !value.is_finite() {
        return Ok((value, Vec::new(), Vec::new()));
    }
    let grads = loss.backward()?;
    let grad = |v: &Var, len: usize| -> candle_core::Result<Vec<f32>> {
        match grads.get(v.as_tensor()) {
            Some(g) => g.flatten_all()?.to_vec1::<f32>(),
            None => Ok(vec![0.0; len]),
        }
    };
    let mut out = Vec::with_capacity(dense.len());
    for ((w, b), p) in vars.iter().zip(dense.chunks_exact(2)) {
        out.push(grad(w, p[0].len())?);
        out.push(grad(b, p[1].len())?);
    }
    let dx = grad(&x, n * widths[0])?;
    Ok((value, out, dx))
}

/// Mean softmax cross-entropy and the number of samples whose larger logit is their
/// class.
pub(super) fn evaluate(
    widths: &[usize],
    dense: &[Vec<f32>],
    x: Vec<f32>,
    labels: &[u32],
    device: &Device,
) -> Result<(f64, u64)> {
    let n = labels.len();
    let x = Tensor::from_vec(x, (n, widths[0]), device)?;
    let layers: Vec<_> = upload(widths, dense, device)?
        .into_iter()
        .map(|(w, b)| (w.as_detached_tensor(), b.as_detached_tensor()))
        .collect();
    let out = logits(&x, &layers)?;
    let y = Tensor::from_slice(labels, n, device)?;
    let mean = candle_nn::loss::cross_entropy(&out, &y)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    let predicted = out.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let correct = predicted.iter().zip(labels).filter(|(p, y)| p == y).count() as u64;
    Ok((mean, correct))
}
