//! A fake Kubernetes API server on loopback, for the operator's tests: no real API server
//! runs on these machines. It speaks the Kubernetes REST protocol (JSON over HTTP/1.1)
//! to real clients (kube-rs), with these semantics, written from the API conventions
//! (<https://github.com/kubernetes/community/blob/master/contributors/devel/sig-architecture/api-conventions.md>):
//!
//! - **Resources**: the types given to [`FakeApi::start`], namespaced or cluster-wide,
//!   at `/api/v1/...` (core) or `/apis/GROUP/VERSION/...`; objects are JSON, stored whole.
//! - **resourceVersion**: one counter for all objects (like etcd's revision), set on every
//!   write; `metadata.uid`, `creationTimestamp` and `generation` (1 on create, +1 when
//!   anything but `metadata` and `status` changes) are the server's.
//! - **get, list** (with `labelSelector` equality terms `k=v`, `k!=v`, `k`, and
//!   `fieldSelector` on `metadata.name` / `metadata.namespace`; `limit` is ignored: every
//!   item comes in one page, which the protocol allows).
//! - **watch** (`?watch=true`): from a `resourceVersion` (events after it), or without
//!   one / with `0` (synthetic `ADDED` for the current objects first); a
//!   `resourceVersion` older than the retained event window gets an `ERROR` event with
//!   a `410 Gone` Status, as a compacted etcd makes the real server do; `timeoutSeconds`
//!   ends the stream. No bookmarks (they are optional).
//! - **create** (`409 AlreadyExists`; `generateName`); **update** (PUT) and **merge
//!   patch** (`application/merge-patch+json`; `strategic-merge-patch+json` is applied as a
//!   JSON merge patch, the same for every field edl patches) with **optimistic
//!   concurrency**: a `metadata.resourceVersion` in the body that is not the current one
//!   is `409 Conflict`. JSON patch and server-side apply are `415`.
//! - **status subresource** (`/status`): the main resource ignores status changes (and a
//!   create drops the status); `/status` changes only the status.
//! - **scale subresource** (`/scale`, an `autoscaling/v1` Scale) over the paths given in
//!   [`ResourceType::scale`].
//! - **delete**: with finalizers, or for a pod with a grace period (the pod's
//!   `terminationGracePeriodSeconds`, 30 s by default, or the request's
//!   `gracePeriodSeconds`), the object gets a `deletionTimestamp` and stays; a write that
//!   empties the finalizers of such an object (or a delete with grace 0 of such a pod)
//!   removes it. **Owner references**: removing an object deletes its dependents
//!   (background propagation).
//! - Errors are `Status` objects with the standard reasons and codes.
//!
//! Not covered: schema validation and defaulting of custom resources (the manifests
//! are validated against the real schemas by `deploy/tests`), admission, RBAC,
//! authentication, server-side apply, field managers, pagination, bookmarks, and the
//! other controllers of a cluster (scheduling and running pods is the test's own
//! kubelet, over [`FakeApi`]'s direct methods).

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// How many events a watch can resume from (older resourceVersions get 410 Gone).
pub const EVENT_WINDOW: usize = 10_000;

/// The paths of a scale subresource (JSON paths without the leading dot, e.g.
/// `spec.cluster.trainers`).
#[derive(Debug, Clone)]
pub struct ScalePaths {
    /// `Scale.spec.replicas`.
    pub spec_replicas: &'static str,
    /// `Scale.status.replicas`.
    pub status_replicas: &'static str,
    /// `Scale.status.selector`.
    pub selector: &'static str,
}

/// A resource type the server serves.
#[derive(Debug, Clone)]
pub struct ResourceType {
    /// The API group (`""` for core).
    pub group: &'static str,
    /// The version.
    pub version: &'static str,
    /// The plural path segment.
    pub plural: &'static str,
    /// The kind.
    pub kind: &'static str,
    /// Namespaced (else cluster-wide).
    pub namespaced: bool,
    /// It has a status subresource.
    pub status: bool,
    /// Its scale subresource, if any.
    pub scale: Option<ScalePaths>,
}

impl ResourceType {
    /// Core `v1` pods (status subresource).
    pub fn pods() -> ResourceType {
        ResourceType::core("pods", "Pod", true)
    }

    /// Core `v1` services.
    pub fn services() -> ResourceType {
        ResourceType::core("services", "Service", true)
    }

    /// Core `v1` events.
    pub fn events() -> ResourceType {
        ResourceType::core("events", "Event", false)
    }

    /// `events.k8s.io/v1` events (kube-rs' event recorder).
    pub fn events_v1() -> ResourceType {
        ResourceType {
            group: "events.k8s.io",
            version: "v1",
            plural: "events",
            kind: "Event",
            namespaced: true,
            status: false,
            scale: None,
        }
    }

    /// `coordination.k8s.io/v1` leases (leader election).
    pub fn leases() -> ResourceType {
        ResourceType {
            group: "coordination.k8s.io",
            version: "v1",
            plural: "leases",
            kind: "Lease",
            namespaced: true,
            status: false,
            scale: None,
        }
    }

    fn core(plural: &'static str, kind: &'static str, status: bool) -> ResourceType {
        ResourceType {
            group: "",
            version: "v1",
            plural,
            kind,
            namespaced: true,
            status,
            scale: None,
        }
    }

    fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// `(type index, namespace, name)`.
type Key = (usize, String, String);

#[derive(Debug, Clone)]
struct WatchEvent {
    rv: u64,
    type_index: usize,
    namespace: String,
    kind: &'static str,
    object: Value,
}

#[derive(Debug)]
struct Store {
    types: Vec<ResourceType>,
    rv: u64,
    uid: u64,
    objects: BTreeMap<Key, Value>,
    log: VecDeque<WatchEvent>,
    /// How many events are kept for watches to resume from.
    window: usize,
    /// Watches may resume from resourceVersions at or after this.
    oldest: u64,
}

/// An API error: a Status object.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP code.
    pub code: u16,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Gone`, `BadRequest`, ...
    pub reason: &'static str,
    /// What happened.
    pub message: String,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            reason,
            message: message.into(),
        }
    }

    fn status(&self) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        })
    }
}

fn now_rfc3339() -> String {
    rfc3339(std::time::SystemTime::now())
}

/// `t` as an RFC 3339 UTC time with seconds (`2026-11-23T17:52:34Z`), as Kubernetes
/// writes times.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (_, Some(p)) => {
            *target = Value::Object(serde_json::Map::new());
            merge_patch(target, &Value::Object(p.clone()));
        }
        _ => *target = patch.clone(),
    }
}

fn at_path<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

fn set_path(v: &mut Value, path: &str, value: Value) {
    let mut cur = v;
    let keys: Vec<&str> = path.split('.').collect();
    for k in &keys[..keys.len() - 1] {
        if !cur.get(*k).is_some_and(Value::is_object) {
            cur[*k] = json!({});
        }
        cur = &mut cur[*k];
    }
    cur[keys[keys.len() - 1]] = value;
}

fn labels_match(obj: &Value, selector: &str) -> bool {
    let labels = obj["metadata"]["labels"].as_object();
    let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    selector
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .all(|term| {
            if let Some((k, v)) = term.split_once("!=") {
                label(k.trim()) != Some(v.trim())
            } else if let Some((k, v)) = term.split_once('=') {
                label(k.trim().trim_end_matches('=')) == Some(v.trim())
            } else if let Some(k) = term.strip_prefix('!') {
                label(k.trim()).is_none()
            } else {
                label(term).is_some()
            }
        })
}

fn fields_match(obj: &Value, selector: &str) -> bool {
    selector
        .split(',')
        .filter(|t| !t.is_empty())
        .all(|term| match term.split_once('=') {
            Some((k, v)) => {
                let v = v.trim_start_matches('=');
                at_path(obj, k).and_then(Value::as_str) == Some(v)
            }
            None => true,
        })
}

/// The parts of `obj` that count for its `generation`.
fn spec_part(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    o
}

impl Store {
    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(
        &mut self,
        key: &Key,
        kind: &'static str,
        object: Value,
        tx: &broadcast::Sender<WatchEvent>,
    ) {
        let ev = WatchEvent {
            rv: self.rv,
            type_index: key.0,
            namespace: key.1.clone(),
            kind,
            object,
        };
        self.log.push_back(ev.clone());
        while self.log.len() > self.window {
            if let Some(old) = self.log.pop_front() {
                self.oldest = old.rv;
            }
        }
        let _ = tx.send(ev);
    }

    fn create(
        &mut self,
        t: usize,
        ns: &str,
        mut obj: Value,
        tx: &broadcast::Sender<WatchEvent>,
    ) -> Result<Value, ApiError> {
        let ty = self.types[t].clone();
        if !obj.is_object() {
            return Err(ApiError::new(
                400,
                "BadRequest",
                "the body is not an object",
            ));
        }
        let mut name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if name.is_empty() {
            let Some(prefix) = obj["metadata"]["generateName"].as_str() else {
                return Err(ApiError::new(
                    422,
                    "Invalid",
                    "metadata.name: Required value",
                ));
            };
            name = format!("{prefix}{:05x}", self.uid + 1);
        }
        let key = (t, ns.to_owned(), name.clone());
        if self.objects.contains_key(&key) {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", ty.plural),
            ));
        }
        self.uid += 1;
        let rv = self.bump();
        obj["apiVersion"] = json!(ty.api_version());
        obj["kind"] = json!(ty.kind);
        let m = &mut obj["metadata"];
        m["name"] = json!(name);
        if ty.namespaced {
            m["namespace"] = json!(ns);
        }
        m["uid"] = json!(format!("00000000-0000-4000-8000-{:012x}", self.uid));
        m["resourceVersion"] = json!(rv.to_string());
        m["creationTimestamp"] = json!(now_rfc3339());
        m["generation"] = json!(1);
        if let Some(mm) = m.as_object_mut() {
            mm.remove("deletionTimestamp");
        }
        if ty.status
            && let Some(o) = obj.as_object_mut()
        {
            o.remove("status");
        }
        self.objects.insert(key.clone(), obj.clone());
        self.record(&key, "ADDED", obj.clone(), tx);
        Ok(obj)
    }

    /// Writes `new` over the object at `key` (already checked and merged), removing it if
    /// it is being deleted and has no finalizers left.
    fn write(&mut self, key: &Key, mut new: Value, tx: &broadcast::Sender<WatchEvent>) -> Value {
        let old = self.objects.get(key).cloned().unwrap_or(Value::Null);
        if spec_part(&old) != spec_part(&new) {
            let g = old["metadata"]["generation"].as_i64().unwrap_or(1);
            new["metadata"]["generation"] = json!(g + 1);
        }
        let rv = self.bump();
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        let has_finalizers = |o: &Value| {
            o["metadata"]["finalizers"]
                .as_array()
                .is_some_and(|f| !f.is_empty())
        };
        // The last finalizer of an object being deleted went: it goes (a pod still in
        // its grace period waits for its kubelet's final delete).
        let graceful_pod = new["metadata"]["deletionGracePeriodSeconds"]
            .as_i64()
            .is_some_and(|g| g > 0);
        if !new["metadata"]["deletionTimestamp"].is_null()
            && has_finalizers(&old)
            && !has_finalizers(&new)
            && !graceful_pod
        {
            return self.remove(key, new, tx);
        }
        self.objects.insert(key.clone(), new.clone());
        self.record(key, "MODIFIED", new.clone(), tx);
        new
    }

    fn remove(&mut self, key: &Key, obj: Value, tx: &broadcast::Sender<WatchEvent>) -> Value {
        self.objects.remove(key);
        self.record(key, "DELETED", obj.clone(), tx);
        // Background propagation: the dependents go too.
        if let Some(uid) = obj["metadata"]["uid"].as_str() {
            let dependents: Vec<Key> = self
                .objects
                .iter()
                .filter(|(_, o)| {
                    o["metadata"]["ownerReferences"]
                        .as_array()
                        .is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid))
                })
                .map(|(k, _)| k.clone())
                .collect();
            for d in dependents {
                let _ = self.delete(&d, None, tx);
            }
        }
        obj
    }

    fn delete(
        &mut self,
        key: &Key,
        grace: Option<i64>,
        tx: &broadcast::Sender<WatchEvent>,
    ) -> Result<Value, ApiError> {
        let Some(obj) = self.objects.get(key).cloned() else {
            return Err(not_found(&self.types[key.0], &key.2));
        };
        let is_pod = self.types[key.0].plural == "pods" && self.types[key.0].group.is_empty();
        let grace = if is_pod {
            grace
                .or_else(|| obj["spec"]["terminationGracePeriodSeconds"].as_i64())
                .unwrap_or(30)
        } else {
            0
        };
        let has_finalizers = obj["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if !has_finalizers && grace == 0 {
            self.bump();
            return Ok(self.remove(key, obj, tx));
        }
        if !obj["metadata"]["deletionTimestamp"].is_null() {
            return Ok(obj);
        }
        let mut new = obj;
        new["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
        if is_pod {
            new["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
        }
        let rv = self.bump();
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.objects.insert(key.clone(), new.clone());
        self.record(key, "MODIFIED", new.clone(), tx);
        Ok(new)
    }
}

fn not_found(ty: &ResourceType, name: &str) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("{} \"{name}\" not found", ty.plural),
    )
}

#[derive(Debug)]
struct Shared {
    store: Mutex<Store>,
    tx: broadcast::Sender<WatchEvent>,
    stop: CancellationToken,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The fake API server.
#[derive(Debug)]
pub struct FakeApi {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.shared.stop.cancel();
    }
}

/// What a request is about.
struct Target {
    type_index: usize,
    namespace: String,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_path(types: &[ResourceType], path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match parts.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (ns.to_string(), rest),
        rest => (String::new(), rest),
    };
    let (plural, name, sub) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some(n.to_string()), None),
        [p, n, s] => (*p, Some(n.to_string()), Some(s.to_string())),
        _ => return None,
    };
    let type_index = types
        .iter()
        .position(|t| t.group == group && t.version == version && t.plural == plural)?;
    Some(Target {
        type_index,
        namespace,
        name,
        sub,
    })
}

fn query(req: &Request) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn json_response(code: u16, body: &Value) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

fn error_response(e: &ApiError) -> Response {
    json_response(e.code, &e.status())
}

impl FakeApi {
    /// Serves `types` on `127.0.0.1:0` until dropped.
    pub async fn start(types: Vec<ResourceType>) -> std::io::Result<FakeApi> {
        FakeApi::start_with_window(types, EVENT_WINDOW).await
    }

    /// [`FakeApi::start`], keeping only `window` events for watches to resume from.
    pub async fn start_with_window(
        types: Vec<ResourceType>,
        window: usize,
    ) -> std::io::Result<FakeApi> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, _) = broadcast::channel(65_536);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                types,
                rv: 1,
                uid: 0,
                objects: BTreeMap::new(),
                log: VecDeque::new(),
                window: window.max(1),
                oldest: 1,
            }),
            tx,
            stop: CancellationToken::new(),
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let stop = shared.stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        Ok(FakeApi { addr, shared })
    }

    /// The server's URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn type_index(&self, plural: &str) -> usize {
        self.shared
            .lock()
            .types
            .iter()
            .position(|t| t.plural == plural)
            .unwrap_or_else(|| panic!("the fake serves no {plural}"))
    }

    /// The objects of type `plural` (the first type of that plural) in `namespace`.
    pub fn list(&self, plural: &str, namespace: &str) -> Vec<Value> {
        let t = self.type_index(plural);
        self.shared
            .lock()
            .objects
            .iter()
            .filter(|((ti, ns, _), _)| *ti == t && ns == namespace)
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// One object.
    pub fn get(&self, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        let t = self.type_index(plural);
        self.shared
            .lock()
            .objects
            .get(&(t, namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Merges `patch` into an object's status (as a kubelet reports a pod's).
    pub fn patch_status(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
        patch: &Value,
    ) -> Result<Value, ApiError> {
        let t = self.type_index(plural);
        let key = (t, namespace.to_owned(), name.to_owned());
        let mut store = self.shared.lock();
        let Some(mut obj) = store.objects.get(&key).cloned() else {
            return Err(not_found(&store.types[t], name));
        };
        merge_patch(&mut obj["status"], patch);
        Ok(store.write(&key, obj, &self.shared.tx))
    }

    /// Deletes an object (`grace`: a pod's grace period; `Some(0)` removes a pod at once,
    /// as a kubelet does once its containers stopped).
    pub fn delete(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
        grace: Option<i64>,
    ) -> Result<Value, ApiError> {
        let t = self.type_index(plural);
        let mut store = self.shared.lock();
        store.delete(
            &(t, namespace.to_owned(), name.to_owned()),
            grace,
            &self.shared.tx,
        )
    }

    /// A stream of changes to objects of type `plural` from now on: `(type, object)`.
    pub fn subscribe(&self, plural: &str) -> impl futures::Stream<Item = (String, Value)> + use<> {
        let t = self.type_index(plural);
        let rx = self.shared.tx.subscribe();
        futures::stream::unfold(rx, move |mut rx| async move {
            loop {
                match rx.recv().await {
                    Ok(ev) if ev.type_index == t => {
                        return Some(((ev.kind.to_owned(), ev.object), rx));
                    }
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        })
    }
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let types = shared.lock().types.clone();
    let Some(target) = parse_path(&types, req.uri().path()) else {
        return error_response(&ApiError::new(
            404,
            "NotFound",
            format!(
                "the server could not find the requested resource ({})",
                req.uri().path()
            ),
        ));
    };
    let q = query(&req);
    let method = req.method().clone();
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_owned();
    let body = match axum::body::to_bytes(req.into_body(), 64 << 20).await {
        Ok(b) => b,
        Err(e) => return error_response(&ApiError::new(400, "BadRequest", e.to_string())),
    };
    let watch = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    if method == Method::GET && watch {
        return watch_response(&shared, &target, &q);
    }
    match respond(&shared, &target, &method, &q, &content_type, &body) {
        Ok((code, v)) => json_response(code, &v),
        Err(e) => error_response(&e),
    }
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(400, "BadRequest", format!("invalid JSON: {e}")))
}

fn check_rv(current: &Value, given: &Value, ty: &ResourceType, name: &str) -> Result<(), ApiError> {
    match given["metadata"]["resourceVersion"].as_str() {
        Some(rv)
            if !rv.is_empty() && Some(rv) != current["metadata"]["resourceVersion"].as_str() =>
        {
            Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} \"{name}\": the object has been \
                     modified; please apply your changes to the latest version and try again",
                    ty.plural
                ),
            ))
        }
        _ => Ok(()),
    }
}

fn respond(
    shared: &Shared,
    target: &Target,
    method: &Method,
    q: &BTreeMap<String, String>,
    content_type: &str,
    body: &Bytes,
) -> Result<(u16, Value), ApiError> {
    let mut store = shared.lock();
    let ty = store.types[target.type_index].clone();
    let ns = target.namespace.clone();
    let tx = &shared.tx;
    let Some(name) = target.name.clone() else {
        // Collections.
        return match *method {
            Method::GET => {
                let ls = q.get("labelSelector").cloned().unwrap_or_default();
                let fs = q.get("fieldSelector").cloned().unwrap_or_default();
                let items: Vec<Value> = store
                    .objects
                    .iter()
                    .filter(|((t, o_ns, _), o)| {
                        *t == target.type_index
                            && (ns.is_empty() || *o_ns == ns)
                            && labels_match(o, &ls)
                            && fields_match(o, &fs)
                    })
                    .map(|(_, o)| o.clone())
                    .collect();
                Ok((
                    200,
                    json!({
                        "apiVersion": ty.api_version(), "kind": format!("{}List", ty.kind),
                        "metadata": {"resourceVersion": store.rv.to_string()}, "items": items,
                    }),
                ))
            }
            Method::POST => {
                let obj = parse_body(body)?;
                store
                    .create(target.type_index, &ns, obj, tx)
                    .map(|o| (201, o))
            }
            _ => Err(ApiError::new(
                405,
                "MethodNotAllowed",
                "not allowed on a collection",
            )),
        };
    };
    let key = (target.type_index, ns.clone(), name.clone());
    let current = store.objects.get(&key).cloned();
    let sub = target.sub.as_deref();
    match (method.clone(), sub) {
        (Method::GET, None) => current
            .map(|o| (200, o))
            .ok_or_else(|| not_found(&ty, &name)),
        (Method::GET, Some("status")) if ty.status => current
            .map(|o| (200, o))
            .ok_or_else(|| not_found(&ty, &name)),
        (Method::GET, Some("scale")) => {
            let (Some(paths), Some(o)) = (&ty.scale, current) else {
                return Err(not_found(&ty, &name));
            };
            Ok((200, scale_of(&o, paths)))
        }
        (Method::DELETE, None) => {
            let opts: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let grace = opts["gracePeriodSeconds"]
                .as_i64()
                .or_else(|| q.get("gracePeriodSeconds").and_then(|g| g.parse().ok()));
            if let Some(uid) = opts["preconditions"]["uid"].as_str()
                && current
                    .as_ref()
                    .is_some_and(|c| c["metadata"]["uid"] != uid)
            {
                return Err(ApiError::new(409, "Conflict", "precondition failed: uid"));
            }
            store.delete(&key, grace, tx).map(|o| (200, o))
        }
        (Method::PUT | Method::PATCH, sub) => {
            let Some(current) = current else {
                return Err(not_found(&ty, &name));
            };
            let input = parse_body(body)?;
            let mut new = if *method == Method::PATCH {
                if !(content_type.starts_with("application/merge-patch+json")
                    || content_type.starts_with("application/strategic-merge-patch+json"))
                {
                    return Err(ApiError::new(
                        415,
                        "UnsupportedMediaType",
                        format!(
                            "the fake API server applies merge patches only, not {content_type}"
                        ),
                    ));
                }
                check_rv(&current, &input, &ty, &name)?;
                let mut base = match (sub, &ty.scale) {
                    (Some("scale"), Some(paths)) => scale_of(&current, paths),
                    _ => current.clone(),
                };
                merge_patch(&mut base, &input);
                base
            } else {
                check_rv(&current, &input, &ty, &name)?;
                input
            };
            let result = match (sub, &ty.scale) {
                (None, _) => {
                    if ty.status {
                        new["status"] = current["status"].clone();
                    }
                    new
                }
                (Some("status"), _) if ty.status => {
                    let mut o = current.clone();
                    o["status"] = new["status"].clone();
                    o
                }
                (Some("scale"), Some(paths)) => {
                    let replicas = new["spec"]["replicas"].clone();
                    if !replicas.is_i64() && !replicas.is_u64() {
                        return Err(ApiError::new(
                            422,
                            "Invalid",
                            "spec.replicas: Required value",
                        ));
                    }
                    let mut o = current.clone();
                    set_path(&mut o, paths.spec_replicas, replicas);
                    o
                }
                _ => return Err(not_found(&ty, &name)),
            };
            // The server owns these.
            let mut result = result;
            for k in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "generation",
                "name",
                "namespace",
            ] {
                result["metadata"][k] = current["metadata"][k].clone();
            }
            if let Some(m) = result["metadata"].as_object_mut() {
                m.retain(|_, v| !v.is_null());
            }
            result["apiVersion"] = current["apiVersion"].clone();
            result["kind"] = current["kind"].clone();
            let written = store.write(&key, result, tx);
            match (sub, &ty.scale) {
                (Some("scale"), Some(paths)) => Ok((200, scale_of(&written, paths))),
                _ => Ok((200, written)),
            }
        }
        _ => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{method} {sub:?}"),
        )),
    }
}

fn scale_of(obj: &Value, paths: &ScalePaths) -> Value {
    let m = &obj["metadata"];
    json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {
            "name": m["name"], "namespace": m["namespace"], "uid": m["uid"],
            "resourceVersion": m["resourceVersion"], "creationTimestamp": m["creationTimestamp"],
        },
        "spec": {"replicas": at_path(obj, paths.spec_replicas).cloned().unwrap_or(json!(0))},
        "status": {
            "replicas": at_path(obj, paths.status_replicas).cloned().unwrap_or(json!(0)),
            "selector": at_path(obj, paths.selector).cloned().unwrap_or(json!("")),
        },
    })
}

fn watch_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn watch_response(shared: &Arc<Shared>, target: &Target, q: &BTreeMap<String, String>) -> Response {
    let ls = q.get("labelSelector").cloned().unwrap_or_default();
    let fs = q.get("fieldSelector").cloned().unwrap_or_default();
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(Duration::from_secs(300), Duration::from_secs);
    let t = target.type_index;
    let ns = target.namespace.clone();
    let matches = move |ev_t: usize, ev_ns: &str, o: &Value| {
        ev_t == t && (ns.is_empty() || ev_ns == ns) && labels_match(o, &ls) && fields_match(o, &fs)
    };
    // Under the lock: the backlog, then the subscription, so nothing falls in between.
    let (initial, expired, rx) = {
        let store = shared.lock();
        let rx = shared.tx.subscribe();
        let from = q
            .get("resourceVersion")
            .filter(|rv| !rv.is_empty() && *rv != "0");
        let mut expired = false;
        let initial: Vec<Bytes> = match from {
            None => store
                .objects
                .iter()
                .filter(|((ot, ons, _), o)| matches(*ot, ons, o))
                .map(|(_, o)| watch_line("ADDED", o))
                .collect(),
            Some(rv) => {
                let Ok(rv) = rv.parse::<u64>() else {
                    return error_response(&ApiError::new(
                        400,
                        "BadRequest",
                        "invalid resourceVersion",
                    ));
                };
                if rv < store.oldest {
                    expired = true;
                    let gone = ApiError::new(
                        410,
                        "Expired",
                        format!("too old resource version: {rv} ({})", store.oldest),
                    );
                    vec![watch_line("ERROR", &gone.status())]
                } else {
                    store
                        .log
                        .iter()
                        .filter(|e| e.rv > rv && matches(e.type_index, &e.namespace, &e.object))
                        .map(|e| watch_line(e.kind, &e.object))
                        .collect()
                }
            }
        };
        (initial, expired, rx)
    };
    let stop = shared.stop.clone();
    let deadline = tokio::time::Instant::now() + timeout;
    let live = futures::stream::unfold((rx, expired), move |(mut rx, done)| {
        let stop = stop.clone();
        let matches = matches.clone();
        async move {
            if done {
                return None;
            }
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    _ = tokio::time::sleep_until(deadline) => return None,
                    ev = rx.recv() => match ev {
                        Ok(ev) if matches(ev.type_index, &ev.namespace, &ev.object) => {
                            return Some((watch_line(ev.kind, &ev.object), (rx, false)));
                        }
                        Ok(_) => continue,
                        // A watcher that fell behind is ended; the client re-lists.
                        Err(_) => return None,
                    },
                }
            }
        }
    });
    let stream = futures::StreamExt::map(
        futures::StreamExt::chain(futures::stream::iter(initial), live),
        Ok::<Bytes, std::io::Error>,
    );
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}
