//! Floats on the wire: little-endian IEEE-754 `f32` packed in protobuf `bytes` fields.
//!
//! Converting element by element compiles to plain copies on little-endian machines. A
//! reader that only reads the floats takes them in place with [`floats`] when the bytes
//! happen to be aligned (a checked, safe reinterpretation), and decodes them otherwise.

use bytes::Bytes;

use crate::optim::ClipPlan;

/// Bytes of `n` floats.
pub fn byte_len(n: usize) -> Option<usize> {
    n.checked_mul(4)
}

/// Floats converted per round through a stack buffer (so the output is written once,
/// without zero-filling it first).
const CHUNK: usize = 1024;

/// Encodes `f` of each value, and says whether every value (before `f`) was finite: the
/// check rides on the encoding's pass (no early exit: it vectorises).
fn encode_with(values: &[f32], f: impl Fn(f32) -> f32) -> (Bytes, bool) {
    let mut out = Vec::with_capacity(values.len() * 4);
    let mut tmp = [0u8; CHUNK * 4];
    let mut bad = 0u32;
    for chunk in values.chunks(CHUNK) {
        let n = chunk.len() * 4;
        for (c, v) in tmp[..n].chunks_exact_mut(4).zip(chunk) {
            bad |= u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000);
            c.copy_from_slice(&f(*v).to_le_bytes());
        }
        out.extend_from_slice(&tmp[..n]);
    }
    (Bytes::from(out), bad == 0)
}

/// Encodes `values` as little-endian bytes (on a little-endian machine, one copy).
pub fn encode(values: &[f32]) -> Bytes {
    #[cfg(target_endian = "little")]
    return Bytes::copy_from_slice(bytemuck::cast_slice(values));
    #[cfg(not(target_endian = "little"))]
    encode_with(values, |v| v).0
}

/// Encodes `values` transformed by a clipping plan, and says whether every value (before
/// clipping) was finite, in the same pass.
pub fn encode_clipped(values: &[f32], plan: &ClipPlan) -> (Bytes, bool) {
    if plan.is_identity() {
        return encode_with(values, |v| v);
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

/// The floats of `src` (whole floats; a trailing partial one is ignored): `src` itself
/// when it is 4-byte aligned on a little-endian machine, else decoded into `scratch`.
pub fn floats<'a>(src: &'a [u8], scratch: &'a mut Vec<f32>) -> &'a [f32] {
    let whole = &src[..src.len() / 4 * 4];
    #[cfg(target_endian = "little")]
    if let Ok(f) = bytemuck::try_cast_slice::<u8, f32>(whole) {
        return f;
    }
    scratch.clear();
    scratch.resize(whole.len() / 4, 0.0);
    decode_into(whole, scratch);
    scratch
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
            decode(&encode_clipped(&[4.0, -0.5], &plan).0),
            vec![0.5, -0.25]
        );
        // The finiteness said is the values' before clipping: a clipped infinity is
        // still refused.
        assert!(encode_clipped(&[4.0, -0.5], &plan).1);
        assert!(!encode_clipped(&[f32::INFINITY, 0.0], &plan).1);
        assert!(!encode_clipped(&[0.0, f32::NAN], &ClipPlan::NONE).1);
        assert!(encode_clipped(&[], &ClipPlan::NONE).1);
    }

    #[test]
    fn floats_in_place_or_decoded_are_the_same() {
        let v: Vec<f32> = (0..37).map(|i| i as f32 - 3.5).collect();
        let bytes = encode(&v);
        // The same bytes at every alignment, and with a partial float at the end.
        let mut buf = vec![0u8; bytes.len() + 8];
        for off in 0..4 {
            buf[off..off + bytes.len()].copy_from_slice(&bytes);
            let mut scratch = Vec::new();
            assert_eq!(floats(&buf[off..off + bytes.len()], &mut scratch), &v[..]);
            assert_eq!(
                floats(&buf[off..off + bytes.len() + 3], &mut scratch),
                &v[..]
            );
        }
        let aligned: Vec<f32> = v.clone();
        let mut scratch = Vec::new();
        let read = floats(bytemuck::cast_slice(&aligned), &mut scratch);
        assert_eq!(read, &v[..]);
        assert!(scratch.is_empty(), "aligned floats are read in place");
    }
}
