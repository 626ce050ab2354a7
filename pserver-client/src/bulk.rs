//! The client's side of the bulk path: connections to one pserver, each opened with a
//! hello and kept in a small pool between requests; a pushed request's floats are written
//! straight from its buffers, a pull's read into a buffer reused from pull to pull. A
//! refusal leaves the connection usable; any other failure drops it.
//!
//! A pserver closes an idle connection when a new one needs its slot (or after
//! `IDLE_TIMEOUT`): a request that breaks on a pooled connection is sent once more on a
//! fresh one, within the same timeout. That is safe: the pserver read none of it, or (it
//! died in the middle) a push is answered from its ledger as already applied and a pull
//! reads.

use std::io;
use std::sync::Mutex;
use std::time::Duration;

use bytes::BytesMut;
use edl_proto::pserver as pb;
use edl_proto::tls::{ClientConn, Tls};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Status;

use edl_pserver_api::bulk::{
    KIND_PULL, KIND_PULL_SPARSE, KIND_PUSH, MAX_HEADER, OpenError, STATUS_OK, open, pb_to_status,
    read_header, read_into, u32_at,
};

/// Idle connections kept per pserver.
const POOL: usize = 8;

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
    stream: ClientConn,
    buf: BytesMut,
}

impl Conn {
    async fn connect(
        addr: &str,
        job: &str,
        token: Option<&str>,
        tls: Option<&Tls>,
    ) -> Result<Conn, Fail> {
        let stream = open(addr, job, token, tls).await.map_err(|e| match e {
            OpenError::Broken(e) => Fail::Broken(e.to_string()),
            OpenError::Refused(s) => Fail::Refused(s),
        })?;
        Ok(Conn {
            stream,
            buf: BytesMut::new(),
        })
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
        self.stream.flush().await?;
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
        self.stream.flush().await?;
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

    async fn pull_sparse(
        &mut self,
        req: &pb::PullSparseRequest,
        max: usize,
    ) -> Result<pb::PullSparseResponse, Fail> {
        let body = req.encode_to_vec();
        let mut head = Vec::with_capacity(8 + body.len());
        head.extend_from_slice(&KIND_PULL_SPARSE.to_le_bytes());
        head.extend_from_slice(&(body.len() as u32).to_le_bytes());
        head.extend_from_slice(&body);
        self.stream.write_all(&head).await?;
        self.stream.flush().await?;
        let body = self.response().await?;
        let bp = pb::BulkPullSparse::decode(&body[..]).map_err(|e| Fail::Broken(e.to_string()))?;
        if bp.values_bytes > max as u64 {
            return Err(Fail::Broken(format!(
                "sparse pull of {} bytes exceeds the limit",
                bp.values_bytes
            )));
        }
        self.buf.clear();
        read_into(
            &mut self.stream,
            &mut self.buf,
            bp.values_bytes as usize,
            None,
        )
        .await?;
        Ok(pb::PullSparseResponse {
            values: self.buf.split().freeze(),
        })
    }
}

/// Bulk connections to one pserver, reused across requests.
#[derive(Debug)]
pub(crate) struct Pool {
    addr: String,
    job: String,
    token: Option<String>,
    tls: Option<Tls>,
    connect_timeout: Duration,
    max_message_bytes: usize,
    idle: Mutex<Vec<Conn>>,
}

impl Pool {
    pub(crate) fn new(
        addr: String,
        job: String,
        token: Option<String>,
        tls: Option<Tls>,
        connect_timeout: Duration,
        max_message_bytes: usize,
    ) -> Self {
        Pool {
            addr,
            job,
            token,
            tls,
            connect_timeout,
            max_message_bytes,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A pooled connection (`true`) or a new one.
    async fn take(&self) -> Result<(Conn, bool), Status> {
        if let Some(c) = lock(&self.idle).pop() {
            return Ok((c, true));
        }
        self.connect().await.map(|c| (c, false))
    }

    async fn connect(&self) -> Result<Conn, Status> {
        let connect = Conn::connect(
            &self.addr,
            &self.job,
            self.token.as_deref(),
            self.tls.as_ref(),
        );
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

    /// `attempt` of `req` over a pooled connection, once more on a fresh one when the
    /// pooled connection turns out closed, all within `timeout`.
    async fn request<Q, R>(
        &self,
        timeout: Duration,
        req: &Q,
        mut attempt: impl for<'c> FnMut(&'c mut Conn, &'c Q, usize) -> ConnCall<'c, R>,
    ) -> Result<R, Status> {
        let until = tokio::time::Instant::now() + timeout;
        let max = self.max_message_bytes;
        let (mut c, pooled) = self.take().await?;
        let mut r = tokio::time::timeout_at(until, attempt(&mut c, req, max)).await;
        if pooled && matches!(r, Ok(Err(Fail::Broken(_)))) {
            c = self.connect().await?;
            r = tokio::time::timeout_at(until, attempt(&mut c, req, max)).await;
        }
        self.finish(c, r)
    }

    /// Pushes over a pooled connection.
    pub(crate) async fn push(
        &self,
        req: pb::PushRequest,
        timeout: Duration,
    ) -> Result<pb::PushResponse, Status> {
        self.request(timeout, &req, |c, req, _| Box::pin(c.push(req)))
            .await
    }

    /// Pulls over a pooled connection.
    pub(crate) async fn pull(
        &self,
        req: pb::PullRequest,
        timeout: Duration,
    ) -> Result<pb::PullResponse, Status> {
        self.request(timeout, &req, |c, req, max| Box::pin(c.pull(req, max)))
            .await
    }

    /// Pulls sparse rows over a pooled connection.
    pub(crate) async fn pull_sparse(
        &self,
        req: pb::PullSparseRequest,
        timeout: Duration,
    ) -> Result<pb::PullSparseResponse, Status> {
        self.request(timeout, &req, |c, req, max| {
            Box::pin(c.pull_sparse(req, max))
        })
        .await
    }
}

/// One call of a request on a connection (boxed: an allocation a request, next to its
/// network round trip).
type ConnCall<'c, R> = std::pin::Pin<Box<dyn Future<Output = Result<R, Fail>> + Send + 'c>>;

/// Locks `m`, going on past a panic of another holder (the pool holds only idle
/// connections).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
