//! The 20-byte chunk header.
//!
//! ```text
//! offset  size  field (all little-endian u32)
//!      0     4  magic number 0x01020304
//!      4     4  CRC32 (IEEE) of the stored (compressed) payload
//!      8     4  compressor id (0 none, 1 snappy, 2 gzip, 3 zstd)
//!     12     4  stored (compressed) payload size in bytes
//!     16     4  number of records in the chunk
//! ```
//!
//! The header is followed by the payload. Uncompressed, a payload is a sequence of
//! records, each a little-endian u32 length followed by that many bytes.

use crate::compress::Compressor;
use crate::error::CorruptionKind;

/// The magic number that starts every chunk.
pub const MAGIC: u32 = 0x0102_0304;

/// The magic number as it appears on disk.
pub(crate) const MAGIC_BYTES: [u8; 4] = MAGIC.to_le_bytes();

/// Size of a chunk header in bytes.
pub const HEADER_LEN: usize = 20;

/// A decoded chunk header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    /// CRC32 (IEEE) of the stored payload.
    pub crc32: u32,
    /// How the payload is compressed.
    pub compressor: Compressor,
    /// Size of the stored payload in bytes.
    pub compressed_len: u32,
    /// Number of records in the payload.
    pub records: u32,
}

impl ChunkHeader {
    /// The on-disk bytes of this header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let fields = [
            MAGIC,
            self.crc32,
            self.compressor.id(),
            self.compressed_len,
            self.records,
        ];
        for (dst, field) in out.chunks_exact_mut(4).zip(fields) {
            dst.copy_from_slice(&field.to_le_bytes());
        }
        out
    }

    /// Decodes a header, checking the magic number and the compressor id.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<ChunkHeader, CorruptionKind> {
        let field = |i: usize| {
            let mut word = [0u8; 4];
            word.copy_from_slice(&bytes[i * 4..i * 4 + 4]);
            u32::from_le_bytes(word)
        };
        let magic = field(0);
        if magic != MAGIC {
            return Err(CorruptionKind::BadMagic { found: magic });
        }
        let id = field(2);
        let compressor = Compressor::from_id(id).ok_or(CorruptionKind::UnknownCompressor(id))?;
        Ok(ChunkHeader {
            crc32: field(1),
            compressor,
            compressed_len: field(3),
            records: field(4),
        })
    }

    /// Size of the chunk on disk: header plus stored payload.
    pub fn chunk_len(&self) -> u64 {
        HEADER_LEN as u64 + u64::from(self.compressed_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trip() {
        for compressor in Compressor::ALL {
            let h = ChunkHeader {
                crc32: 0x8765_4321,
                compressor,
                compressed_len: 0x00ab_cdef,
                records: 7,
            };
            assert_eq!(ChunkHeader::decode(&h.encode()), Ok(h));
            assert_eq!(h.chunk_len(), 20 + 0x00ab_cdef);
        }
    }

    #[test]
    fn decode_rejects_bad_magic_and_unknown_compressor() {
        let mut bytes = ChunkHeader {
            crc32: 1,
            compressor: Compressor::None,
            compressed_len: 2,
            records: 3,
        }
        .encode();
        bytes[8] = 9;
        assert_eq!(
            ChunkHeader::decode(&bytes),
            Err(CorruptionKind::UnknownCompressor(9))
        );
        bytes[0] = 0;
        assert_eq!(
            ChunkHeader::decode(&bytes),
            Err(CorruptionKind::BadMagic { found: 0x0102_0300 })
        );
    }
}
