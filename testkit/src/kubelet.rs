//! A test kubelet for [`FakeApi`]: it "runs" the pods of a namespace as real processes
//! on this machine, so the operator's end-to-end test trains a real job.
//!
//! For each new pod it starts the first container's `command` as a process:
//! - `edl` is the given binary;
//! - the environment is the container's `envFrom` Secrets (`secretRef`: each key of the
//!   Secret's `data` whose name is a valid variable name; a missing Secret that is not
//!   `optional` leaves the pod waiting with `CreateContainerConfigError`, as a kubelet
//!   does), then its `env` (values, with `$(VAR)` of earlier variables expanded, and
//!   the field references `metadata.name`, `metadata.uid`, `metadata.namespace`,
//!   `status.podIP` = `127.0.0.1`, and a Secret's key by `secretKeyRef`, whose Secret
//!   and key must be there as for `envFrom`), which wins over `envFrom`; a pod waiting for its
//!   Secret is tried again on every change and every second;
//! - `$(VAR)` in the command is expanded from it, as Kubernetes does;
//! - every pod runs on this one machine: node selection, affinity and anti-affinity are
//!   not evaluated (a real scheduler keeps the replicas of a pserver shard on different
//!   nodes; here they share the host);
//! - `--listen ADDR` and `--advertise ADDR` are dropped, so every process binds
//!   `127.0.0.1:0` and registers the address it got (pods share this host); a pod's
//!   own `0.0.0.0:PORT` elsewhere (`EDL_METRICS_ADDR`, etcd's URLs) becomes the loopback
//!   port standing in for that pod's port ([`Kubelet::resolver`] maps the pod's DNS
//!   name to it);
//! - volume mounts become host directories: a `hostPath` is itself, a claim is the
//!   directory given for it or else, for a PersistentVolumeClaim object of the
//!   namespace, a directory of its own (`<dir>/claims/<claim uid>`, provisioned when a
//!   pod first mounts it and deleted once the claim is gone: a claim's lifetime, as a
//!   dynamic provisioner with the `Delete` reclaim policy gives), an `emptyDir` is a
//!   fresh directory of the pod
//!   (`<dir>/emptydir/<pod uid>/<volume>`), deleted once the pod is gone, as a kubelet
//!   deletes it: a pod made again under the same name starts with an empty one;
//!   a Secret volume is its keys (`items`, or all) written as files into a directory of
//!   the pod, deleted with it like an `emptyDir` (a missing Secret keeps the pod waiting,
//!   tried again, as for `envFrom`), each file a link through `..data` to a directory
//!   of the Secret's version, swapped whole when the Secret changes while the pod runs
//!   (as a kubelet refreshes it: here within a second, there within about a minute);
//!   arguments and variables under a mount path are rewritten to the host directory.
//!
//! A pod's output goes to `<dir>/<pod>.log`, which the API server serves as the pod's
//! `log` subresource. It runs the container's `httpGet` probes (`probes.rs`: readiness
//! sets the pod's `Ready` condition, a failed liveness or startup probe kills the
//! process). It reports the pod `Running` (pod IP `127.0.0.1`), then `Succeeded` or `Failed` with
//! the exit code and the start and end times when the process ends. A pod being deleted
//! gets SIGTERM, then SIGKILL after its grace period, and is removed once its process
//! has stopped (a delete with grace 0). Processes are killed when the kubelet is dropped.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::kube_api::FakeApi;

mod probes;

/// What the kubelet runs pods with.
#[derive(Debug, Clone)]
pub struct KubeletConfig {
    /// The namespace whose pods it runs.
    pub namespace: String,
    /// The `edl` binary.
    pub edl: PathBuf,
    /// Where pods' logs (`<pod>.log`) and `emptyDir`s go.
    pub dir: PathBuf,
    /// The host directory of each PersistentVolumeClaim.
    pub claims: BTreeMap<String, PathBuf>,
}

#[derive(Debug)]
struct Running {
    pid: u32,
    uid: String,
}

/// The kubelet; it stops (killing its processes) when dropped.
#[derive(Debug)]
pub struct Kubelet {
    stop: CancellationToken,
    procs: Arc<Mutex<BTreeMap<String, Running>>>,
    ports: Ports,
    namespace: String,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop.cancel();
        for r in self
            .procs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            let _ = crate::child::signal(r.pid, Signal::SIGKILL);
        }
    }
}

fn now_rfc3339() -> String {
    crate::kube_api::rfc3339(std::time::SystemTime::now())
}

fn expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = s.to_owned();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// The variables of the first container's `envFrom` Secrets (`Err`: a Secret that must
/// be there is not, or its data is not base64).
fn env_from(api: &FakeApi, pod: &Value, ns: &str) -> Result<BTreeMap<String, String>, String> {
    let mut env = BTreeMap::new();
    let valid = |k: &str| {
        !k.is_empty()
            && !k.starts_with(|c: char| c.is_ascii_digit())
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    };
    for source in pod["spec"]["containers"][0]["envFrom"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let Some(name) = source["secretRef"]["name"].as_str() else {
            continue;
        };
        let optional = source["secretRef"]["optional"] == json!(true);
        let secret = api
            .serves("secrets")
            .then(|| api.get("secrets", ns, name))
            .flatten();
        let Some(secret) = secret else {
            if optional {
                continue;
            }
            return Err(format!("secret \"{name}\" not found"));
        };
        let prefix = source["prefix"].as_str().unwrap_or_default();
        for (k, v) in secret["data"].as_object().into_iter().flatten() {
            let key = format!("{prefix}{k}");
            if !valid(&key) {
                continue;
            }
            let bytes = v
                .as_str()
                .and_then(crate::kube_api::base64_decode)
                .ok_or_else(|| format!("secret \"{name}\": data[{k}] is not base64"))?;
            env.insert(key, String::from_utf8_lossy(&bytes).into_owned());
        }
    }
    // An `env` variable from a Secret's key: the Secret and key must be there too.
    for e in pod["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
    {
        secret_key(api, ns, &e["valueFrom"]["secretKeyRef"])?;
    }
    Ok(env)
}

/// The value of a `secretKeyRef` (`Ok(None)`: not one, or an optional one missing).
fn secret_key(api: &FakeApi, ns: &str, selector: &Value) -> Result<Option<String>, String> {
    let Some(name) = selector["name"].as_str() else {
        return Ok(None);
    };
    let key = selector["key"].as_str().unwrap_or_default();
    let value = api
        .serves("secrets")
        .then(|| api.get("secrets", ns, name))
        .flatten()
        .and_then(|s| s["data"][key].as_str().map(str::to_owned));
    match value {
        Some(v) => {
            let bytes = crate::kube_api::base64_decode(&v)
                .ok_or_else(|| format!("secret \"{name}\": data[{key}] is not base64"))?;
            Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
        }
        None if selector["optional"] == json!(true) => Ok(None),
        None => Err(format!("couldn't find key {key} in Secret {ns}/{name}")),
    }
}

/// The loopback port standing in for each pod's container port: pods share this host,
/// so `<pod>.<subdomain>.<namespace>.svc[.cluster.local]:<port>` (a pod's DNS name, as a
/// headless service gives it) becomes `127.0.0.1:<its port>`, and a pod's own
/// `0.0.0.0:<port>` the same port, chosen the first time either is met (a free port
/// then, outside the ephemeral range: see [`crate::ports`]) and kept for the pod's name, as
/// a pod's DNS name outlives its incarnations.
#[derive(Debug, Clone, Default)]
struct Ports(Arc<Mutex<BTreeMap<(String, u16), u16>>>);

impl Ports {
    /// The loopback port of `pod`'s `port`.
    fn of(&self, pod: &str, port: u16) -> u16 {
        let mut table = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *table
            .entry((pod.to_owned(), port))
            .or_insert_with(crate::free_port)
    }

    /// `text` with the pod addresses in it on this host (`own`: the pod it is for).
    fn resolve(&self, text: &str, own: &str, ns: &str) -> String {
        let mut out = String::new();
        let mut rest = text;
        let host_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
        while let Some(colon) = rest.find(':') {
            let (before, after) = rest.split_at(colon);
            let digits: String = after[1..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            let host_start = before
                .char_indices()
                .rev()
                .take_while(|(_, c)| host_char(*c))
                .last()
                .map_or(before.len(), |(i, _)| i);
            let host = &before[host_start..];
            let port = digits.parse::<u16>().ok();
            let pod = match host {
                "0.0.0.0" => Some(own),
                h => [".svc.cluster.local", ".svc"]
                    .iter()
                    .find_map(|s| h.strip_suffix(s))
                    .and_then(|h| h.strip_suffix(&format!(".{ns}")))
                    .and_then(|h| h.split_once('.'))
                    .map(|(pod, _subdomain)| pod),
            };
            match (pod, port) {
                (Some(pod), Some(port)) => {
                    out.push_str(&before[..host_start]);
                    out.push_str(&format!("127.0.0.1:{}", self.of(pod, port)));
                    rest = &after[1 + digits.len()..];
                }
                _ => {
                    out.push_str(before);
                    out.push(':');
                    rest = &after[1..];
                }
            }
        }
        out.push_str(rest);
        out
    }
}

/// Projects Secret `name` into `dir` as a kubelet does: its keys (its `items`, or
/// every key) as files with the volume's `defaultMode` (or an item's `mode`), written
/// into a directory named for the Secret's resourceVersion (`..<version>`) that the
/// link `..data` points to, each file a link through `..data`. A Secret changed since
/// is written into a new directory and `..data` swapped to it at once (a rename), so
/// a reader sees the old files or the new ones, never a mix; as it is, nothing is
/// written.
fn write_secret_volume(
    api: &FakeApi,
    ns: &str,
    name: &str,
    source: &Value,
    dir: &std::path::Path,
) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let secret = api
        .get("secrets", ns, name)
        .ok_or_else(|| format!("secret \"{name}\" not found"))?;
    let version = format!(
        "..{}",
        secret["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
    );
    let data_link = dir.join("..data");
    if std::fs::read_link(&data_link).is_ok_and(|to| to.as_os_str() == version.as_str()) {
        return Ok(());
    }
    let data = secret["data"].as_object().cloned().unwrap_or_default();
    let items: Vec<(String, String, Option<u64>)> = match source["items"].as_array() {
        Some(items) => items
            .iter()
            .map(|i| {
                (
                    i["key"].as_str().unwrap_or_default().to_owned(),
                    i["path"].as_str().unwrap_or_default().to_owned(),
                    i["mode"].as_u64(),
                )
            })
            .collect(),
        None => data.keys().map(|k| (k.clone(), k.clone(), None)).collect(),
    };
    let default_mode = source["defaultMode"].as_u64().unwrap_or(0o644);
    let files = dir.join(&version);
    std::fs::create_dir_all(&files).map_err(|e| e.to_string())?;
    for (key, path, mode) in &items {
        let bytes = data
            .get(key)
            .and_then(Value::as_str)
            .and_then(crate::kube_api::base64_decode)
            .ok_or_else(|| format!("secret \"{name}\": no key {key:?}"))?;
        let file = files.join(path);
        std::fs::write(&file, bytes).map_err(|e| e.to_string())?;
        // The process runs as this user here (no fsGroup): owner bits as the group's.
        let mode = mode.unwrap_or(default_mode) as u32;
        let mode = mode | ((mode & 0o070) << 3);
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode))
            .map_err(|e| e.to_string())?;
    }
    let link = |to: &str, at: &std::path::Path| {
        std::os::unix::fs::symlink(to, at).map_err(|e| format!("link {}: {e}", at.display()))
    };
    let swap = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&swap);
    link(&version, &swap)?;
    std::fs::rename(&swap, &data_link).map_err(|e| e.to_string())?;
    for (_, path, _) in &items {
        let at = dir.join(path);
        if std::fs::symlink_metadata(&at).is_err() {
            link(&format!("..data/{path}"), &at)?;
        }
    }
    // The versions before: gone once nothing links to them.
    for e in std::fs::read_dir(dir).map_err(|e| e.to_string())?.flatten() {
        let n = e.file_name();
        let n = n.to_string_lossy();
        if n.starts_with("..") && n != "..data" && n != version.as_str() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    Ok(())
}

/// Writes the Secret volumes of running `pod` again where their Secret changed, as a
/// kubelet refreshes them (a real one within its sync period, about a minute; this
/// one on its next round, within a second).
fn refresh_secret_volumes(api: &FakeApi, cfg: &KubeletConfig, pod: &Value) {
    let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
    for v in pod["spec"]["volumes"].as_array().into_iter().flatten() {
        let (Some(secret), Some(vname)) = (v["secret"]["secretName"].as_str(), v["name"].as_str())
        else {
            continue;
        };
        let d = empty_dirs(cfg).join(uid).join(vname);
        if d.is_dir()
            && let Err(e) = write_secret_volume(api, &cfg.namespace, secret, &v["secret"], &d)
        {
            tracing::warn!(pod = %pod["metadata"]["name"], volume = vname, error = %e, "cannot refresh a Secret volume");
        }
    }
}

/// `Err` naming the first Secret a volume of `pod` needs that is not there (the pod
/// waits for it, as a kubelet does).
fn secret_volumes_exist(api: &FakeApi, pod: &Value, ns: &str) -> Result<(), String> {
    for v in pod["spec"]["volumes"].as_array().into_iter().flatten() {
        if let Some(name) = v["secret"]["secretName"].as_str()
            && v["secret"]["optional"] != json!(true)
            && api.get("secrets", ns, name).is_none()
        {
            return Err(format!("secret \"{name}\" not found"));
        }
    }
    Ok(())
}

/// The command line of `pod` on this host, its environment (over `env`, the variables
/// of its `envFrom`) and the host directories its mounts became.
fn command_of(
    api: &FakeApi,
    pod: &Value,
    cfg: &KubeletConfig,
    mut env: BTreeMap<String, String>,
    ports: &Ports,
) -> Result<(Vec<String>, BTreeMap<String, String>), String> {
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let c = &pod["spec"]["containers"][0];
    for e in c["env"].as_array().into_iter().flatten() {
        let key = e["name"].as_str().unwrap_or_default().to_owned();
        let value = if let Some(v) = e["value"].as_str() {
            // `$(VAR)` of a variable defined before, as Kubernetes expands it.
            expand(v, &env)
        } else if e["valueFrom"]["secretKeyRef"].is_object() {
            match secret_key(api, &cfg.namespace, &e["valueFrom"]["secretKeyRef"])? {
                Some(v) => v,
                None => continue,
            }
        } else {
            match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("metadata.name") => name.to_owned(),
                Some("metadata.uid") => pod["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                Some("metadata.namespace") => cfg.namespace.clone(),
                Some("status.podIP") => "127.0.0.1".to_owned(),
                other => return Err(format!("env {key}: unsupported fieldRef {other:?}")),
            }
        };
        env.insert(key, value);
    }
    let mut mounts = Vec::new();
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let vname = m["name"].as_str().unwrap_or_default();
        let mount = m["mountPath"].as_str().unwrap_or_default().to_owned();
        let vol = pod["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == vname)
            .ok_or_else(|| format!("mount {vname}: no such volume"))?;
        let host = if let Some(p) = vol["hostPath"]["path"].as_str() {
            PathBuf::from(p)
        } else if let Some(secret) = vol["secret"]["secretName"].as_str() {
            let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
            let d = empty_dirs(cfg).join(uid).join(vname);
            write_secret_volume(api, &cfg.namespace, secret, &vol["secret"], &d)?;
            d
        } else if let Some(claim) = vol["persistentVolumeClaim"]["claimName"].as_str() {
            match cfg.claims.get(claim) {
                Some(d) => d.clone(),
                None => {
                    let pvc = api
                        .get("persistentvolumeclaims", &cfg.namespace, claim)
                        .ok_or_else(|| format!("persistentvolumeclaim \"{claim}\" not found"))?;
                    let uid = pvc["metadata"]["uid"].as_str().unwrap_or_default();
                    let d = claim_dirs(cfg).join(uid);
                    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
                    d
                }
            }
        } else {
            let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
            let d = empty_dirs(cfg).join(uid).join(vname);
            std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
            d
        };
        mounts.push((mount, host));
    }
    // A path under a mount, alone or as a `--flag=PATH` value, on the host.
    let on_host = |a: String| -> String {
        let a = ports.resolve(&a, name, &cfg.namespace);
        let (flag, value) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (format!("{f}="), v.to_owned()),
            _ => (String::new(), a.clone()),
        };
        for (mount, host) in &mounts {
            if let Some(rest) = value.strip_prefix(mount.as_str()) {
                return format!("{flag}{}{rest}", host.display());
            }
        }
        a
    };
    for value in env.values_mut() {
        *value = on_host(std::mem::take(value));
    }
    let mut args = Vec::new();
    let mut it = c["command"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(c["args"].as_array().into_iter().flatten())
        .filter_map(Value::as_str);
    while let Some(a) = it.next() {
        if a == "--listen" || a == "--advertise" {
            it.next();
            continue;
        }
        args.push(on_host(expand(a, &env)));
    }
    if args.first().is_some_and(|a| a == "edl") {
        args[0] = cfg.edl.display().to_string();
    }
    if args.is_empty() {
        return Err("no command".into());
    }
    Ok((args, env))
}

impl Kubelet {
    /// Runs the pods of `cfg.namespace` in `api` until dropped.
    pub fn start(api: Arc<FakeApi>, cfg: KubeletConfig) -> Kubelet {
        let stop = CancellationToken::new();
        let procs: Arc<Mutex<BTreeMap<String, Running>>> = Arc::default();
        api.serve_pod_logs(&cfg.namespace, cfg.dir.clone());
        let (s, p) = (stop.clone(), procs.clone());
        let ports = Ports::default();
        let (own_ports, namespace) = (ports.clone(), cfg.namespace.clone());
        tokio::spawn(async move {
            let mut changes = api.subscribe("pods").boxed();
            loop {
                sync(&api, &cfg, &p, &ports, &s);
                tokio::select! {
                    _ = s.cancelled() => return,
                    // Changes, or a second: a process may have ended meanwhile.
                    _ = changes.next() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        });
        Kubelet {
            stop,
            procs,
            ports: own_ports,
            namespace,
        }
    }

    /// The process id of `pod`'s container, while it runs.
    pub fn pid(&self, pod: &str) -> Option<u32> {
        let table = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        table.get(pod).map(|r| r.pid)
    }

    /// Maps the pod addresses in a text (`<pod>.<subdomain>.<ns>.svc:<port>`) to the
    /// loopback ports their pods use here, for a client outside the pods (an operator).
    pub fn resolver(&self) -> Arc<dyn Fn(&str) -> String + Send + Sync> {
        let (ports, ns) = (self.ports.clone(), self.namespace.clone());
        Arc::new(move |text: &str| ports.resolve(text, "", &ns))
    }
}

/// Where the pods' `emptyDir`s are, one folder per pod uid.
fn empty_dirs(cfg: &KubeletConfig) -> PathBuf {
    cfg.dir.join("emptydir")
}

/// Where the claims' directories are, one folder per claim uid.
fn claim_dirs(cfg: &KubeletConfig) -> PathBuf {
    cfg.dir.join("claims")
}

/// Deletes the directories of claims that are gone.
fn remove_claim_dirs(api: &FakeApi, cfg: &KubeletConfig) {
    let Ok(entries) = std::fs::read_dir(claim_dirs(cfg)) else {
        return;
    };
    let claims = api.list("persistentvolumeclaims", &cfg.namespace);
    for e in entries.flatten() {
        let uid = e.file_name();
        let live = claims
            .iter()
            .any(|c| c["metadata"]["uid"].as_str() == uid.to_str());
        if !live {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Deletes the `emptyDir`s of pods that are gone (a pod being deleted keeps them until
/// it is removed).
fn remove_empty_dirs(cfg: &KubeletConfig, pods: &[Value]) {
    let Ok(entries) = std::fs::read_dir(empty_dirs(cfg)) else {
        return;
    };
    for e in entries.flatten() {
        let uid = e.file_name();
        let live = pods
            .iter()
            .any(|p| p["metadata"]["uid"].as_str() == uid.to_str());
        if !live {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn sync(
    api: &Arc<FakeApi>,
    cfg: &KubeletConfig,
    procs: &Arc<Mutex<BTreeMap<String, Running>>>,
    ports: &Ports,
    stop: &CancellationToken,
) {
    let ns = cfg.namespace.as_str();
    let pods = api.list("pods", ns);
    let mut table = procs.lock().unwrap_or_else(|e| e.into_inner());
    // Processes of pods that are gone (removed at once): killed.
    table.retain(|name, r| {
        let alive = pods.iter().any(|p| {
            p["metadata"]["name"] == name.as_str() && p["metadata"]["uid"] == r.uid.as_str()
        });
        if !alive {
            let _ = crate::child::signal(r.pid, Signal::SIGKILL);
        }
        alive
    });
    remove_empty_dirs(cfg, &pods);
    if api.serves("persistentvolumeclaims") {
        remove_claim_dirs(api, cfg);
    }
    for pod in pods {
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let uid = pod["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let deleting = !pod["metadata"]["deletionTimestamp"].is_null();
        // A container that could not be configured (its Secret missing) is tried again,
        // as a kubelet does.
        let waiting = &pod["status"]["containerStatuses"][0]["state"]["waiting"];
        let config_error = waiting["reason"] == "CreateContainerConfigError";
        let started = !pod["status"]["phase"].is_null() && !config_error;
        if deleting {
            match table.get(&name) {
                Some(r) if r.uid == uid => {
                    // SIGTERM once (the status says we did), SIGKILL after the grace.
                    if pod["status"]["reason"] != "Terminating" {
                        let _ = crate::child::signal(r.pid, Signal::SIGTERM);
                        let _ =
                            api.patch_status("pods", ns, &name, &json!({"reason": "Terminating"}));
                        let grace = pod["metadata"]["deletionGracePeriodSeconds"]
                            .as_u64()
                            .unwrap_or(30);
                        let (pid, stop) = (r.pid, stop.clone());
                        tokio::spawn(async move {
                            tokio::select! {
                                _ = stop.cancelled() => {}
                                _ = tokio::time::sleep(Duration::from_secs(grace)) => {
                                    let _ = crate::child::signal(pid, Signal::SIGKILL);
                                }
                            }
                        });
                    }
                }
                // No process (never started, or it ended): the pod goes.
                _ => {
                    let _ = api.delete("pods", ns, &name, Some(0));
                }
            }
            continue;
        }
        if started {
            if table.get(&name).is_some_and(|r| r.uid == uid) {
                refresh_secret_volumes(api, cfg, &pod);
            }
            continue;
        }
        let from = match env_from(api, &pod, ns).and_then(|env| {
            secret_volumes_exist(api, &pod, ns)?;
            Ok(env)
        }) {
            Ok(env) => env,
            Err(e) => {
                // Said once (a write would wake this loop again).
                if !config_error || waiting["message"] != e.as_str() {
                    let _ = api.patch_status(
                        "pods",
                        ns,
                        &name,
                        &json!({"phase": "Pending", "containerStatuses": [{
                            "name": "c", "ready": false, "restartCount": 0, "image": "",
                            "imageID": "", "state": {"waiting": {
                                "reason": "CreateContainerConfigError", "message": e}},
                        }]}),
                    );
                }
                continue;
            }
        };
        let (args, env) = match command_of(api, &pod, cfg, from, ports) {
            Ok(c) => c,
            Err(e) => {
                let _ = api.patch_status(
                    "pods",
                    ns,
                    &name,
                    &json!({"phase": "Pending", "conditions": [{
                        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": e,
                    }]}),
                );
                continue;
            }
        };
        let log = match std::fs::File::create(cfg.dir.join(format!("{name}.log"))) {
            Ok(f) => f,
            Err(_) => continue,
        };
        let err = match log.try_clone() {
            Ok(f) => f,
            Err(_) => continue,
        };
        let mut cmd = tokio::process::Command::new(&args[0]);
        cmd.args(&args[1..])
            .envs(&env)
            .current_dir(&cfg.dir)
            .stdout(log)
            .stderr(err)
            .kill_on_drop(true);
        let started_at = now_rfc3339();
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let _ = api.patch_status(
                    "pods",
                    ns,
                    &name,
                    &json!({"phase": "Pending", "containerStatuses": [{
                        "name": "c", "ready": false, "restartCount": 0, "image": "", "imageID": "",
                        "state": {"waiting": {"reason": "RunContainerError", "message": e.to_string()}},
                    }]}),
                );
                continue;
            }
        };
        let Some(pid) = child.id() else {
            continue;
        };
        table.insert(
            name.clone(),
            Running {
                pid,
                uid: uid.clone(),
            },
        );
        // With a readiness probe, not Ready until it passes.
        let probed = probes::has_readiness(&pod);
        let ready = if probed { "False" } else { "True" };
        let _ = api.patch_status(
            "pods",
            ns,
            &name,
            &json!({"phase": "Running", "podIP": "127.0.0.1", "startTime": started_at,
                    "conditions": [{"type": "Ready", "status": ready}],
                    "containerStatuses": [{"name": "c", "ready": !probed, "restartCount": 0,
                        "image": "", "imageID": "",
                        "state": {"running": {"startedAt": started_at}}}]}),
        );
        let ended = stop.child_token();
        probes::start(
            &pod,
            |p| ports.of(&name, p),
            probes::Target {
                api: api.clone(),
                namespace: ns.to_owned(),
                pod: name.clone(),
                pid,
                ended: ended.clone(),
            },
        );
        let (api, ns, procs, stop) = (api.clone(), ns.to_owned(), procs.clone(), stop.clone());
        tokio::spawn(async move {
            let status = tokio::select! {
                _ = stop.cancelled() => return,
                s = child.wait() => s,
            };
            ended.cancel();
            let code = status.ok().and_then(|s| {
                use std::os::unix::process::ExitStatusExt;
                s.code().or_else(|| s.signal().map(|sig| 128 + sig))
            });
            let mut table = procs.lock().unwrap_or_else(|e| e.into_inner());
            if table.get(&name).is_some_and(|r| r.uid == uid) {
                table.remove(&name);
            }
            drop(table);
            let code = code.unwrap_or(1);
            let Some(now) = api.get("pods", &ns, &name) else {
                return;
            };
            if now["metadata"]["uid"] != uid.as_str() {
                return;
            }
            let _ = api.patch_status(
                "pods",
                &ns,
                &name,
                &json!({"phase": if code == 0 { "Succeeded" } else { "Failed" },
                        "conditions": [{"type": "Ready", "status": "False"}],
                        "containerStatuses": [{"name": "c", "ready": false, "restartCount": 0,
                            "image": "", "imageID": "",
                            "state": {"terminated": {"exitCode": code,
                                "startedAt": started_at, "finishedAt": now_rfc3339()}}}]}),
            );
            if !now["metadata"]["deletionTimestamp"].is_null() {
                let _ = api.delete("pods", &ns, &name, Some(0));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::Ports;

    #[test]
    fn pod_addresses_become_loopback_ports_kept_per_pod() {
        let ports = Ports::default();
        let cluster = "etcd-0=http://j-etcd-0.j.ml.svc:2380,etcd-1=http://j-etcd-1.j.ml.svc.cluster.local:2380";
        let got = ports.resolve(cluster, "j-etcd-0", "ml");
        let (p0, p1) = (ports.of("j-etcd-0", 2380), ports.of("j-etcd-1", 2380));
        assert_ne!(p0, p1);
        assert_eq!(
            got,
            format!("etcd-0=http://127.0.0.1:{p0},etcd-1=http://127.0.0.1:{p1}")
        );
        // A pod's own 0.0.0.0 is its port; the same again later.
        assert_eq!(
            ports.resolve("--listen-peer-urls=http://0.0.0.0:2380", "j-etcd-0", "ml"),
            format!("--listen-peer-urls=http://127.0.0.1:{p0}")
        );
        assert_eq!(ports.of("j-etcd-1", 2380), p1, "kept for the name");
        // Anything else stays as it is.
        for text in [
            "http://example.com:80",
            "a:b",
            "x.other.svc:1",
            "j-etcd-0.j.other-ns.svc:2380",
            "ends with:",
        ] {
            assert_eq!(ports.resolve(text, "j-etcd-0", "ml"), text);
        }
    }
}
