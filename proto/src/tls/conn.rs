//! Connections: a server's ([`ServerConn`], accepted by [`incoming`] or by the
//! pserver's own acceptor) and a bulk client's ([`ClientConn`]), plain or TLS.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::{HANDSHAKE_TIMEOUT, TlsAcceptor};

/// A server's side of a connection: plain TCP, or TLS over it.
#[derive(Debug)]
pub enum ServerConn {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl ServerConn {
    /// The ALPN protocol the handshake settled on (none for plain TCP).
    pub fn alpn(&self) -> Option<&[u8]> {
        match self {
            ServerConn::Plain(_) => None,
            ServerConn::Tls(s) => s.get_ref().1.alpn_protocol(),
        }
    }

    /// The role the client's certificate names ([`role_of_common_name`]): `None` over
    /// plain TCP, without a client certificate, or with one that names no role.
    pub fn peer_role(&self) -> Option<String> {
        let ServerConn::Tls(s) = self else {
            return None;
        };
        let der = s.get_ref().1.peer_certificates()?.first()?;
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
        let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
        role_of_common_name(cn).map(str::to_owned)
    }

    /// Completes the TLS handshake of `stream` within [`HANDSHAKE_TIMEOUT`].
    pub async fn accept(acceptor: &TlsAcceptor, stream: TcpStream) -> io::Result<ServerConn> {
        let s = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        Ok(ServerConn::Tls(Box::new(s)))
    }
}

impl Connected for ServerConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            ServerConn::Plain(s) => s.connect_info(),
            ServerConn::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}

/// The role a certificate's common name names, as the operator issues one certificate
/// per role of a job (`edl <role> <namespace>.<job>`: `etcd`, `master`, `pserver`,
/// `trainer`, `operator`); `None` for any other name, such as the one certificate every
/// process of an `edl run --secure` job shares (`edl job <job>`).
pub fn role_of_common_name(common_name: &str) -> Option<&str> {
    let mut words = common_name.split(' ');
    match (words.next(), words.next(), words.next(), words.next()) {
        (
            Some("edl"),
            Some(role @ ("etcd" | "master" | "pserver" | "trainer" | "operator")),
            Some(_),
            None,
        ) => Some(role),
        _ => None,
    }
}

/// A client's side of a bulk connection: plain TCP, or TLS over it.
#[derive(Debug)]
pub enum ClientConn {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

macro_rules! delegate_io {
    ($t:ident) => {
        impl AsyncRead for $t {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_read(cx, buf),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
                }
            }
        }

        impl AsyncWrite for $t {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_write(cx, buf),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
                }
            }

            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
                }
            }

            fn is_write_vectored(&self) -> bool {
                match self {
                    $t::Plain(s) => s.is_write_vectored(),
                    $t::Tls(s) => s.is_write_vectored(),
                }
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_flush(cx),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
                }
            }

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $t::Plain(s) => Pin::new(s).poll_shutdown(cx),
                    $t::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
                }
            }
        }
    };
}

delegate_io!(ServerConn);
delegate_io!(ClientConn);

/// Accepts connections on `listener` for a gRPC server, until the receiver is dropped:
/// plain ones without `tls`; with it, only TLS handshakes that complete (each on its own
/// task, within [`HANDSHAKE_TIMEOUT`], so a slow peer holds up nobody).
pub fn incoming(
    listener: tokio::net::TcpListener,
    tls: Option<TlsAcceptor>,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<ServerConn>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                _ = tx.closed() => return,
                r = listener.accept() => match r {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            match &tls {
                None => {
                    if tx.send(Ok(ServerConn::Plain(stream))).await.is_err() {
                        return;
                    }
                }
                Some(acceptor) => {
                    let (acceptor, tx) = (acceptor.clone(), tx.clone());
                    tokio::spawn(async move {
                        let peer = stream.peer_addr().ok();
                        match ServerConn::accept(&acceptor, stream).await {
                            Ok(conn) => {
                                let _ = tx.send(Ok(conn)).await;
                            }
                            Err(e) => {
                                tracing::debug!(?peer, error = %e, "TLS handshake refused")
                            }
                        }
                    });
                }
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
