//! The bulk data path: pushes, dense pulls and sparse pulls over a plain TCP connection
//! to the pserver's own port, next to gRPC.
//!
//! gRPC moves a message through several buffers (the protobuf encoding, tonic's encode
//! buffer, tonic's decode buffer, each freshly allocated per message), which caps a
//! 40 MB push or pull at a fraction of what the socket can carry. The bulk path sends the
//! same protobuf messages as headers, with the floats after them: the sender writes the
//! values straight from their buffers, the receiver reads them into a buffer reused from
//! request to request, and the shard's logic is the same as for gRPC (the values become
//! zero-copy slices of that buffer). Errors travel as [`pb::BulkError`], built from the
//! same gRPC status mapping.
//!
//! A connection starts with the magic `EDLB` (HTTP/2 starts with `PRI`, TLS with 0x16),
//! so the pserver's `accept` hands every other connection to the gRPC server. See
//! `proto/edl/pserver.proto` for the framing.
//!
//! Limits, since a peer is unknown until its hello is checked: the hello is short and
//! read within [`HELLO_TIMEOUT`]; at most `max_bulk_connections` connections are served
//! at once; once a frame has started, its bytes must keep coming (`io_timeout` between
//! reads), and buffer space grows with the bytes received, never with a length a peer
//! announces.
//!
//! This module holds what both sides share: the constants, reads and writes bounded in
//! time and memory, errors as [`pb::BulkError`], and the opening of a connection (the
//! hello, [`open`]: a client's, and a backup's replication stream to its primary). The
//! pserver's side (`edl_pserver`'s `bulk`: accepting connections on the shared port,
//! serving them through the service) and the client's pool of connections
//! (`edl_pserver_client`'s `bulk`) are built on it.

use std::io;
use std::time::Duration;

use bytes::BytesMut;
use edl_proto::pserver as pb;
use edl_proto::tls::{ClientConn, Tls};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::{Code, Status};

use crate::error::next_step_of;
use edl_proto::headers;

/// The bulk protocol version served.
pub const VERSION: u32 = 1;
/// First bytes of a bulk connection.
pub const MAGIC: &[u8; 4] = b"EDLB";

/// A frame's kind: a push.
pub const KIND_PUSH: u32 = 1;
/// A frame's kind: a pull.
pub const KIND_PULL: u32 = 2;
/// A frame's kind: the connection becomes a replication stream between two replicas of
/// a shard (its header: the shard as a little-endian `u32`, then the opening member's
/// id); the pserver's replication framing follows.
pub const KIND_REPLICATE: u32 = 3;
/// A frame's kind: a sparse pull (rows of one table).
pub const KIND_PULL_SPARSE: u32 = 4;
/// A response's status: served.
pub const STATUS_OK: u32 = 0;
/// A response's status: refused (a [`pb::BulkError`] follows).
pub const STATUS_ERR: u32 = 1;
/// Largest protobuf header (block ids and lengths of a large shard fit easily).
pub const MAX_HEADER: usize = 16 << 20;
/// Largest hello (a job name and a token), read before the peer is authenticated.
pub const MAX_HELLO: usize = 64 << 10;
/// Buffer space reserved per read: a peer gets memory as it sends bytes, not as it
/// announces them.
const READ_CHUNK: usize = 1 << 20;
/// Bytes written per timed write.
const WRITE_CHUNK: usize = 1 << 20;
/// How long a new connection may take to say what it is.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle bulk connections are closed after this long.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// The little-endian `u32` at the start of `b` (at least 4 bytes).
pub fn u32_at(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// A refusal as it travels on the bulk path (the gRPC code, message and details).
pub fn status_to_pb(s: &Status) -> pb::BulkError {
    pb::BulkError {
        code: s.code() as i32,
        message: s.message().to_owned(),
        kind: headers::detail(s, headers::ERROR_KIND)
            .unwrap_or_default()
            .to_owned(),
        next_step: next_step_of(s).unwrap_or(0),
    }
}

/// A refusal received on the bulk path, as the gRPC status it was built from.
pub fn pb_to_status(e: pb::BulkError) -> Status {
    let mut s = Status::new(Code::from_i32(e.code), e.message);
    if !e.kind.is_empty() {
        headers::set_detail(&mut s, headers::ERROR_KIND, &e.kind);
    }
    if e.next_step > 0 {
        headers::set_detail(&mut s, headers::NEXT_STEP, &e.next_step.to_string());
    }
    s
}

/// Why a bulk connection could not be opened.
#[derive(Debug)]
pub enum OpenError {
    /// The connection failed (I/O, TLS, a malformed answer).
    Broken(io::Error),
    /// The pserver refused the hello (wrong job or token): its status.
    Refused(Status),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::Broken(e) => write!(f, "{e}"),
            OpenError::Refused(s) => write!(f, "refused: {}", s.message()),
        }
    }
}

impl std::error::Error for OpenError {}

impl From<io::Error> for OpenError {
    fn from(e: io::Error) -> Self {
        OpenError::Broken(e)
    }
}

impl From<OpenError> for io::Error {
    /// A refusal is an error of kind `PermissionDenied` with the pserver's message.
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::Broken(e) => e,
            OpenError::Refused(s) => {
                io::Error::new(io::ErrorKind::PermissionDenied, s.message().to_string())
            }
        }
    }
}

/// Opens a bulk connection to `addr` and says hello (the job and token, over TLS when
/// `tls` is given): the connection once the pserver accepted it. A client's connections
/// open so, and a backup's replication stream to its primary.
pub async fn open(
    addr: &str,
    job: &str,
    token: Option<&str>,
    tls: Option<&Tls>,
) -> Result<ClientConn, OpenError> {
    let tcp = TcpStream::connect(addr).await?;
    let _ = tcp.set_nodelay(true);
    let mut stream = match tls {
        Some(t) => ClientConn::Tls(Box::new(t.connect(addr, tcp).await?)),
        None => ClientConn::Plain(tcp),
    };
    let hello = pb::BulkHello {
        job: job.to_owned(),
        token: token.unwrap_or_default().to_owned(),
    }
    .encode_to_vec();
    let mut head = Vec::with_capacity(12 + hello.len());
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&(hello.len() as u32).to_le_bytes());
    head.extend_from_slice(&hello);
    stream.write_all(&head).await?;
    stream.flush().await?;
    let mut status = [0u8; 4];
    stream.read_exact(&mut status).await?;
    if u32_at(&status) != STATUS_OK {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).await?;
        let body = read_header(&mut stream, u32_at(&len) as usize, MAX_HEADER, None).await?;
        let e = pb::BulkError::decode(&body[..])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        return Err(OpenError::Refused(pb_to_status(e)));
    }
    Ok(stream)
}

fn stalled(stall: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("peer stalled for {stall:?} in the middle of a frame"),
    )
}

/// Reads exactly `n` more bytes into `buf`, each read making progress within `stall`
/// (if given). Buffer space grows with the bytes received, not with `n`.
pub async fn read_into<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
    n: usize,
    stall: Option<Duration>,
) -> io::Result<()> {
    let end = buf
        .len()
        .checked_add(n)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "absurd length"))?;
    while buf.len() < end {
        let want = end - buf.len();
        buf.reserve(want.min(READ_CHUNK));
        let mut limited = (&mut *r).take(want as u64);
        let read = limited.read_buf(buf);
        let got = match stall {
            Some(d) => tokio::time::timeout(d, read)
                .await
                .map_err(|_| stalled(d))??,
            None => read.await?,
        };
        if got == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
}

/// Reads a header of `len` bytes, refusing more than `max`.
pub async fn read_header<R: AsyncRead + Unpin>(
    r: &mut R,
    len: usize,
    max: usize,
    stall: Option<Duration>,
) -> io::Result<Vec<u8>> {
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("header of {len} bytes (at most {max})"),
        ));
    }
    let mut h = BytesMut::new();
    read_into(r, &mut h, len, stall).await?;
    Ok(h.to_vec())
}

/// Writes `buf`, each chunk within `stall`: a peer that stops reading a response loses
/// its connection.
pub async fn write_all_within<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    buf: &[u8],
    stall: Duration,
) -> io::Result<()> {
    for chunk in buf.chunks(WRITE_CHUNK) {
        tokio::time::timeout(stall, w.write_all(chunk))
            .await
            .map_err(|_| stalled(stall))??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn buffers_grow_with_the_bytes_received_not_the_length_announced() {
        let (mut tx, mut rx) = tokio::io::duplex(1024);
        tx.write_all(&[7u8; 10]).await.unwrap();
        drop(tx);
        let mut buf = BytesMut::new();
        let err = read_into(&mut rx, &mut buf, 1 << 30, None)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(&buf[..], &[7u8; 10]);
        assert!(buf.capacity() <= 2 * READ_CHUNK, "{}", buf.capacity());
        // A peer that stops sending in the middle is given up on.
        let (_tx, mut rx) = tokio::io::duplex(1024);
        let stall = Some(Duration::from_millis(50));
        let err = read_into(&mut rx, &mut BytesMut::new(), 10, stall)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        let err = read_header(&mut rx, MAX_HEADER + 1, MAX_HEADER, None)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
