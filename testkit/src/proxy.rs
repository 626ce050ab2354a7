//! A TCP proxy on loopback that can partition: [`Proxy`] forwards every connection to
//! one target until [`cut`](Proxy::cut), then forwards nothing (bytes already sent wait
//! in the sockets, new connections are accepted but not connected) until
//! [`heal`](Proxy::heal). That is what a network partition does to TCP: nothing is
//! refused or reset, packets stop arriving, and once it heals the retransmissions
//! deliver what waited. A process whose traffic to one address goes through a proxy is
//! partitioned from that address alone.
//!
//! Every task stops when the proxy is dropped.

use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Bytes moved per read.
const BUF: usize = 64 << 10;

/// A partitionable TCP proxy from a free loopback port to `target`.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    stop: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> io::Result<Proxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(false);
        let stop = CancellationToken::new();
        tokio::spawn(accept(listener, target, cut_rx, stop.clone()));
        Ok(Proxy { addr, cut, stop })
    }

    /// The address to use instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Partitions: nothing more is forwarded, in either direction, on any connection.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Ends the partition: what waited is delivered and forwarding goes on.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn accept(
    listener: TcpListener,
    target: SocketAddr,
    cut: watch::Receiver<bool>,
    stop: CancellationToken,
) {
    loop {
        let conn = tokio::select! {
            _ = stop.cancelled() => return,
            c = listener.accept() => c,
        };
        let Ok((inbound, _)) = conn else { continue };
        let cut = cut.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = forward(inbound, target, cut) => {}
            }
        });
    }
}

/// One connection: connected to the target once no partition holds it, then both
/// directions pumped until either side closes.
async fn forward(inbound: TcpStream, target: SocketAddr, mut cut: watch::Receiver<bool>) {
    if passable(&mut cut).await.is_err() {
        return;
    }
    let Ok(outbound) = TcpStream::connect(target).await else {
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (ri, wi) = inbound.into_split();
    let (ro, wo) = outbound.into_split();
    tokio::select! {
        _ = pump(ri, wo, cut.clone()) => {}
        _ = pump(ro, wi, cut) => {}
    }
}

/// Copies `from` to `to`, holding each read while the proxy is cut.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; BUF];
    loop {
        if passable(&mut cut).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // A read that raced the cut waits for the heal too.
        if passable(&mut cut).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits while the proxy is cut (an error: the proxy is gone).
async fn passable(cut: &mut watch::Receiver<bool>) -> Result<(), watch::error::RecvError> {
    cut.wait_for(|c| !*c).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_cut_holds_bytes_and_a_heal_delivers_them() {
        let echo = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let target = echo.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let proxy = Proxy::start(target).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut b = [0u8; 4];
        c.write_all(b"ping").await.unwrap();
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"ping");

        proxy.cut();
        c.write_all(b"held").await.unwrap();
        let held = tokio::time::timeout(Duration::from_millis(300), c.read_exact(&mut b)).await;
        assert!(held.is_err(), "a byte crossed a cut proxy");
        // A new connection is accepted but reaches nothing while cut.
        let mut d = TcpStream::connect(proxy.addr()).await.unwrap();
        d.write_all(b"late").await.unwrap();
        let mut e = [0u8; 4];
        let late = tokio::time::timeout(Duration::from_millis(300), d.read_exact(&mut e)).await;
        assert!(late.is_err(), "a new connection crossed a cut proxy");

        proxy.heal();
        tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut b))
            .await
            .expect("the held bytes arrive after the heal")
            .unwrap();
        assert_eq!(&b, b"held");
        tokio::time::timeout(Duration::from_secs(10), d.read_exact(&mut e))
            .await
            .expect("the new connection goes through after the heal")
            .unwrap();
        assert_eq!(&e, b"late");
    }
}
