//! The bulk data path: dense pushes and pulls over a plain TCP connection to the
//! pserver's own port, next to gRPC.
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
//! so [`accept`] hands every other connection to the gRPC server. See
//! `proto/edl/pserver.proto` for the framing.
//!
//! Limits, since a peer is unknown until its hello is checked: the hello is short and
//! read within [`HELLO_TIMEOUT`]; at most `max_bulk_connections` connections are served
//! at once; once a frame has started, its bytes must keep coming (`io_timeout` between
//! reads), and buffer space grows with the bytes received, never with a length a peer
//! announces.

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use edl_proto::pserver as pb;
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};
use tracing::Instrument as _;

use crate::error::{ERROR_KIND_HEADER, NEXT_STEP_HEADER, PsError, next_step_of};
use crate::server::Service;
use crate::shard::lock;

/// The bulk protocol version served.
pub const VERSION: u32 = 1;
/// First bytes of a bulk connection.
pub const MAGIC: &[u8; 4] = b"EDLB";

const KIND_PUSH: u32 = 1;
pub(crate) const KIND_PULL: u32 = 2;
pub(crate) const STATUS_OK: u32 = 0;
pub(crate) const STATUS_ERR: u32 = 1;
/// Largest protobuf header (block ids and lengths of a large shard fit easily).
const MAX_HEADER: usize = 16 << 20;
/// Largest hello (a job name and a token), read before the peer is authenticated.
const MAX_HELLO: usize = 64 << 10;
/// Buffer space reserved per read: a peer gets memory as it sends bytes, not as it
/// announces them.
const READ_CHUNK: usize = 1 << 20;
/// Bytes written per timed write.
const WRITE_CHUNK: usize = 1 << 20;
/// How long a new connection may take to say what it is.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle bulk connections are closed after this long.
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Idle client connections kept per pserver.
const POOL: usize = 8;

/// Accepts connections on the pserver's port until `stop` fires: bulk connections are
/// served here, at most as many at once as `bulk_slots` has permits (more are closed at
/// once; their clients retry), the others go to the gRPC server through `grpc`.
pub(crate) async fn accept(
    listener: TcpListener,
    svc: Arc<Service>,
    grpc: mpsc::Sender<io::Result<TcpStream>>,
    bulk_slots: Arc<Semaphore>,
    stop: CancellationToken,
) {
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (svc, grpc, slots) = (svc.clone(), grpc.clone(), bulk_slots.clone());
        tokio::spawn(
            async move {
                let mut first = [0u8; 1];
                match tokio::time::timeout(HELLO_TIMEOUT, stream.peek(&mut first)).await {
                    Ok(Ok(1)) if first[0] == MAGIC[0] => {
                        let Ok(_slot) = slots.try_acquire_owned() else {
                            tracing::warn!(%peer, "too many bulk connections; closing a new one");
                            return;
                        };
                        if let Err(e) = serve(stream, svc).await {
                            tracing::debug!(%peer, error = %e, "bulk connection ended");
                        }
                    }
                    Ok(Ok(n)) if n > 0 => {
                        let _ = grpc.send(Ok(stream)).await;
                    }
                    _ => {}
                }
            }
            .in_current_span(),
        );
    }
}

fn u32_at(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn status_to_pb(s: &Status) -> pb::BulkError {
    pb::BulkError {
        code: s.code() as i32,
        message: s.message().to_owned(),
        kind: s
            .metadata()
            .get(ERROR_KIND_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned(),
        next_step: next_step_of(s).unwrap_or(0),
    }
}

fn pb_to_status(e: pb::BulkError) -> Status {
    let mut s = Status::new(Code::from_i32(e.code), e.message);
    if let Ok(v) = e.kind.parse()
        && !e.kind.is_empty()
    {
        s.metadata_mut().insert(ERROR_KIND_HEADER, v);
    }
    if e.next_step > 0
        && let Ok(v) = e.next_step.to_string().parse()
    {
        s.metadata_mut().insert(NEXT_STEP_HEADER, v);
    }
    s
}

async fn write_frame<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    status: u32,
    msg: &impl Message,
) -> io::Result<()> {
    let body = msg.encode_to_vec();
    let mut head = Vec::with_capacity(8 + body.len());
    head.extend_from_slice(&status.to_le_bytes());
    head.extend_from_slice(&(body.len() as u32).to_le_bytes());
    head.extend_from_slice(&body);
    // A frame is small next to the socket buffers; a peer that reads none of it for this
    // long is gone.
    write_all_within(w, &head, crate::server::DEFAULT_IO_TIMEOUT).await
}

async fn write_error<W: AsyncWriteExt + Unpin>(w: &mut W, e: PsError) -> io::Result<()> {
    let status: Status = e.into();
    write_frame(w, STATUS_ERR, &status_to_pb(&status)).await
}

fn stalled(stall: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("peer stalled for {stall:?} in the middle of a frame"),
    )
}

/// Reads exactly `n` more bytes into `buf`, each read making progress within `stall`
/// (if given). Buffer space grows with the bytes received, not with `n`.
async fn read_into<R: AsyncRead + Unpin>(
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
async fn read_header<R: AsyncRead + Unpin>(
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
async fn write_all_within<W: AsyncWriteExt + Unpin>(
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

fn invalid(msg: impl Into<String>) -> PsError {
    PsError::InvalidArgument(msg.into())
}

/// Reads the hello of a new connection: magic, version, then the job and token (at most
/// [`MAX_HELLO`] bytes, all within [`HELLO_TIMEOUT`]). `Ok(Err(_))`: refused, tell the
/// peer.
async fn read_hello(stream: &mut TcpStream) -> io::Result<Result<pb::BulkHello, PsError>> {
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).await?;
    if &head[..4] != MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad magic"));
    }
    if u32_at(&head[4..8]) != VERSION {
        return Ok(Err(invalid(format!(
            "bulk protocol version {} (this pserver speaks {VERSION})",
            u32_at(&head[4..8])
        ))));
    }
    let len = u32_at(&head[8..12]) as usize;
    if len > MAX_HELLO {
        return Ok(Err(invalid(format!(
            "bulk hello of {len} bytes (at most {MAX_HELLO})"
        ))));
    }
    let hello = read_header(stream, len, MAX_HELLO, None).await?;
    Ok(pb::BulkHello::decode(&hello[..]).map_err(|e| invalid(format!("bad bulk hello: {e}"))))
}

/// Serves one bulk connection.
async fn serve(mut stream: TcpStream, svc: Arc<Service>) -> io::Result<()> {
    let hello = tokio::time::timeout(HELLO_TIMEOUT, read_hello(&mut stream))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no hello"))??;
    let hello = match hello {
        Ok(h) => h,
        Err(e) => return write_error(&mut stream, e).await,
    };
    let token = (!hello.token.is_empty()).then_some(hello.token.as_str());
    if let Err(e) = svc.authorize(&hello.job, token) {
        return write_error(&mut stream, e).await;
    }
    stream.write_all(&STATUS_OK.to_le_bytes()).await?;
    let stall = svc.io_timeout();
    let mut buf = BytesMut::new();
    loop {
        let mut hdr = [0u8; 8];
        tokio::select! {
            _ = svc.stopped().cancelled() => return Ok(()),
            r = tokio::time::timeout(IDLE_TIMEOUT, stream.read_exact(&mut hdr)) => match r {
                Err(_) => return Ok(()),
                Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Ok(Ok(_)) => {}
            },
        }
        let header = read_header(
            &mut stream,
            u32_at(&hdr[4..8]) as usize,
            MAX_HEADER,
            Some(stall),
        )
        .await?;
        if let Err(e) = svc.serving() {
            write_error(&mut stream, e).await?;
            return Ok(());
        }
        match u32_at(&hdr[..4]) {
            KIND_PUSH => {
                let bp = match pb::BulkPush::decode(&header[..]) {
                    Ok(bp) => bp,
                    Err(e) => {
                        return write_error(&mut stream, invalid(format!("bad push header: {e}")))
                            .await;
                    }
                };
                let mut req = bp.request.unwrap_or_default();
                if bp.dense_bytes.len() != req.dense.len()
                    || bp.sparse_bytes.len() != req.sparse.len()
                {
                    return write_error(
                        &mut stream,
                        invalid("push header lengths do not match its blocks"),
                    )
                    .await;
                }
                let total: u64 = bp
                    .dense_bytes
                    .iter()
                    .chain(&bp.sparse_bytes)
                    .map(|&n| u64::from(n))
                    .sum();
                if total > svc.max_message_bytes() as u64 {
                    let e = invalid(format!(
                        "push of {total} bytes exceeds the {} byte limit",
                        svc.max_message_bytes()
                    ));
                    return write_error(&mut stream, e).await;
                }
                buf.clear();
                read_into(&mut stream, &mut buf, total as usize, Some(stall)).await?;
                let mut payload: Bytes = buf.split().freeze();
                for (b, &n) in req.dense.iter_mut().zip(&bp.dense_bytes) {
                    b.values = payload.split_to(n as usize);
                }
                for (s, &n) in req.sparse.iter_mut().zip(&bp.sparse_bytes) {
                    s.values = payload.split_to(n as usize);
                }
                // `push` checks again that we serve (the payload may have been slow).
                match svc.push(req).await {
                    Ok(resp) => write_frame(&mut stream, STATUS_OK, &resp).await?,
                    Err(e) => write_error(&mut stream, e).await?,
                }
            }
            KIND_PULL => {
                let req = match pb::PullRequest::decode(&header[..]) {
                    Ok(r) => r,
                    Err(e) => {
                        return write_error(&mut stream, invalid(format!("bad pull header: {e}")))
                            .await;
                    }
                };
                match svc.pull(req).await {
                    Ok(mut resp) => {
                        let payloads: Vec<Bytes> = resp
                            .blocks
                            .iter_mut()
                            .map(|b| std::mem::take(&mut b.values))
                            .collect();
                        let bp = pb::BulkPull {
                            block_bytes: payloads.iter().map(|p| p.len() as u32).collect(),
                            response: Some(resp),
                        };
                        write_frame(&mut stream, STATUS_OK, &bp).await?;
                        for p in &payloads {
                            write_all_within(&mut stream, p, stall).await?;
                        }
                    }
                    Err(e) => write_error(&mut stream, e).await?,
                }
            }
            other => {
                return write_error(
                    &mut stream,
                    invalid(format!("unknown bulk request kind {other}")),
                )
                .await;
            }
        }
    }
}

/// Why a client-side bulk request failed.
enum Fail {
    /// The connection is unusable (I/O error, protocol violation).
    Broken(String),
    /// The pserver answered with an error; the connection is fine.
    Refused(Status),
}

impl From<io::Error> for Fail {
    fn from(e: io::Error) -> Self {
        Fail::Broken(e.to_string())
    }
}

/// One client connection.
#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    async fn connect(addr: &str, job: &str, token: Option<&str>) -> Result<Conn, Fail> {
        let mut stream = TcpStream::connect(addr).await?;
        let _ = stream.set_nodelay(true);
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
        let mut status = [0u8; 4];
        stream.read_exact(&mut status).await?;
        let mut conn = Conn {
            stream,
            buf: BytesMut::new(),
        };
        if u32_at(&status) != STATUS_OK {
            let mut len = [0u8; 4];
            conn.stream.read_exact(&mut len).await?;
            let body =
                read_header(&mut conn.stream, u32_at(&len) as usize, MAX_HEADER, None).await?;
            let e = pb::BulkError::decode(&body[..]).map_err(|e| Fail::Broken(e.to_string()))?;
            return Err(Fail::Refused(pb_to_status(e)));
        }
        Ok(conn)
    }

    /// Reads a response frame; returns the header of an OK response.
    async fn response(&mut self) -> Result<Vec<u8>, Fail> {
        let mut hdr = [0u8; 8];
        self.stream.read_exact(&mut hdr).await?;
        let body = read_header(
            &mut self.stream,
            u32_at(&hdr[4..8]) as usize,
            MAX_HEADER,
            None,
        )
        .await?;
        match u32_at(&hdr[..4]) {
            STATUS_OK => Ok(body),
            _ => {
                let e =
                    pb::BulkError::decode(&body[..]).map_err(|e| Fail::Broken(e.to_string()))?;
                Err(Fail::Refused(pb_to_status(e)))
            }
        }
    }

    async fn push(&mut self, req: &pb::PushRequest) -> Result<pb::PushResponse, Fail> {
        let mut header = req.clone();
        let dense_bytes = header
            .dense
            .iter_mut()
            .map(|b| std::mem::take(&mut b.values).len() as u32)
            .collect();
        let sparse_bytes = header
            .sparse
            .iter_mut()
            .map(|s| std::mem::take(&mut s.values).len() as u32)
            .collect();
        let bp = pb::BulkPush {
            request: Some(header),
            dense_bytes,
            sparse_bytes,
        };
        let body = bp.encode_to_vec();
        let mut head = Vec::with_capacity(8 + body.len());
        head.extend_from_slice(&KIND_PUSH.to_le_bytes());
        head.extend_from_slice(&(body.len() as u32).to_le_bytes());
        head.extend_from_slice(&body);
        self.stream.write_all(&head).await?;
        for b in &req.dense {
            self.stream.write_all(&b.values).await?;
        }
        for s in &req.sparse {
            self.stream.write_all(&s.values).await?;
        }
        let body = self.response().await?;
        pb::PushResponse::decode(&body[..]).map_err(|e| Fail::Broken(e.to_string()))
    }

    async fn pull(&mut self, req: &pb::PullRequest, max: usize) -> Result<pb::PullResponse, Fail> {
        let body = req.encode_to_vec();
        let mut head = Vec::with_capacity(8 + body.len());
        head.extend_from_slice(&KIND_PULL.to_le_bytes());
        head.extend_from_slice(&(body.len() as u32).to_le_bytes());
        head.extend_from_slice(&body);
        self.stream.write_all(&head).await?;
        let body = self.response().await?;
        let bp = pb::BulkPull::decode(&body[..]).map_err(|e| Fail::Broken(e.to_string()))?;
        let mut resp = bp.response.unwrap_or_default();
        if bp.block_bytes.len() != resp.blocks.len() {
            return Err(Fail::Broken(
                "pull header lengths do not match its blocks".into(),
            ));
        }
        let total: u64 = bp.block_bytes.iter().map(|&n| u64::from(n)).sum();
        if total > max as u64 {
            return Err(Fail::Broken(format!(
                "pull of {total} bytes exceeds the limit"
            )));
        }
        self.buf.clear();
        read_into(&mut self.stream, &mut self.buf, total as usize, None).await?;
        let mut payload = self.buf.split().freeze();
        for (b, &n) in resp.blocks.iter_mut().zip(&bp.block_bytes) {
            b.values = payload.split_to(n as usize);
        }
        Ok(resp)
    }
}

/// Bulk connections to one pserver, reused across requests.
#[derive(Debug)]
pub(crate) struct Pool {
    addr: String,
    job: String,
    token: Option<String>,
    connect_timeout: Duration,
    max_message_bytes: usize,
    idle: Mutex<Vec<Conn>>,
}

impl Pool {
    pub(crate) fn new(
        addr: String,
        job: String,
        token: Option<String>,
        connect_timeout: Duration,
        max_message_bytes: usize,
    ) -> Self {
        Pool {
            addr,
            job,
            token,
            connect_timeout,
            max_message_bytes,
            idle: Mutex::new(Vec::new()),
        }
    }

    async fn take(&self) -> Result<Conn, Status> {
        if let Some(c) = lock(&self.idle).pop() {
            return Ok(c);
        }
        let connect = Conn::connect(&self.addr, &self.job, self.token.as_deref());
        match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(Fail::Refused(s))) => Err(s),
            Ok(Err(Fail::Broken(e))) => Err(Status::unavailable(format!(
                "bulk connection to {}: {e}",
                self.addr
            ))),
            Err(_) => Err(Status::unavailable(format!(
                "bulk connection to {} timed out",
                self.addr
            ))),
        }
    }

    fn put(&self, c: Conn) {
        let mut idle = lock(&self.idle);
        if idle.len() < POOL {
            idle.push(c);
        }
    }

    fn finish<R>(
        &self,
        c: Conn,
        r: Result<Result<R, Fail>, tokio::time::error::Elapsed>,
    ) -> Result<R, Status> {
        match r {
            Ok(Ok(v)) => {
                self.put(c);
                Ok(v)
            }
            Ok(Err(Fail::Refused(s))) => {
                self.put(c);
                Err(s)
            }
            Ok(Err(Fail::Broken(e))) => Err(Status::unavailable(format!(
                "bulk connection to {}: {e}",
                self.addr
            ))),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "bulk request to {} timed out",
                self.addr
            ))),
        }
    }

    /// Pushes over a pooled connection.
    pub(crate) async fn push(
        &self,
        req: pb::PushRequest,
        timeout: Duration,
    ) -> Result<pb::PushResponse, Status> {
        let mut c = self.take().await?;
        let r = tokio::time::timeout(timeout, c.push(&req)).await;
        self.finish(c, r)
    }

    /// Pulls over a pooled connection.
    pub(crate) async fn pull(
        &self,
        req: pb::PullRequest,
        timeout: Duration,
    ) -> Result<pb::PullResponse, Status> {
        let mut c = self.take().await?;
        let max = self.max_message_bytes;
        let r = tokio::time::timeout(timeout, c.pull(&req, max)).await;
        self.finish(c, r)
    }
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

    #[test]
    fn errors_survive_the_round_trip() {
        let s: Status = PsError::StaleStep { step: 3, next: 7 }.into();
        let back = pb_to_status(status_to_pb(&s));
        assert_eq!(back.code(), Code::Aborted);
        assert_eq!(back.message(), s.message());
        assert_eq!(
            crate::error::ErrorKind::of(&back),
            Some(crate::error::ErrorKind::StaleStep)
        );
        assert_eq!(next_step_of(&back), Some(7));
        let plain = pb_to_status(status_to_pb(&Status::internal("x")));
        assert_eq!(crate::error::ErrorKind::of(&plain), None);
    }
}
