//! What the load samples: etcd's bytes written (its WAL) and size, and the processes'
//! memory.

use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A Prometheus counter or gauge of etcd's `/metrics` at `endpoint` (`http://host:port`).
pub async fn etcd_metric(endpoint: &str, name: &str) -> anyhow::Result<f64> {
    let hostport = endpoint
        .strip_prefix("http://")
        .context("a plain-HTTP etcd endpoint")?;
    let text = tokio::time::timeout(Duration::from_secs(10), async {
        let mut s = tokio::net::TcpStream::connect(hostport).await?;
        s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {hostport}\r\n\r\n").as_bytes())
            .await?;
        let mut body = Vec::new();
        s.read_to_end(&mut body).await?;
        anyhow::Ok(String::from_utf8_lossy(&body).into_owned())
    })
    .await
    .context("etcd's /metrics did not answer within 10 s")??;
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == name).then(|| v.trim().parse::<f64>().ok()).flatten()
        })
        .with_context(|| format!("etcd's /metrics has no {name}"))
}

/// etcd's write-ahead log bytes so far: every byte etcd made durable.
pub async fn etcd_wal_bytes(endpoint: &str) -> anyhow::Result<u64> {
    Ok(etcd_metric(endpoint, "etcd_disk_wal_write_bytes_total").await? as u64)
}
