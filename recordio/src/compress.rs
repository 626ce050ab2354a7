//! Chunk payload compressors: the [`Compressor`] ids stored in chunk headers and the
//! (bounded) compression and decompression of whole payloads.

use std::fmt;
use std::io::{self, Read, Write};
use std::str::FromStr;

use crate::error::CorruptionKind;

/// How a chunk payload is compressed; the id is stored in the chunk header.
///
/// Ids 0–2 are PaddlePaddle's. Snappy uses the snappy *framed stream* format, as Go's
/// `snappy.NewWriter` does; gzip is a standard gzip member. Zstd (id 3) is an extension of
/// this crate that Paddle's readers do not understand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Compressor {
    /// Stored as is (id 0).
    None,
    /// Snappy framed stream (id 1), the default.
    #[default]
    Snappy,
    /// Gzip (id 2).
    Gzip,
    /// Zstandard (id 3, not readable by PaddlePaddle).
    Zstd,
}

impl Compressor {
    /// Every compressor, in id order.
    pub const ALL: [Compressor; 4] = [
        Compressor::None,
        Compressor::Snappy,
        Compressor::Gzip,
        Compressor::Zstd,
    ];

    /// The id stored in chunk headers.
    pub const fn id(self) -> u32 {
        match self {
            Compressor::None => 0,
            Compressor::Snappy => 1,
            Compressor::Gzip => 2,
            Compressor::Zstd => 3,
        }
    }

    /// The compressor with header id `id`, if there is one.
    pub const fn from_id(id: u32) -> Option<Compressor> {
        match id {
            0 => Some(Compressor::None),
            1 => Some(Compressor::Snappy),
            2 => Some(Compressor::Gzip),
            3 => Some(Compressor::Zstd),
            _ => None,
        }
    }

    /// The lowercase name, as accepted by [`FromStr`].
    pub const fn name(self) -> &'static str {
        match self {
            Compressor::None => "none",
            Compressor::Snappy => "snappy",
            Compressor::Gzip => "gzip",
            Compressor::Zstd => "zstd",
        }
    }
}

impl fmt::Display for Compressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The error of parsing a [`Compressor`] name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseCompressorError {
    name: String,
}

impl fmt::Display for ParseCompressorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown compressor {:?} (expected none, snappy, gzip or zstd)",
            self.name
        )
    }
}

impl std::error::Error for ParseCompressorError {}

impl FromStr for Compressor {
    type Err = ParseCompressorError;

    /// Parses `none`, `snappy`, `gzip` or `zstd` (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Compressor::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| ParseCompressorError { name: s.to_owned() })
    }
}

/// Zstd level used for writing (zstd's own default).
const ZSTD_LEVEL: i32 = zstd::DEFAULT_COMPRESSION_LEVEL;

/// Reusable compression state of a writer.
#[derive(Default)]
pub(crate) struct Compression {
    zstd: Option<zstd::bulk::Compressor<'static>>,
}

impl fmt::Debug for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Compression")
            .field("zstd_context", &self.zstd.is_some())
            .finish()
    }
}

impl Compression {
    /// Appends `input` compressed with `compressor` to `out`. `Compressor::None` copies.
    pub(crate) fn compress(
        &mut self,
        compressor: Compressor,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> io::Result<()> {
        match compressor {
            Compressor::None => out.extend_from_slice(input),
            Compressor::Snappy => {
                let mut enc = snap::write::FrameEncoder::new(&mut *out);
                enc.write_all(input)?;
                enc.into_inner().map_err(|e| e.into_error())?;
            }
            Compressor::Gzip => {
                let mut enc =
                    flate2::write::GzEncoder::new(&mut *out, flate2::Compression::default());
                enc.write_all(input)?;
                enc.finish()?;
            }
            Compressor::Zstd => {
                let ctx = match &mut self.zstd {
                    Some(ctx) => ctx,
                    slot => slot.insert(zstd::bulk::Compressor::new(ZSTD_LEVEL)?),
                };
                // A `Vec` destination would be written from its start; compress into the
                // slice after what `out` already holds instead.
                let start = out.len();
                out.resize(start + zstd::zstd_safe::compress_bound(input.len()), 0);
                let written = ctx.compress_to_buffer(input, &mut out[start..]);
                out.truncate(start + *written.as_ref().unwrap_or(&0));
                written?;
            }
        }
        Ok(())
    }
}

/// Decompresses `input` into `out` (cleared first), producing at most `limit` bytes.
///
/// The output grows only as the decoder produces bytes, so neither a lying header nor a
/// decompression bomb can make this allocate more than about `limit` bytes.
pub(crate) fn decompress(
    compressor: Compressor,
    input: &[u8],
    out: &mut Vec<u8>,
    limit: u64,
) -> Result<(), CorruptionKind> {
    out.clear();
    let result = match compressor {
        Compressor::None => {
            if input.len() as u64 > limit {
                return Err(CorruptionKind::DecompressedTooLarge { limit });
            }
            out.extend_from_slice(input);
            return Ok(());
        }
        Compressor::Snappy => read_bounded(snap::read::FrameDecoder::new(input), out, limit),
        Compressor::Gzip => read_bounded(flate2::read::MultiGzDecoder::new(input), out, limit),
        Compressor::Zstd => zstd::stream::read::Decoder::with_buffer(input)
            .and_then(|dec| read_bounded(dec, out, limit)),
    };
    match result {
        Ok(n) if n > limit => Err(CorruptionKind::DecompressedTooLarge { limit }),
        Ok(_) => Ok(()),
        Err(e) => Err(CorruptionKind::Decompress(format!("{compressor}: {e}"))),
    }
}

/// Reads `reader` to its end into `out`, stopping after `limit + 1` bytes so the caller
/// can tell that the limit was exceeded. Returns the number of bytes read.
fn read_bounded(reader: impl Read, out: &mut Vec<u8>, limit: u64) -> io::Result<u64> {
    let n = reader.take(limit.saturating_add(1)).read_to_end(out)?;
    Ok(n as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        (0..100_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect()
    }

    #[test]
    fn ids_names_and_parsing_round_trip() {
        for c in Compressor::ALL {
            assert_eq!(Compressor::from_id(c.id()), Some(c));
            assert_eq!(c.to_string().parse::<Compressor>(), Ok(c));
            assert_eq!(c.name().to_uppercase().parse::<Compressor>(), Ok(c));
        }
        assert_eq!(Compressor::from_id(4), None);
        assert_eq!(Compressor::default(), Compressor::Snappy);
        let err = "lz4".parse::<Compressor>().unwrap_err();
        assert!(err.to_string().contains("lz4"));
    }

    #[test]
    fn every_compressor_round_trips() {
        let data = sample();
        let mut state = Compression::default();
        for c in Compressor::ALL {
            for input in [&data[..], &[][..], b"x"] {
                let mut packed = Vec::new();
                state.compress(c, input, &mut packed).unwrap();
                let mut unpacked = vec![1, 2, 3];
                decompress(c, &packed, &mut unpacked, 1 << 30).unwrap();
                assert_eq!(unpacked, input, "{c}");
            }
        }
    }

    #[test]
    fn snappy_uses_the_framed_stream_format() {
        let mut packed = Vec::new();
        Compression::default()
            .compress(Compressor::Snappy, b"hello hello hello", &mut packed)
            .unwrap();
        // Stream identifier chunk: type 0xff, length 6, "sNaPpY".
        assert_eq!(&packed[..10], b"\xff\x06\x00\x00sNaPpY");
    }

    #[test]
    fn decompression_is_bounded() {
        let zeros = vec![0u8; 4 << 20];
        let mut state = Compression::default();
        for c in Compressor::ALL {
            let mut packed = Vec::new();
            state.compress(c, &zeros, &mut packed).unwrap();
            let mut out = Vec::new();
            assert_eq!(
                decompress(c, &packed, &mut out, 1 << 20),
                Err(CorruptionKind::DecompressedTooLarge { limit: 1 << 20 }),
                "{c}"
            );
            assert!(out.len() <= (1 << 20) + 1);
            decompress(c, &packed, &mut out, 4 << 20).unwrap();
            assert_eq!(out.len(), 4 << 20);
        }
    }

    #[test]
    fn garbage_does_not_decompress() {
        let mut out = Vec::new();
        for c in [Compressor::Snappy, Compressor::Gzip, Compressor::Zstd] {
            let err = decompress(c, b"definitely not compressed", &mut out, 1 << 20).unwrap_err();
            assert!(matches!(err, CorruptionKind::Decompress(_)), "{c}: {err:?}");
        }
    }
}
