//! The bytes of one shard's checkpoint file: what a [`Snapshot`] holds, how it is
//! encoded, and how a file is parsed and verified.
//!
//! # File format (version 1)
//!
//! ```text
//! magic      8 bytes  "EDLPSCK\x01"
//! header_len u32 LE
//! header     JSON     FileHeader: uuid, step, shard, spec, counters, block and row
//!                     counts, the ledger (which task batches the values contain)
//! blocks     for each block:  id u32, len u32, version u64, t u64,
//!                             values f32[len], slots f32[slots * len]
//! tables     for each table, for each row: row u64, t u64,
//!                             values f32[dim], slots f32[slots * dim]
//! trailer    crc32c u32 LE of every byte before it, then "EDLPSEND"
//! ```
//!
//! All numbers little-endian. The parser checks the trailer and the checksum first, then
//! reads with bounds checks, every length from the file checked against the bytes left
//! before anything is allocated: a bad file is an error, never a panic. Durable writes and
//! the checks against a manifest's entry are in [`super::dir`].

use std::io::{self, Write};

use serde::{Deserialize, Serialize};

use crate::layout::ParamSpec;
use crate::optim::SlotState;
use crate::shard::Ledger;

const MAGIC: &[u8; 8] = b"EDLPSCK\x01";
const END_MAGIC: &[u8; 8] = b"EDLPSEND";
pub(super) const TRAILER_LEN: usize = 12;
const FORMAT_VERSION: u32 = 1;
/// Largest header accepted (the spec of a model with many parameters fits easily).
const MAX_HEADER: usize = 64 << 20;
/// Most optimizer slots per value a file may declare (Adam has two).
const MAX_SLOTS: usize = 16;
/// Bytes of a block's fixed fields (id, len, version, t).
const BLOCK_FIXED: usize = 24;
/// Bytes of a row's fixed fields (row, t).
const ROW_FIXED: usize = 16;

/// One dense block of a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockSnap {
    /// Global block id.
    pub id: u32,
    /// Its version.
    pub version: u64,
    /// Values.
    pub values: Vec<f32>,
    /// Optimizer state.
    pub state: SlotState,
}

/// One trained sparse row of a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct RowSnap {
    /// Row id.
    pub row: u64,
    /// Values.
    pub values: Vec<f32>,
    /// Optimizer state.
    pub state: SlotState,
}

/// A copy of a shard's state at one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// The checkpoint step (sync: the step last applied; async: the requested label).
    pub step: u64,
    /// The shard index.
    pub shard: u32,
    /// The shard count.
    pub shards: u32,
    /// The model spec and settings.
    pub spec: ParamSpec,
    /// Updates applied (drives the learning-rate schedule).
    pub updates: u64,
    /// Sync: the last step applied.
    pub last_closed: u64,
    /// The task batches the values contain.
    pub ledger: Ledger,
    /// The incarnation that wrote this as its final checkpoint, once it had stopped
    /// serving (so the values hold every push it answered); 0 for any other checkpoint.
    pub final_of: u64,
    /// Every block of the shard, in the shard's order.
    pub blocks: Vec<BlockSnap>,
    /// Trained rows of each table.
    pub tables: Vec<Vec<RowSnap>>,
}

#[derive(Debug, Serialize, Deserialize)]
struct FileHeader {
    format: u32,
    uuid: String,
    step: u64,
    shard: u32,
    shards: u32,
    updates: u64,
    last_closed: u64,
    slots: usize,
    blocks: u64,
    table_rows: Vec<u64>,
    spec: ParamSpec,
    /// Absent in files written before ledgers existed (they contain no task).
    #[serde(default)]
    ledger: Ledger,
    /// Absent in files written before final checkpoints said so (0: not one).
    #[serde(default)]
    final_of: u64,
}

/// A writer that computes the crc32c of what passes through and can fail like a full
/// disk after a quota (fault injection for tests).
struct CrcWriter<W> {
    inner: W,
    crc: u32,
    written: u64,
    quota: Option<u64>,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(q) = self.quota
            && self.written + buf.len() as u64 > q
        {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                "no space left on device (injected)",
            ));
        }
        let n = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn write_f32s<W: Write>(w: &mut W, values: &[f32], scratch: &mut Vec<u8>) -> io::Result<()> {
    for chunk in values.chunks(16 * 1024) {
        scratch.clear();
        scratch.reserve(chunk.len() * 4);
        for v in chunk {
            scratch.extend_from_slice(&v.to_le_bytes());
        }
        w.write_all(scratch)?;
    }
    Ok(())
}

/// `snap` in the file format, in memory (a replica's snapshot travels so).
/// Fails only on a header over the reader's bound.
pub(crate) fn encode(snap: &Snapshot) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    encode_to(snap, "replica", &mut buf, None)?;
    Ok(buf)
}

/// Writes `snap` in the file format; returns (size, crc32c).
pub(super) fn encode_to<W: Write>(
    snap: &Snapshot,
    uuid: &str,
    w: W,
    quota: Option<u64>,
) -> io::Result<(u64, u32)> {
    let mut w = CrcWriter {
        inner: w,
        crc: 0,
        written: 0,
        quota,
    };
    let slots = snap.blocks.first().map_or_else(
        || {
            snap.tables
                .iter()
                .flatten()
                .next()
                .map_or(0, |r| r.state.slots.len() / r.values.len().max(1))
        },
        |b| b.state.slots.len() / b.values.len().max(1),
    );
    let header = FileHeader {
        format: FORMAT_VERSION,
        uuid: uuid.to_owned(),
        step: snap.step,
        shard: snap.shard,
        shards: snap.shards,
        updates: snap.updates,
        last_closed: snap.last_closed,
        slots,
        blocks: snap.blocks.len() as u64,
        table_rows: snap.tables.iter().map(|t| t.len() as u64).collect(),
        spec: snap.spec.clone(),
        ledger: snap.ledger.clone(),
        final_of: snap.final_of,
    };
    let header = serde_json::to_vec(&header).map_err(io::Error::other)?;
    // A file whose header its reader refuses would be a checkpoint that cannot be
    // restored: refuse to write it (the previous checkpoint stays the newest).
    if header.len() > MAX_HEADER {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the checkpoint header (parameter spec and ledger) is {} bytes, over the \
                 {MAX_HEADER} a restore reads; the checkpoint is not written",
                header.len()
            ),
        ));
    }
    w.write_all(MAGIC)?;
    w.write_all(&(header.len() as u32).to_le_bytes())?;
    w.write_all(&header)?;
    let mut scratch = Vec::new();
    for b in &snap.blocks {
        w.write_all(&b.id.to_le_bytes())?;
        w.write_all(&(b.values.len() as u32).to_le_bytes())?;
        w.write_all(&b.version.to_le_bytes())?;
        w.write_all(&b.state.t.to_le_bytes())?;
        write_f32s(&mut w, &b.values, &mut scratch)?;
        write_f32s(&mut w, &b.state.slots, &mut scratch)?;
    }
    for t in &snap.tables {
        for r in t {
            w.write_all(&r.row.to_le_bytes())?;
            w.write_all(&r.state.t.to_le_bytes())?;
            write_f32s(&mut w, &r.values, &mut scratch)?;
            write_f32s(&mut w, &r.state.slots, &mut scratch)?;
        }
    }
    let crc = w.crc;
    w.write_all(&crc.to_le_bytes())?;
    w.write_all(END_MAGIC)?;
    w.flush()?;
    Ok((w.written, crc))
}

/// A bounds-checked reader over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| format!("truncated at byte {} (needed {n} more)", self.at))?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn f32s(&mut self, n: usize) -> Result<Vec<f32>, String> {
        let bytes = n
            .checked_mul(4)
            .ok_or_else(|| format!("absurd length {n}"))?;
        Ok(crate::wire::decode(self.take(bytes)?))
    }
}

/// Parses and verifies a whole checkpoint file; returns the snapshot and its uuid.
pub fn decode(bytes: &[u8]) -> Result<(Snapshot, String), String> {
    if bytes.len() < MAGIC.len() + 4 + TRAILER_LEN {
        return Err(format!("only {} bytes", bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err("bad magic (not an edl pserver checkpoint, or another version)".into());
    }
    let body_end = bytes.len() - TRAILER_LEN;
    if &bytes[body_end + 4..] != END_MAGIC {
        return Err("bad trailer (torn or truncated write)".into());
    }
    let stored = u32::from_le_bytes([
        bytes[body_end],
        bytes[body_end + 1],
        bytes[body_end + 2],
        bytes[body_end + 3],
    ]);
    let actual = crc32c::crc32c(&bytes[..body_end]);
    if stored != actual {
        return Err(format!(
            "crc32c mismatch: trailer says {stored:08x}, content hashes to {actual:08x}"
        ));
    }
    let mut c = Cursor {
        buf: &bytes[..body_end],
        at: 8,
    };
    let hlen = c.u32()? as usize;
    if hlen > MAX_HEADER {
        return Err(format!("header of {hlen} bytes"));
    }
    let header: FileHeader = serde_json::from_slice(c.take(hlen)?)
        .map_err(|e| format!("header is not valid JSON: {e}"))?;
    if header.format != FORMAT_VERSION {
        return Err(format!(
            "format version {} (this build reads {FORMAT_VERSION})",
            header.format
        ));
    }
    header.spec.validate().map_err(|e| e.to_string())?;
    // Every length below comes from the file: checked arithmetic, and checked against
    // the bytes left before anything is allocated.
    let remaining = |c: &Cursor<'_>| c.buf.len() - c.at;
    let slots = header.slots;
    if slots > MAX_SLOTS {
        return Err(format!(
            "{slots} optimizer slots per value (at most {MAX_SLOTS})"
        ));
    }
    // Bytes per value with its slots.
    let value_bytes = (1 + slots) * 4;
    let fits = |n: Option<usize>, c: &Cursor<'_>| n.is_some_and(|n| n <= remaining(c));
    let block_count = usize::try_from(header.blocks).ok();
    if !fits(block_count.and_then(|n| n.checked_mul(BLOCK_FIXED)), &c) {
        return Err(format!("{} blocks overrun the file", header.blocks));
    }
    let mut blocks = Vec::new();
    for _ in 0..header.blocks {
        let id = c.u32()?;
        let len = c.u32()? as usize;
        if !fits(len.checked_mul(value_bytes), &c) {
            return Err(format!("block {id} of {len} floats overruns the file"));
        }
        let version = c.u64()?;
        let t = c.u64()?;
        let values = c.f32s(len)?;
        let slot_values = c.f32s(len.checked_mul(slots).ok_or("absurd block length")?)?;
        blocks.push(BlockSnap {
            id,
            version,
            values,
            state: SlotState {
                t,
                slots: slot_values,
            },
        });
    }
    if header.table_rows.len() != header.spec.sparse.len() {
        return Err(format!(
            "{} tables in the header, {} in the spec",
            header.table_rows.len(),
            header.spec.sparse.len()
        ));
    }
    let mut tables = Vec::new();
    for (rows, spec) in header.table_rows.iter().zip(&header.spec.sparse) {
        let per_row = spec
            .dim
            .checked_mul(value_bytes)
            .and_then(|n| n.checked_add(ROW_FIXED));
        let row_count = usize::try_from(*rows).ok();
        if !fits(
            row_count.zip(per_row).and_then(|(r, p)| r.checked_mul(p)),
            &c,
        ) {
            return Err(format!(
                "table {:?} of {rows} rows overruns the file",
                spec.name
            ));
        }
        let slot_len = spec.dim.checked_mul(slots).ok_or("absurd table width")?;
        let mut t = Vec::with_capacity(row_count.unwrap_or(0));
        for _ in 0..*rows {
            let row = c.u64()?;
            let st = c.u64()?;
            let values = c.f32s(spec.dim)?;
            let slot_values = c.f32s(slot_len)?;
            t.push(RowSnap {
                row,
                values,
                state: SlotState {
                    t: st,
                    slots: slot_values,
                },
            });
        }
        tables.push(t);
    }
    if c.at != c.buf.len() {
        return Err(format!(
            "{} unexpected bytes after the tables",
            c.buf.len() - c.at
        ));
    }
    Ok((
        Snapshot {
            step: header.step,
            shard: header.shard,
            shards: header.shards,
            spec: header.spec,
            updates: header.updates,
            last_closed: header.last_closed,
            ledger: header.ledger,
            final_of: header.final_of,
            blocks,
            tables,
        },
        header.uuid,
    ))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::layout::{DenseSpec, Mode, ParamConfig, RowInit, SparseSpec};
    use crate::optim::OptimizerConfig;
    use proptest::prelude::*;

    pub(crate) fn sample(step: u64, blocks: usize, rows: usize) -> Snapshot {
        let spec = ParamSpec {
            dense: vec![DenseSpec {
                name: "w".into(),
                shape: vec![blocks.max(1) * 3],
            }],
            sparse: vec![SparseSpec {
                name: "emb".into(),
                dim: 2,
                init: RowInit::Zeros,
            }],
            config: ParamConfig {
                block_size: 3,
                ..ParamConfig::new(Mode::sync(), OptimizerConfig::adam(0.1))
            },
        };
        Snapshot {
            step,
            shard: 1,
            shards: 2,
            spec,
            updates: step * 2,
            last_closed: step,
            final_of: 0,
            ledger: {
                let mut l = Ledger::default();
                let _ = l.mark(crate::shard::Origin {
                    pass: 1,
                    task: 4,
                    seq: 2,
                    count: 1,
                });
                let _ = l.complete(0, 3, 8);
                l
            },
            blocks: (0..blocks)
                .map(|i| BlockSnap {
                    id: i as u32 * 2 + 1,
                    version: 7 + i as u64,
                    values: vec![i as f32, -1.5, 0.25],
                    state: SlotState {
                        t: 3,
                        slots: vec![0.5; 6],
                    },
                })
                .collect(),
            tables: vec![
                (0..rows)
                    .map(|r| RowSnap {
                        row: r as u64 * 11,
                        values: vec![r as f32, 1.0],
                        state: SlotState {
                            t: 1,
                            slots: vec![0.1; 4],
                        },
                    })
                    .collect(),
            ],
        }
    }

    /// `snap`'s file with its header edited by `f` (the checksum recomputed, so that
    /// only the parser stands between the lengths and the allocator).
    fn with_header(snap: &Snapshot, f: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
        let mut buf = Vec::new();
        encode_to(snap, "u", &mut buf, None).unwrap();
        let hlen = u32::from_le_bytes(buf[8..12].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&buf[12..12 + hlen]).unwrap();
        f(&mut header);
        let header = serde_json::to_vec(&header).unwrap();
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        out.extend_from_slice(&buf[12 + hlen..buf.len() - TRAILER_LEN]);
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(END_MAGIC);
        out
    }

    /// A header over the bound the reader takes is refused when writing, before any
    /// byte is written: a checkpoint that could not be restored is never made.
    #[test]
    fn a_header_over_the_readers_bound_is_not_written() {
        let mut snap = sample(1, 1, 0);
        snap.spec.dense[0].name = "w".repeat(MAX_HEADER);
        let mut buf = Vec::new();
        let err = encode_to(&snap, "u", &mut buf, None).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        assert!(err.to_string().contains("not written"), "{err}");
        assert!(buf.is_empty(), "{} bytes written", buf.len());
        // Just under it, the file is written.
        snap.spec.dense[0].name = "w".repeat(MAX_HEADER - 4096);
        let written = encode_to(&snap, "u", &mut buf, None).map_err(|e| e.kind());
        assert!(written.is_ok(), "{written:?}");
        let hlen = u32::from_le_bytes(buf[8..12].try_into().unwrap()) as usize;
        assert!(hlen > MAX_HEADER - 4096 && hlen <= MAX_HEADER, "{hlen}");
    }

    #[test]
    fn absurd_lengths_in_a_well_formed_file_are_corruption() {
        let snap = sample(9, 2, 2);
        assert_eq!(decode(&with_header(&snap, |_| {})).unwrap().0, snap);
        let edits: [(&str, serde_json::Value); 5] = [
            ("slots", u64::MAX.into()),
            ("slots", (MAX_SLOTS as u64 + 1).into()),
            ("blocks", u64::MAX.into()),
            ("blocks", (1u64 << 40).into()),
            ("table_rows", vec![u64::MAX].into()),
        ];
        for (field, value) in edits {
            let bytes = with_header(&snap, |h| h[field] = value.clone());
            let err = decode(&bytes).unwrap_err();
            assert!(
                err.contains("overrun") || err.contains("slots"),
                "{field} = {value}: {err}"
            );
        }
    }

    proptest! {
        #[test]
        fn decode_never_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn any_single_corruption_is_detected(blocks in 0usize..4, rows in 0usize..4, at in any::<prop::sample::Index>(), bit in 0u8..8) {
            let snap = sample(9, blocks, rows);
            let mut buf = Vec::new();
            encode_to(&snap, "u", &mut buf, None).unwrap();
            prop_assert_eq!(decode(&buf).unwrap().0, snap);
            let i = at.index(buf.len());
            buf[i] ^= 1 << bit;
            prop_assert!(decode(&buf).is_err());
        }
    }
}
