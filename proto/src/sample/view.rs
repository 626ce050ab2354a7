//! [`view`]: a dense sample read in place from its record, without decoding it into a new
//! [`Sample`](super::Sample): the features stay the record's own little-endian bytes, so a
//! model copies them once, straight into its batch.
//!
//! Only the layout every writer of this encoding produces is read in place: the version,
//! the dense features as one packed field, a label, and fields this build does not know
//! (skipped, as protobuf does). Anything else (features unpacked or split over several
//! fields, sparse ids or weights, a version this build does not read, bytes that are not
//! protobuf) is `None`, and the caller decodes the record with
//! [`decode`](super::decode), which reads every valid layout and words every error. So
//! `view` never accepts what `decode` refuses, and where both read a record they agree
//! (the property test below).

use super::SAMPLE_VERSION;
use super::sample::Label;

/// A dense sample read in place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleView<'a> {
    /// The dense features: little-endian `f32`s, 4 bytes each.
    pub dense: &'a [u8],
    /// The label, if any (the last one written, as protobuf's `oneof`).
    pub label: Option<Label>,
}

impl SampleView<'_> {
    /// The number of dense features.
    pub fn features(&self) -> usize {
        self.dense.len() / 4
    }
}

/// Reads `bytes` in place if it is a dense sample in the usual layout (see the module's
/// documentation); `None` otherwise, for [`decode`](super::decode) to read or refuse.
pub fn view(bytes: &[u8]) -> Option<SampleView<'_>> {
    let mut r = Reader { buf: bytes };
    let mut version = 0u32;
    let mut dense: Option<&[u8]> = None;
    let mut label = None;
    while !r.buf.is_empty() {
        let key = r.varint()?;
        if key > u64::from(u32::MAX) {
            return None;
        }
        let (field, wire) = (key >> 3, key & 7);
        match (field, wire) {
            (0, _) => return None,
            // uint32 fields keep a varint's low 32 bits, as prost does.
            (1, 0) => version = r.varint()? as u32,
            (2, 2) => {
                let packed = r.len_delimited()?;
                if dense.is_some() || packed.len() % 4 != 0 {
                    return None;
                }
                dense = Some(packed);
            }
            (5, 5) => label = Some(Label::Value(f32::from_le_bytes(r.fixed()?))),
            (6, 0) => label = Some(Label::ClassId(r.varint()? as u32)),
            // Known fields in another layout, or sparse features: the full decoder.
            (1..=6, _) => return None,
            (_, 0) => {
                r.varint()?;
            }
            (_, 1) => {
                r.take(8)?;
            }
            (_, 2) => {
                r.len_delimited()?;
            }
            (_, 5) => {
                r.take(4)?;
            }
            _ => return None,
        }
    }
    (version == SAMPLE_VERSION).then_some(SampleView {
        dense: dense.unwrap_or_default(),
        label,
    })
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.buf.len() {
            return None;
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Some(head)
    }

    fn fixed(&mut self) -> Option<[u8; 4]> {
        self.take(4)?.try_into().ok()
    }

    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for i in 0..10 {
            let &b = self.buf.get(i)?;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                // A tenth byte may only carry the top bit.
                if i == 9 && b > 1 {
                    return None;
                }
                self.buf = &self.buf[i + 1..];
                return Some(v);
            }
        }
        None
    }

    fn len_delimited(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.varint()?).ok()?;
        self.take(n)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use prost::Message;

    use super::super::{Sample, decode, encode};
    use super::*;

    /// Floats compared by their bits: a damaged byte can make a NaN, which
    /// is not equal to itself.
    fn bits(bytes: &[u8]) -> Vec<u32> {
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn label_bits(label: Option<Label>) -> Option<(bool, u32)> {
        label.map(|l| match l {
            Label::ClassId(c) => (false, c),
            Label::Value(v) => (true, v.to_bits()),
        })
    }

    /// Where `view` reads a record, `decode` reads the same sample.
    fn agrees(bytes: &[u8]) -> Result<bool, TestCaseError> {
        let Some(v) = view(bytes) else {
            return Ok(false);
        };
        let s = decode(bytes).map_err(|e| TestCaseError::fail(format!("view read {e}")))?;
        let dense: Vec<u32> = s.dense.iter().map(|f| f.to_bits()).collect();
        prop_assert_eq!(bits(v.dense), dense);
        prop_assert_eq!(label_bits(v.label), label_bits(s.label));
        prop_assert!(s.sparse_ids.is_empty() && s.sparse_values.is_empty());
        Ok(true)
    }

    fn label() -> impl Strategy<Value = Option<Label>> {
        prop_oneof![
            Just(None),
            any::<u32>().prop_map(|c| Some(Label::ClassId(c))),
            any::<f32>().prop_map(|v| Some(Label::Value(v))),
        ]
    }

    proptest! {
        #[test]
        fn written_dense_samples_are_read_in_place(
            dense in prop::collection::vec(any::<f32>(), 0..40),
            label in label(),
        ) {
            let s = Sample { version: SAMPLE_VERSION, dense, label, ..Default::default() };
            let bytes = encode(&s);
            prop_assert!(agrees(&bytes)?, "a written dense sample is read in place");
        }

        #[test]
        fn any_bytes_read_in_place_decode_the_same(
            bytes in prop::collection::vec(any::<u8>(), 0..64),
        ) {
            agrees(&bytes)?;
        }

        #[test]
        fn damaged_samples_read_in_place_decode_the_same(
            dense in prop::collection::vec(any::<f32>(), 1..8),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
            cut in any::<bool>(),
        ) {
            let mut bytes = encode(&Sample::classification(dense, 3));
            let i = at.index(bytes.len());
            if cut { bytes.truncate(i) } else { bytes[i] = byte }
            agrees(&bytes)?;
        }
    }

    #[test]
    fn other_layouts_go_to_the_full_decoder() {
        let with = |f: &dyn Fn(&mut Sample)| {
            let mut s = Sample::classification(vec![1.0, 2.0], 4);
            f(&mut s);
            encode(&s)
        };
        assert!(view(&with(&|_| ())).is_some());
        for bytes in [
            with(&|s| s.version = 2),
            with(&|s| s.version = 0),
            with(&|s| s.sparse_ids = vec![7]),
            with(&|s| s.sparse_values = vec![0.5]),
            // Features written unpacked (field 2 as fixed32s): valid, decoded fully.
            [8, 1, 0x15, 0, 0, 0x80, 0x3f].to_vec(),
            // Two packed runs of features: protobuf concatenates them.
            [8, 1, 0x12, 4, 0, 0, 0x80, 0x3f, 0x12, 4, 0, 0, 0, 0x40].to_vec(),
        ] {
            assert!(view(&bytes).is_none(), "{bytes:?}");
        }
        let two = [8, 1, 0x12, 4, 0, 0, 0x80, 0x3f, 0x12, 4, 0, 0, 0, 0x40];
        assert_eq!(decode(&two).unwrap().dense, vec![1.0, 2.0]);
        // An unknown field is skipped, as the full decoder does.
        let mut s = Sample::regression(vec![0.25], 9.0).encode_to_vec();
        s.extend_from_slice(&[0x38, 5]);
        let v = view(&s).unwrap();
        assert_eq!(
            (bits(v.dense), label_bits(v.label)),
            (vec![0.25f32.to_bits()], Some((true, 9.0f32.to_bits())))
        );
        assert_eq!(v.features(), 1);
    }
}
