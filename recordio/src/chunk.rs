//! A decoded chunk: its decompressed payload and the positions of its records, so records
//! are handed out as slices without a per-record allocation.

use std::fmt;
use std::iter::FusedIterator;

use crate::compress::Compressor;
use crate::error::CorruptionKind;
use crate::header::ChunkHeader;
use crate::index::ChunkMeta;

/// Length of the record length prefix.
const LEN_PREFIX: usize = 4;

/// One decoded chunk.
///
/// A `Chunk` can be reused across reads
/// ([`ChunkReader::next_chunk_into`](crate::ChunkReader::next_chunk_into)), which keeps
/// its buffers and avoids allocating per chunk.
#[derive(Clone, Default)]
pub struct Chunk {
    /// Ordinal of the chunk in its file (0-based). After a lenient reader skipped a corrupt
    /// region, each skipped region counts as one chunk.
    pub index: u64,
    /// Byte offset of the chunk header in its file.
    pub offset: u64,
    header: Option<ChunkHeader>,
    /// Decompressed payload; only the first `payload_len` bytes are meaningful (the
    /// buffer is never shrunk so that reuse does not re-zero it).
    data: Vec<u8>,
    payload_len: usize,
    /// `(start, end)` of each record within `data`.
    spans: Vec<(usize, usize)>,
}

impl fmt::Debug for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chunk")
            .field("index", &self.index)
            .field("offset", &self.offset)
            .field("header", &self.header)
            .field("payload_len", &self.payload_len)
            .field("records", &self.spans.len())
            .finish()
    }
}

impl Chunk {
    /// Number of records.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether the chunk holds no records.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Record `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        let &(start, end) = self.spans.get(i)?;
        self.data.get(start..end)
    }

    /// The records, in order.
    pub fn iter(&self) -> Records<'_> {
        Records {
            data: &self.data,
            spans: self.spans.iter(),
        }
    }

    /// Copies the records out.
    pub fn to_vecs(&self) -> Vec<Vec<u8>> {
        self.iter().map(<[u8]>::to_vec).collect()
    }

    /// The header the chunk was read with (`None` for a `Chunk` never filled).
    pub fn header(&self) -> Option<ChunkHeader> {
        self.header
    }

    /// How the payload was stored (`Compressor::None` for a `Chunk` never filled).
    pub fn compressor(&self) -> Compressor {
        self.header.map_or(Compressor::None, |h| h.compressor)
    }

    /// Size of the decompressed payload (records plus their 4-byte length prefixes).
    pub fn payload_len(&self) -> usize {
        self.payload_len
    }

    /// Sum of the record lengths.
    pub fn record_bytes(&self) -> u64 {
        // The payload is exactly the records and their prefixes (checked when parsed).
        (self.payload_len as u64).saturating_sub((LEN_PREFIX * self.spans.len()) as u64)
    }

    /// The chunk's entry as it would appear in a [`ChunkIndex`](crate::ChunkIndex).
    pub fn meta(&self) -> Option<ChunkMeta> {
        self.header.map(|h| ChunkMeta::from_header(self.offset, &h))
    }

    /// Clears the chunk's contents, keeping its buffers.
    pub(crate) fn reset(&mut self) {
        self.header = None;
        self.payload_len = 0;
        self.spans.clear();
    }

    /// The payload buffer, at least `len` bytes long, to be filled by a raw read. The
    /// buffer only grows, so a reused chunk does not re-zero memory on every read.
    pub(crate) fn raw_buffer(&mut self, len: usize) -> &mut [u8] {
        if self.data.len() < len {
            self.data.resize(len, 0);
        }
        &mut self.data[..len]
    }

    /// The payload buffer for a decompressor to fill (from empty).
    pub(crate) fn decompress_buffer(&mut self) -> &mut Vec<u8> {
        &mut self.data
    }

    /// Parses the first `payload_len` bytes of the buffer as the records of a chunk with
    /// `header`, which also becomes the chunk's header.
    pub(crate) fn parse(
        &mut self,
        header: ChunkHeader,
        payload_len: usize,
    ) -> Result<(), CorruptionKind> {
        self.spans.clear();
        let Some(payload) = self.data.get(..payload_len) else {
            return Err(CorruptionKind::BadRecordFraming(format!(
                "payload of {payload_len} bytes is not in the buffer"
            )));
        };
        parse_records(payload, header.records, &mut self.spans)?;
        self.header = Some(header);
        self.payload_len = payload_len;
        Ok(())
    }
}

impl<'a> IntoIterator for &'a Chunk {
    type Item = &'a [u8];
    type IntoIter = Records<'a>;

    fn into_iter(self) -> Records<'a> {
        self.iter()
    }
}

/// Iterator over the records of a [`Chunk`].
#[derive(Clone, Debug)]
pub struct Records<'a> {
    data: &'a [u8],
    spans: std::slice::Iter<'a, (usize, usize)>,
}

impl<'a> Iterator for Records<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let &(start, end) = self.spans.next()?;
        // Spans were checked against the payload when it was parsed.
        Some(self.data.get(start..end).unwrap_or_default())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.spans.size_hint()
    }
}

impl ExactSizeIterator for Records<'_> {}
impl FusedIterator for Records<'_> {}

/// Splits `payload` into records, writing their spans to `spans`, and checks that the
/// payload holds exactly `expected` whole records.
pub(crate) fn parse_records(
    payload: &[u8],
    expected: u32,
    spans: &mut Vec<(usize, usize)>,
) -> Result<(), CorruptionKind> {
    spans.clear();
    // Every record takes at least its prefix, so the payload bounds the count; the header
    // alone is not trusted for the allocation.
    spans.reserve((expected as usize).min(payload.len() / LEN_PREFIX));
    let mut pos = 0usize;
    while pos < payload.len() {
        let rest = payload.len() - pos;
        let Some(prefix) = payload.get(pos..pos + LEN_PREFIX) else {
            return Err(CorruptionKind::BadRecordFraming(format!(
                "{rest} trailing bytes at payload offset {pos} are too few for a record length"
            )));
        };
        let mut word = [0u8; LEN_PREFIX];
        word.copy_from_slice(prefix);
        let len = u32::from_le_bytes(word) as usize;
        let start = pos + LEN_PREFIX;
        let available = payload.len() - start;
        if len > available {
            return Err(CorruptionKind::BadRecordFraming(format!(
                "record {} at payload offset {pos} claims {len} bytes but only {available} follow",
                spans.len()
            )));
        }
        let end = start + len;
        spans.push((start, end));
        pos = end;
    }
    let found = u32::try_from(spans.len()).unwrap_or(u32::MAX);
    if found != expected || spans.len() > u32::MAX as usize {
        return Err(CorruptionKind::RecordCountMismatch {
            header: expected,
            found,
        });
    }
    Ok(())
}

/// Appends `record` to `payload` with its length prefix. The caller has checked that the
/// length fits a u32.
pub(crate) fn append_record(payload: &mut Vec<u8>, record: &[u8]) {
    let len = u32::try_from(record.len()).unwrap_or(u32::MAX);
    payload.reserve(LEN_PREFIX + record.len());
    payload.extend_from_slice(&len.to_le_bytes());
    payload.extend_from_slice(record);
}

/// Bytes a record takes in a payload.
pub(crate) fn framed_len(record_len: usize) -> usize {
    record_len.saturating_add(LEN_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(records: &[&[u8]]) -> Vec<u8> {
        let mut p = Vec::new();
        for r in records {
            append_record(&mut p, r);
        }
        p
    }

    #[test]
    fn parses_records_including_empty_ones() {
        let p = payload(&[b"ab", b"", b"cde"]);
        let mut spans = Vec::new();
        parse_records(&p, 3, &mut spans).unwrap();
        assert_eq!(spans, vec![(4, 6), (10, 10), (14, 17)]);
        parse_records(&[], 0, &mut spans).unwrap();
        assert!(spans.is_empty());
    }

    #[test]
    fn rejects_bad_framing_and_wrong_counts() {
        let p = payload(&[b"ab", b"cd"]);
        let mut spans = Vec::new();
        assert_eq!(
            parse_records(&p, 3, &mut spans),
            Err(CorruptionKind::RecordCountMismatch {
                header: 3,
                found: 2
            })
        );
        assert!(matches!(
            parse_records(&p[..p.len() - 1], 2, &mut spans),
            Err(CorruptionKind::BadRecordFraming(_))
        ));
        let mut trailing = p.clone();
        trailing.extend_from_slice(&[0, 0]);
        assert!(matches!(
            parse_records(&trailing, 2, &mut spans),
            Err(CorruptionKind::BadRecordFraming(_))
        ));
        let huge = u32::MAX.to_le_bytes();
        assert!(matches!(
            parse_records(&huge, 1, &mut spans),
            Err(CorruptionKind::BadRecordFraming(_))
        ));
    }

    #[test]
    fn chunk_hands_out_slices() {
        let p = payload(&[b"x", b"", b"yz"]);
        let mut chunk = Chunk::default();
        chunk.raw_buffer(p.len()).copy_from_slice(&p);
        let header = ChunkHeader {
            crc32: 0,
            compressor: Compressor::None,
            compressed_len: p.len() as u32,
            records: 3,
        };
        chunk.parse(header, p.len()).unwrap();
        assert_eq!(chunk.len(), 3);
        assert_eq!(chunk.get(2), Some(&b"yz"[..]));
        assert_eq!(chunk.get(3), None);
        assert_eq!(chunk.iter().len(), 3);
        assert_eq!(chunk.to_vecs(), vec![b"x".to_vec(), vec![], b"yz".to_vec()]);
        assert_eq!(chunk.record_bytes(), 3);
        assert_eq!(chunk.payload_len(), p.len());
        // A shorter payload reuses the buffer; stale bytes after it are ignored.
        let q = payload(&[b"q"]);
        chunk.raw_buffer(q.len()).copy_from_slice(&q);
        chunk
            .parse(
                ChunkHeader {
                    records: 1,
                    ..header
                },
                q.len(),
            )
            .unwrap();
        assert_eq!(chunk.to_vecs(), vec![b"q".to_vec()]);
    }
}
