//! A replica's connections: a backup's connection to its primary (opened through the
//! bulk path's hello and a `KIND_REPLICATE` frame, reopened when it breaks), and the
//! primary's side of each; frames read are handed to the machine, the outbox written.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::super::stream;
use super::Replication;
use crate::error::PsError;
use crate::replica::Msg;
use crate::shard::lock;

impl Replication {
    /// Keeps a connection to `primary` until `stop` fires.
    pub(super) async fn upstream(self: Arc<Self>, primary: String, stop: CancellationToken) {
        let mut delay = Duration::from_millis(50);
        while !stop.is_cancelled() {
            let addr = lock(&self.members).get(&primary).map(|r| r.addr.clone());
            if let Some(addr) = addr {
                let up = &self.upstream;
                let opened = edl_pserver_api::bulk::open(
                    &addr,
                    &up.job,
                    up.token.as_deref(),
                    up.tls.as_ref(),
                )
                .await;
                match opened {
                    Ok(mut conn) => {
                        let frame = replicate_frame(self.index, &self.me);
                        if conn.write_all(&frame).await.is_ok() && conn.flush().await.is_ok() {
                            delay = Duration::from_millis(50);
                            self.clone()
                                .peer(conn, primary.clone(), stop.clone(), true)
                                .await;
                        }
                    }
                    Err(e) => {
                        tracing::debug!(shard = self.index, %primary, %addr, error = %e, "primary unreachable")
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(1));
        }
    }

    /// Serves a replication connection opened by `peer` (a backup or joiner of this
    /// primary), its hello already read, until it ends or this replica stops.
    pub async fn serve_peer<S>(self: Arc<Self>, conn: S, peer: String)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let stop = self.stop.child_token();
        self.peer(conn, peer, stop, false).await;
    }

    /// Runs one replication connection with `peer`: frames from the outbox written,
    /// frames read handed to the machine (on a blocking thread: replaying an op is CPU
    /// work), until either side ends.
    async fn peer<S>(
        self: Arc<Self>,
        conn: S,
        peer: String,
        stop: CancellationToken,
        upstream: bool,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (mut rd, mut wr) = tokio::io::split(conn);
        let (tx, mut rx) = mpsc::unbounded_channel::<(Msg, Bytes)>();
        lock(&self.outbox).insert(peer.clone(), tx.clone());
        if upstream {
            let mut m = lock(&self.machine);
            let fx = m.reconnected(self.now());
            self.run(&mut m, fx, None);
        }
        let stall = self.stall;
        let writer = async {
            while let Some((msg, body)) = rx.recv().await {
                if stream::write(&mut wr, &msg, &body, stall).await.is_err() {
                    break;
                }
            }
        };
        let reader = async {
            loop {
                match stream::read(&mut rd, self.max_frame, stall).await {
                    Ok(Some((msg, payload))) => {
                        let me = self.clone();
                        let from = peer.clone();
                        let handled = tokio::task::spawn_blocking(move || {
                            let mut m = lock(&me.machine);
                            let fx = m.on_message(me.now(), &from, msg);
                            me.run(&mut m, fx, Some(&payload));
                        })
                        .await;
                        if handled.is_err() {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(shard = self.index, %peer, error = %e, "replication connection ended");
                        break;
                    }
                }
            }
        };
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = writer => {}
            _ = reader => {}
        }
        let mut outbox = lock(&self.outbox);
        if outbox.get(&peer).is_some_and(|t| t.same_channel(&tx)) {
            outbox.remove(&peer);
        }
    }
}

/// The header of a [`KIND_REPLICATE`](edl_pserver_api::bulk::KIND_REPLICATE) frame:
/// the shard and the opening member.
pub fn replicate_frame(shard: u32, me: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(12 + me.len());
    b.extend_from_slice(&edl_pserver_api::bulk::KIND_REPLICATE.to_le_bytes());
    b.extend_from_slice(&(4 + me.len() as u32).to_le_bytes());
    b.extend_from_slice(&shard.to_le_bytes());
    b.extend_from_slice(me.as_bytes());
    b
}

/// Reads a [`replicate_frame`]'s header: the shard and the member.
pub fn replicate_header(header: &[u8]) -> Result<(u32, String), PsError> {
    let bad = |w: &str| PsError::InvalidArgument(format!("replication header: {w}"));
    if header.len() < 4 || header.len() > 4 + 256 {
        return Err(bad("bad length"));
    }
    let shard = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let id = std::str::from_utf8(&header[4..]).map_err(|_| bad("member id not UTF-8"))?;
    if id.is_empty() {
        return Err(bad("no member id"));
    }
    Ok((shard, id.to_string()))
}
