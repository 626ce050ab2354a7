//! Floats on the wire: little-endian IEEE-754 `f32` packed in protobuf `bytes` fields.
//!
//! Converting element by element compiles to plain copies on little-endian machines; no
//! `unsafe` reinterpretation is needed (and received buffers carry no alignment).

use bytes::Bytes;

use crate::optim::ClipPlan;

/// Bytes of `n` floats.
pub fn byte_len(n: usize) -> Option<usize> {
    n.checked_mul(4)
}

/// Floats converted per round through a stack buffer (so the output is written once,
/// without zero-filling it first).
const CHUNK: usize = 1024;

fn encode_with(values: &[f32], f: impl Fn(f32) -> f32) -> Bytes {
    let mut out = Vec::with_capacity(values.len() * 4);
    let mut tmp = [0u8; CHUNK * 4];
    for chunk in values.chunks(CHUNK) {
        let n = chunk.len() * 4;
        for (c, v) in tmp[..n].chunks_exact_mut(4).zip(chunk) {
            c.copy_from_slice(&f(*v).to_le_bytes());
        }
        out.extend_from_slice(&tmp[..n]);
    }
    Bytes::from(out)
}

/// Encodes `values` as little-endian bytes.
pub fn encode(values: &[f32]) -> Bytes {
    encode_with(values, |v| v)
}

/// Encodes `values` transformed by a clipping plan.
pub fn encode_clipped(values: &[f32], plan: &ClipPlan) -> Bytes {
    if plan.is_identity() {
        return encode(values);
    }
    encode_with(values, |v| plan.value(v))
}

/// Decodes `src` (whole floats) into `dst`; copies `min(src.len() / 4, dst.len())`.
#[inline]
pub fn decode_into(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// Decodes `src` into a new vector (a trailing partial float is ignored).
pub fn decode(src: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; src.len() / 4];
    decode_into(src, &mut out);
    out
}

/// Adds the floats of `src` into `acc`.
#[inline]
pub fn add_into(src: &[u8], acc: &mut [f32]) {
    for (a, c) in acc.iter_mut().zip(src.chunks_exact(4)) {
        *a += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// Whether every float of `src` is finite (neither NaN nor infinite).
pub fn all_finite(src: &[u8]) -> bool {
    // An f32 is finite iff its exponent bits are not all ones; fold the check so the
    // loop has no early exit and vectorises.
    let mut bad = 0u32;
    for c in src.chunks_exact(4) {
        let bits = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        bad |= u32::from(bits & 0x7f80_0000 == 0x7f80_0000);
    }
    bad == 0
}

/// Whether every value is finite, as [`all_finite`] (no early exit: it vectorises).
pub fn floats_finite(values: &[f32]) -> bool {
    let mut bad = 0u32;
    for v in values {
        bad |= u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000);
    }
    bad == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let long: Vec<f32> = (0..5000).map(|i| i as f32 * 0.5 - 7.0).collect();
        assert_eq!(decode(&encode(&long)), long);
        let v = vec![0.0f32, -1.5, 3.25e-7, f32::MAX, f32::MIN_POSITIVE];
        let b = encode(&v);
        assert_eq!(b.len(), 20);
        assert_eq!(decode(&b), v);
        let mut acc = vec![1.0f32; 5];
        add_into(&encode(&[1.0, 2.0, 3.0, 4.0, 5.0]), &mut acc);
        assert_eq!(acc, vec![2.0, 3.0, 4.0, 5.0, 6.0]);
    }

    #[test]
    fn finiteness() {
        assert!(all_finite(&encode(&[0.0, -0.0, 1e38, -1e-40])));
        assert!(!all_finite(&encode(&[1.0, f32::NAN])));
        assert!(!all_finite(&encode(&[f32::INFINITY])));
        assert!(!all_finite(&encode(&[f32::NEG_INFINITY, 2.0])));
        assert!(all_finite(&[]));
        for v in [
            [0.0, -0.0, 1e38, -1e-40],
            [1.0, f32::NAN, 0.0, 0.0],
            [f32::INFINITY; 4],
        ] {
            assert_eq!(floats_finite(&v), all_finite(&encode(&v)), "{v:?}");
        }
        assert!(!floats_finite(&[2.0, f32::NEG_INFINITY]) && floats_finite(&[]));
    }

    #[test]
    fn clipped_encoding() {
        let plan = ClipPlan {
            max_value: Some(1.0),
            scale: 0.5,
            norm: 0.0,
        };
        assert_eq!(
            decode(&encode_clipped(&[4.0, -0.5], &plan)),
            vec![0.5, -0.25]
        );
    }
}
