//! `GET /metrics` behind a job's token: the one way every role answers a Prometheus
//! scrape. With a job token a scrape must carry `Authorization: Bearer <token>` (else
//! 401, saying so); without one, anything passes.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio_util::sync::CancellationToken;

use crate::headers::Credentials;

/// The content type of the OpenMetrics text every role serves.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Whether `headers` carry the token `credentials` want (any, without one).
pub fn authorized(credentials: &Credentials, headers: &HeaderMap) -> bool {
    credentials.check_bearer(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()))
}

/// The answer to a scrape without the job's token: 401, saying how to scrape.
pub fn denied() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        "the job has a token: scrape with `Authorization: Bearer <token>`\n",
    )
        .into_response()
}

/// The answer to an authorized scrape: `text` as OpenMetrics.
pub fn answer(text: String) -> Response {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response()
}

/// Binds `addr` for [`serve`] at once (in a Tokio runtime), with an error naming the
/// address.
pub fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let std = std::net::TcpListener::bind(addr)?;
    std.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(std)
}

/// Serves `GET /metrics` on `listener` until `stop` (in the background), each scrape
/// answered with `render()` once `credentials` allow it.
pub fn serve(
    listener: tokio::net::TcpListener,
    credentials: Credentials,
    render: Arc<dyn Fn() -> String + Send + Sync>,
    stop: CancellationToken,
) {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |headers: HeaderMap| {
            let reply = if authorized(&credentials, &headers) {
                answer(render())
            } else {
                denied()
            };
            async move { reply }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
    });
}
