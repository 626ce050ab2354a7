//! The pserver's side of the bulk path (its framing, shared with the client, is
//! `edl_pserver_api::bulk`, re-exported here): [`accept`] tells bulk connections from gRPC ones
//! by their first byte, bounds how many are served at once ([`BulkSlots`]), and serves
//! each: a hello (job and token, checked like gRPC's headers), then push and pull frames
//! handed to the service, which converts them as it does gRPC requests.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use edl_proto::pserver as pb;
use edl_proto::tls::{ALPN_BULK, ServerConn};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::Instrument as _;

use crate::error::PsError;
use crate::server::Service;
pub use edl_pserver_api::bulk::{
    HELLO_TIMEOUT, IDLE_TIMEOUT, KIND_PULL, KIND_PULL_SPARSE, KIND_PUSH, KIND_REPLICATE, MAGIC,
    MAX_HEADER, MAX_HELLO, STATUS_ERR, STATUS_OK, VERSION,
};
use edl_pserver_api::bulk::{read_header, read_into, status_to_pb, u32_at, write_all_within};

/// How long a new connection waits for the slot of the idle connection it closed.
const EVICT_WAIT: Duration = Duration::from_secs(2);

/// The bulk path's connection slots: at most `max` connections are served at once. A
/// new connection over the bound takes the slot of the connection idle longest (between
/// requests: its client reconnects when it next needs one, so a thousand trainers share
/// the slots by turns); it is closed at once only when every slot is in the middle of a
/// request (its client retries).
pub(crate) struct BulkSlots {
    permits: Arc<Semaphore>,
    /// Connections waiting for their next request, oldest first.
    idle: Mutex<BTreeMap<u64, CancellationToken>>,
    seq: AtomicU64,
}

impl BulkSlots {
    pub(crate) fn new(max: usize) -> Arc<BulkSlots> {
        Arc::new(BulkSlots {
            permits: Arc::new(Semaphore::new(max.max(1))),
            idle: Mutex::new(BTreeMap::new()),
            seq: AtomicU64::new(0),
        })
    }

    /// A slot for a new connection: a free one, or the longest-idle connection's.
    /// `None`: every slot is busy.
    async fn acquire(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Some(p);
        }
        let oldest = lock(&self.idle).pop_first();
        let (_, evict) = oldest?;
        evict.cancel();
        tracing::debug!("a new bulk connection takes the slot of the one idle longest");
        tokio::time::timeout(EVICT_WAIT, self.permits.clone().acquire_owned())
            .await
            .ok()?
            .ok()
    }

    /// Marks a connection idle until the guard drops; the guard's token fires when a
    /// new connection takes its slot.
    fn idle(self: &Arc<Self>) -> IdleGuard {
        let id = self.seq.fetch_add(1, Ordering::Relaxed);
        let token = CancellationToken::new();
        lock(&self.idle).insert(id, token.clone());
        IdleGuard {
            slots: self.clone(),
            id,
            token,
        }
    }
}

/// An idle connection's place in [`BulkSlots`].
struct IdleGuard {
    slots: Arc<BulkSlots>,
    id: u64,
    token: CancellationToken,
}

impl Drop for IdleGuard {
    fn drop(&mut self) {
        lock(&self.slots.idle).remove(&self.id);
    }
}

/// Locks `m`, going on past a panic of another holder (the map only names tokens).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Accepts connections on the pserver's port until `stop` fires: bulk connections are
/// served here, within `bulk_slots` (see [`BulkSlots`]), the others go to the gRPC
/// server through `grpc`.
///
/// With `tls`, every connection must be TLS (anything else is closed unread); the
/// handshake's ALPN says bulk ([`ALPN_BULK`]) or gRPC. Without it, the first byte says
/// which ([`MAGIC`] or HTTP/2).
pub(crate) async fn accept(
    listener: TcpListener,
    svc: Arc<Service>,
    grpc: mpsc::Sender<io::Result<ServerConn>>,
    bulk_slots: Arc<BulkSlots>,
    tls: Option<edl_proto::tls::TlsAcceptor>,
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
        let tls = tls.clone();
        tokio::spawn(
            async move {
                let mut first = [0u8; 1];
                let conn = match tokio::time::timeout(HELLO_TIMEOUT, stream.peek(&mut first)).await
                {
                    Ok(Ok(1)) => match &tls {
                        // A TLS handshake starts with a handshake record (22).
                        Some(acceptor) if first[0] == 22 => {
                            match ServerConn::accept(acceptor, stream).await {
                                Ok(c) => c,
                                Err(e) => {
                                    tracing::debug!(%peer, error = %e, "TLS handshake refused");
                                    return;
                                }
                            }
                        }
                        Some(_) => {
                            tracing::debug!(%peer, "a connection without TLS; closed unread");
                            return;
                        }
                        None => ServerConn::Plain(stream),
                    },
                    _ => return,
                };
                let bulk = match &conn {
                    ServerConn::Plain(_) => first[0] == MAGIC[0],
                    ServerConn::Tls(_) => conn.alpn() == Some(ALPN_BULK),
                };
                if !bulk {
                    let _ = grpc.send(Ok(conn)).await;
                    return;
                }
                let Some(_slot) = slots.acquire().await else {
                    tracing::warn!(
                        %peer,
                        "every bulk connection is in the middle of a request; closing a new one \
                         (its client retries; `edl pserver --max-bulk-connections` raises the \
                         bound)"
                    );
                    return;
                };
                let role = conn.peer_role();
                if let Err(e) = serve(conn, svc, &slots, role.as_deref()).await {
                    tracing::debug!(%peer, error = %e, "bulk connection ended");
                }
            }
            .in_current_span(),
        );
    }
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
    write_frame(w, STATUS_ERR, &status_to_pb(&status)).await?;
    w.flush().await
}

fn invalid(msg: impl Into<String>) -> PsError {
    PsError::InvalidArgument(msg.into())
}

/// Reads the hello of a new connection: magic, version, then the job and token (at most
/// [`MAX_HELLO`] bytes, all within [`HELLO_TIMEOUT`]). `Ok(Err(_))`: refused, tell the
/// peer.
async fn read_hello<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> io::Result<Result<pb::BulkHello, PsError>> {
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
async fn serve<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    mut stream: S,
    svc: Arc<Service>,
    slots: &Arc<BulkSlots>,
    role: Option<&str>,
) -> io::Result<()> {
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
    stream.flush().await?;
    let stall = svc.io_timeout();
    let mut buf = BytesMut::new();
    loop {
        let mut hdr = [0u8; 8];
        let idle = slots.idle();
        tokio::select! {
            _ = svc.stopped().cancelled() => return Ok(()),
            // A new connection took this slot: the client reconnects for its next request.
            _ = idle.token.cancelled() => return Ok(()),
            r = tokio::time::timeout(IDLE_TIMEOUT, stream.read_exact(&mut hdr)) => match r {
                Err(_) => return Ok(()),
                Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Ok(Ok(_)) => {}
            },
        }
        drop(idle);
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
                // The payload starts 4-byte aligned (its blocks are whole floats), so
                // that the shard reads the gradients in place (`wire::floats`). Memory for
                // the rest is reserved as it arrives (a reservation that moves the buffer
                // moves it to a fresh allocation's start, aligned too).
                buf.reserve((total as usize).min(1 << 16) + 3);
                let pad = buf.as_ptr().align_offset(4);
                buf.put_bytes(0, pad);
                drop(buf.split_to(pad));
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
            KIND_PULL_SPARSE => {
                let req = match pb::PullSparseRequest::decode(&header[..]) {
                    Ok(r) => r,
                    Err(e) => {
                        return write_error(
                            &mut stream,
                            invalid(format!("bad sparse pull header: {e}")),
                        )
                        .await;
                    }
                };
                match svc.pull_sparse(req).await {
                    Ok(resp) => {
                        let bp = pb::BulkPullSparse {
                            values_bytes: resp.values.len() as u64,
                        };
                        write_frame(&mut stream, STATUS_OK, &bp).await?;
                        write_all_within(&mut stream, &resp.values, stall).await?;
                    }
                    Err(e) => write_error(&mut stream, e).await?,
                }
            }
            KIND_REPLICATE => {
                // Only another replica of the shard streams its operations here: a
                // client whose certificate names another role (a trainer's) may not.
                if let Some(role) = role.filter(|r| *r != "pserver") {
                    let e = PsError::PermissionDenied(format!(
                        "a {role}'s certificate may not open a replication stream: only a \
                         pserver's may"
                    ));
                    return write_error(&mut stream, e).await;
                }
                let rep = svc.replication();
                if rep.replicas() < 2 {
                    return write_error(
                        &mut stream,
                        invalid("this pserver's shard is not replicated (--replicas 1)"),
                    )
                    .await;
                }
                let (shard, peer) = match crate::server::replication::replicate_header(&header) {
                    Ok(x) => x,
                    Err(e) => return write_error(&mut stream, e).await,
                };
                if shard != svc.shard_index() {
                    let e = invalid(format!(
                        "a replica of shard {shard} at a pserver of shard {}",
                        svc.shard_index()
                    ));
                    return write_error(&mut stream, e).await;
                }
                // The connection is the replication stream from now on.
                rep.serve_peer(stream, peer).await;
                return Ok(());
            }
            other => {
                return write_error(
                    &mut stream,
                    invalid(format!("unknown bulk request kind {other}")),
                )
                .await;
            }
        }
        // TLS holds written bytes until flushed.
        stream.flush().await?;
    }
}

#[cfg(test)]
mod tests {
    use edl_pserver_api::bulk::pb_to_status;
    use tonic::Code;

    use super::*;
    use crate::error::{ErrorKind, next_step_of};

    #[test]
    fn errors_survive_the_round_trip() {
        let s: Status = PsError::StaleStep { step: 3, next: 7 }.into();
        let back = pb_to_status(status_to_pb(&s));
        assert_eq!(back.code(), Code::Aborted);
        assert_eq!(back.message(), s.message());
        assert_eq!(ErrorKind::of(&back), Some(ErrorKind::StaleStep));
        assert_eq!(next_step_of(&back), Some(7));
        let plain = pb_to_status(status_to_pb(&Status::internal("x")));
        assert_eq!(ErrorKind::of(&plain), None);
    }
}
