//! The replication stream's framing (docs/replication.md): the messages of a shard's
//! replicas ([`Msg`]) with their payloads (an op's bytes, a snapshot's bytes), over one
//! ordered connection per backup, opened by the backup to its primary on the pserver's
//! own port (the bulk path's hello authenticates it).
//!
//! A frame is `kind: u8`, `len: u64` and `len` bytes (a snapshot may pass 4 GiB): the message's numbers, then its
//! payload. Lengths are bounded before anything is allocated, and a frame's bytes must
//! keep coming (`stall` between reads): a damaged or hostile stream is an error, never a
//! panic or an allocation it announces.

use std::io;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use edl_pserver_api::bulk::{read_into, write_all_within};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::replica::Msg;

const OP: u8 = 1;
const SNAPSHOT: u8 = 2;
const CONFIRM: u8 = 3;
const NEED: u8 = 4;
const FENCED: u8 = 5;

/// The numbers of a frame before its payload, by kind.
fn fixed(kind: u8) -> Option<usize> {
    Some(match kind {
        OP | SNAPSHOT | CONFIRM => 16,
        NEED => 25,
        FENCED => 8,
        _ => return None,
    })
}

/// The frame of `msg` with `payload` (empty for messages without one).
pub fn encode(msg: &Msg, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(9 + 25 + payload.len());
    let (kind, nums): (u8, Vec<u64>) = match *msg {
        Msg::Op { epoch, seq } => (OP, vec![epoch, seq]),
        Msg::Snapshot { epoch, seq } => (SNAPSHOT, vec![epoch, seq]),
        Msg::Confirm { epoch, seq } => (CONFIRM, vec![epoch, seq]),
        Msg::Need {
            epoch,
            have,
            change,
        } => (NEED, vec![epoch, have.unwrap_or(0), change]),
        Msg::Fenced { epoch } => (FENCED, vec![epoch]),
    };
    let len = 8 * nums.len() + usize::from(kind == NEED) + payload.len();
    b.put_u8(kind);
    b.put_u64_le(len as u64);
    for (i, n) in nums.iter().enumerate() {
        b.put_u64_le(*n);
        if i == 0
            && let Msg::Need { have, .. } = msg
        {
            b.put_u8(u8::from(have.is_some()));
        }
    }
    b.put_slice(payload);
    b
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Reads one frame: its message and payload. `max` bounds a frame (a snapshot is the
/// largest); `stall` bounds the wait between reads once a frame has started. `Ok(None)`:
/// the peer closed the connection between frames.
pub async fn read<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    stall: Duration,
) -> io::Result<Option<(Msg, Bytes)>> {
    let mut head = [0u8; 9];
    match r.read_exact(&mut head[..1]).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    tokio::time::timeout(stall, r.read_exact(&mut head[1..]))
        .await
        .map_err(|_| bad("a frame stalled"))??;
    let kind = head[0];
    let mut n = [0u8; 8];
    n.copy_from_slice(&head[1..]);
    let len = usize::try_from(u64::from_le_bytes(n)).unwrap_or(usize::MAX);
    let fixed = fixed(kind).ok_or_else(|| bad(format!("unknown frame kind {kind}")))?;
    if len < fixed || len > max {
        return Err(bad(format!(
            "a frame of {len} bytes (kind {kind}, at most {max})"
        )));
    }
    let with_payload = matches!(kind, OP | SNAPSHOT);
    if !with_payload && len != fixed {
        return Err(bad(format!(
            "a frame of kind {kind} has {len} bytes, not {fixed}"
        )));
    }
    let mut buf = BytesMut::new();
    read_into(r, &mut buf, len, Some(stall)).await?;
    let mut b = buf.freeze();
    let epoch = b.get_u64_le();
    let msg = match kind {
        OP => Msg::Op {
            epoch,
            seq: b.get_u64_le(),
        },
        SNAPSHOT => Msg::Snapshot {
            epoch,
            seq: b.get_u64_le(),
        },
        CONFIRM => Msg::Confirm {
            epoch,
            seq: b.get_u64_le(),
        },
        NEED => {
            let has = b.get_u8();
            let have = b.get_u64_le();
            let change = b.get_u64_le();
            let have = match has {
                0 => None,
                1 => Some(have),
                f => return Err(bad(format!("bad flag {f} in a Need frame"))),
            };
            Msg::Need {
                epoch,
                have,
                change,
            }
        }
        _ => Msg::Fenced { epoch },
    };
    Ok(Some((msg, b)))
}

/// Writes one frame, bounded in time per chunk.
pub async fn write<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &Msg,
    payload: &[u8],
    stall: Duration,
) -> io::Result<()> {
    write_all_within(w, &encode(msg, payload), stall).await?;
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(5);

    fn all() -> Vec<(Msg, Vec<u8>)> {
        vec![
            (Msg::Op { epoch: 3, seq: 9 }, b"op bytes".to_vec()),
            (Msg::Snapshot { epoch: 3, seq: 9 }, vec![7; 1000]),
            (Msg::Op { epoch: 1, seq: 1 }, Vec::new()),
            (Msg::Confirm { epoch: 2, seq: 5 }, Vec::new()),
            (
                Msg::Need {
                    epoch: 2,
                    have: Some(4),
                    change: 8,
                },
                Vec::new(),
            ),
            (
                Msg::Need {
                    epoch: 2,
                    have: None,
                    change: 9,
                },
                Vec::new(),
            ),
            (Msg::Fenced { epoch: 6 }, Vec::new()),
        ]
    }

    #[tokio::test]
    async fn frames_round_trip_in_order() {
        let (mut a, mut b) = tokio::io::duplex(64);
        let msgs = all();
        let sent = msgs.clone();
        let writer = tokio::spawn(async move {
            for (m, p) in &sent {
                write(&mut a, m, p, STALL).await.unwrap();
            }
        });
        for (m, p) in msgs {
            let (got, payload) = read(&mut b, 1 << 20, STALL).await.unwrap().unwrap();
            assert_eq!(got, m);
            assert_eq!(&payload[..], &p[..]);
        }
        writer.await.unwrap();
        // The writer dropped its end: the stream ends cleanly between frames.
        assert!(read(&mut b, 1 << 20, STALL).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn damaged_frames_are_errors() {
        for (m, p) in all() {
            let frame = encode(&m, &p);
            // Cut anywhere inside the frame: an error (or a clean end at 0 bytes).
            for cut in 1..frame.len() {
                let mut r = &frame[..cut];
                assert!(
                    read(&mut r, 1 << 20, STALL).await.is_err(),
                    "{m:?} cut at {cut}"
                );
            }
            // A frame over the bound is refused before its bytes are read.
            if !p.is_empty() {
                let mut r = &frame[..];
                assert!(read(&mut r, frame.len() - 10, STALL).await.is_err());
            }
        }
        let mut unknown: &[u8] = &[99, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(read(&mut unknown, 1 << 20, STALL).await.is_err());
        // A fixed-size frame announcing more bytes than it has is refused.
        let mut long = encode(&Msg::Fenced { epoch: 1 }, &[]);
        long[1] = 200;
        assert!(read(&mut &long[..], 1 << 20, STALL).await.is_err());
        // A bad flag in a Need.
        let mut need = encode(
            &Msg::Need {
                epoch: 1,
                have: None,
                change: 1,
            },
            &[],
        );
        need[17] = 7;
        assert!(read(&mut &need[..], 1 << 20, STALL).await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_frame_that_stops_coming_times_out() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let frame = encode(&Msg::Op { epoch: 1, seq: 1 }, &[1; 100]);
        a.write_all(&frame[..50]).await.unwrap();
        let r = read(&mut b, 1 << 20, STALL).await;
        assert!(r.is_err());
        drop(a);
    }
}
