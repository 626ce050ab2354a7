//! A pod's `httpGet` probes, run as a kubelet runs them
//! (<https://kubernetes.io/docs/concepts/configuration/liveness-readiness-startup-probes/>),
//! against the loopback port that stands in for the probed container port:
//!
//! - a probe succeeds on an HTTP status from 200 to 399 within its `timeoutSeconds`
//!   (default 1), every `periodSeconds` (default 10) after `initialDelaySeconds`;
//!   `failureThreshold` (default 3) failures in a row fail it;
//! - the *startup* probe runs first; until it succeeds neither of the others runs, and
//!   if it fails the container is killed;
//! - *liveness* failing kills the container (SIGKILL; a pod with `restartPolicy: Never`,
//!   as every edl pod, then ends `Failed` with exit code 137);
//! - *readiness* sets the pod's `Ready` condition and its container's `ready`, written
//!   when it changes (`False` until the first success).
//!
//! Not covered: `exec`, `tcpSocket` and `grpc` probes, `successThreshold` above 1,
//! `httpHeaders` and `https` (no edl probe uses them), and restarting a container in
//! place (no edl pod has a restart policy but `Never`).

use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::kube_api::FakeApi;

/// One `httpGet` probe of a container.
#[derive(Debug, Clone)]
struct Probe {
    path: String,
    port: u16,
    initial_delay: Duration,
    period: Duration,
    timeout: Duration,
    failures: u32,
}

impl Probe {
    /// The probe at `spec` (a container's `livenessProbe`, ...), on `container`'s port;
    /// `None` without one or for a kind not covered.
    fn of(spec: &Value, container: &Value) -> Option<Probe> {
        let get = spec.get("httpGet")?;
        let port = match &get["port"] {
            Value::Number(n) => u16::try_from(n.as_u64()?).ok()?,
            Value::String(name) => container["ports"]
                .as_array()?
                .iter()
                .find(|p| p["name"] == name.as_str())
                .and_then(|p| u16::try_from(p["containerPort"].as_u64()?).ok())?,
            _ => return None,
        };
        let secs = |k: &str, default: u64| Duration::from_secs(spec[k].as_u64().unwrap_or(default));
        Some(Probe {
            path: get["path"].as_str().unwrap_or("/").to_owned(),
            port,
            initial_delay: secs("initialDelaySeconds", 0),
            period: secs("periodSeconds", 10).max(Duration::from_secs(1)),
            timeout: secs("timeoutSeconds", 1).max(Duration::from_secs(1)),
            failures: spec["failureThreshold"].as_u64().unwrap_or(3).max(1) as u32,
        })
    }

    /// One try against `127.0.0.1:port`.
    async fn passes(&self, port: u16) -> bool {
        let attempt = async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            let request = format!(
                "GET {} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: kube-probe/1.33\r\n\
                 Connection: close\r\n\r\n",
                self.path
            );
            s.write_all(request.as_bytes()).await?;
            let mut head = [0u8; 16];
            let mut n = 0;
            while n < 12 {
                let got = s.read(&mut head[n..]).await?;
                if got == 0 {
                    break;
                }
                n += got;
            }
            Ok::<_, std::io::Error>(head[..n].to_vec())
        };
        let Ok(Ok(head)) = tokio::time::timeout(self.timeout, attempt).await else {
            return false;
        };
        // "HTTP/1.1 200 ..."
        std::str::from_utf8(&head)
            .ok()
            .and_then(|h| h.get(9..12))
            .and_then(|code| code.parse::<u16>().ok())
            .is_some_and(|code| (200..400).contains(&code))
    }

    /// Probes every period until it has failed `failures` times in a row (returns
    /// `false`) or, with `until_success`, until it first passes (returns `true`). Ends
    /// with `true` when `stop` fires.
    async fn run(&self, port: u16, until_success: bool, stop: &CancellationToken) -> bool {
        tokio::select! {
            _ = stop.cancelled() => return true,
            _ = tokio::time::sleep(self.initial_delay) => {}
        }
        let mut failed = 0;
        loop {
            let ok = self.passes(port).await;
            if ok && until_success {
                return true;
            }
            failed = if ok { 0 } else { failed + 1 };
            if failed >= self.failures {
                return false;
            }
            tokio::select! {
                _ = stop.cancelled() => return true,
                _ = tokio::time::sleep(self.period) => {}
            }
        }
    }
}

/// What a pod's probes act on.
pub(super) struct Target {
    pub(super) api: Arc<FakeApi>,
    pub(super) namespace: String,
    pub(super) pod: String,
    pub(super) pid: u32,
    /// Cancelled when the pod's process ends (or the kubelet stops).
    pub(super) ended: CancellationToken,
}

/// Whether `pod`'s first container has a readiness probe this kubelet runs.
pub(super) fn has_readiness(pod: &Value) -> bool {
    let c = &pod["spec"]["containers"][0];
    Probe::of(&c["readinessProbe"], c).is_some()
}

/// Runs `pod`'s probes (its first container's) in the background until its process
/// ends; `port` maps a container port to the loopback port standing in for it.
pub(super) fn start(pod: &Value, port: impl Fn(u16) -> u16, target: Target) {
    let c = &pod["spec"]["containers"][0];
    let startup = Probe::of(&c["startupProbe"], c);
    let liveness = Probe::of(&c["livenessProbe"], c);
    let readiness = Probe::of(&c["readinessProbe"], c);
    if startup.is_none() && liveness.is_none() && readiness.is_none() {
        return;
    }
    let ports = [&startup, &liveness, &readiness].map(|p| p.as_ref().map(|p| port(p.port)));
    tokio::spawn(async move {
        let Target {
            api,
            namespace,
            pod,
            pid,
            ended,
        } = target;
        let kill = |why: &str| {
            tracing::info!(pod = %pod, "{why} probe failed: killing the container");
            let _ = crate::child::signal(pid, Signal::SIGKILL);
        };
        if let (Some(p), Some(port)) = (&startup, ports[0])
            && !p.run(port, true, &ended).await
        {
            kill("startup");
            return;
        }
        let live = async {
            if let (Some(p), Some(port)) = (&liveness, ports[1])
                && !p.run(port, false, &ended).await
            {
                kill("liveness");
            }
        };
        let ready = async {
            let (Some(p), Some(port)) = (&readiness, ports[2]) else {
                return;
            };
            tokio::select! {
                _ = ended.cancelled() => return,
                _ = tokio::time::sleep(p.initial_delay) => {}
            }
            // Until the process ends: one success makes it Ready, `failures` in a row
            // not Ready.
            let (mut ready, mut failed) = (None, 0);
            loop {
                let ok = p.passes(port).await;
                failed = if ok { 0 } else { failed + 1 };
                let now = if ok {
                    Some(true)
                } else if failed >= p.failures {
                    Some(false)
                } else {
                    ready
                };
                if now != ready && now.is_some() && !ended.is_cancelled() {
                    ready = now;
                    let status = if ok { "True" } else { "False" };
                    let _ = api.patch_status(
                        "pods",
                        &namespace,
                        &pod,
                        &json!({"conditions": [{"type": "Ready", "status": status}]}),
                    );
                }
                tokio::select! {
                    _ = ended.cancelled() => return,
                    _ = tokio::time::sleep(p.period) => {}
                }
            }
        };
        tokio::join!(live, ready);
    });
}
