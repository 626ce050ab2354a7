//! A fake Kubernetes API server on loopback, for the operator's tests: no real API server
//! runs on these machines. It speaks the Kubernetes REST protocol (JSON over HTTP/1.1)
//! to real clients (kube-rs), with these semantics, written from the API conventions
//! (<https://github.com/kubernetes/community/blob/master/contributors/devel/sig-architecture/api-conventions.md>):
//!
//! - **Resources**: the types given to [`FakeApi::start`], namespaced or cluster-wide,
//!   at `/api/v1/...` (core) or `/apis/GROUP/VERSION/...`; objects are JSON, stored whole.
//! - **Discovery**: `/api`, `/apis`, `/apis/GROUP` and each group version's
//!   `APIResourceList` (with the status, scale and pod log subresources), what `kubectl`
//!   reads before any request. No OpenAPI documents and no aggregated discovery (a
//!   client falls back to the legacy documents).
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
//!   is `409 Conflict`. JSON patch is `415`. **Server-side apply**
//!   (`application/apply-patch+yaml`, `fieldManager`, `force`) with field ownership in
//!   `metadata.managedFields` (`apply.rs`, which says where it differs).
//! - **status subresource** (`/status`): the main resource ignores status changes (and a
//!   create drops the status); `/status` changes only the status.
//! - **scale subresource** (`/scale`, an `autoscaling/v1` Scale) over the paths given in
//!   [`ResourceType::scale`].
//! - **Secrets** ([`ResourceType::secrets`]): `stringData` is merged into `data`
//!   (base64) on every write and never stored or returned; a `data` value that is not
//!   base64 is `422 Invalid`; `type` defaults to `Opaque` and cannot change; the data of
//!   an `immutable` Secret cannot change. Secrets are served in clear, like every
//!   object here (no encryption at rest, no RBAC).
//! - **delete**: with finalizers, or for a pod with a grace period (the pod's
//!   `terminationGracePeriodSeconds`, 30 s by default, or the request's
//!   `gracePeriodSeconds`), the object gets a `deletionTimestamp` and stays; a write that
//!   empties the finalizers of such an object (or a delete with grace 0 of such a pod)
//!   removes it. **Owner references**: removing an object deletes its dependents
//!   (background propagation). **Claim protection**: a PersistentVolumeClaim gets the
//!   `kubernetes.io/pvc-protection` finalizer at creation, as the admission plugin adds
//!   it, and a claim being deleted loses it once no pod that has not ended mounts it, as
//!   the controller does: a claim deleted while its pod runs stays (Terminating) until
//!   that pod is gone.
//! - **pod logs** (`pods/NAME/log`, text; `tailLines`, `follow`): from the files a test
//!   kubelet writes ([`FakeApi::serve_pod_logs`]); a pod whose container has not started
//!   is `400 BadRequest`, as on a real server; `follow` streams what is appended until the
//!   pod is removed or has ended.
//! - Errors are `Status` objects with the standard reasons and codes.
//! - **eviction** (`POST pods/NAME/eviction`, what `kubectl drain` sends): refused with
//!   `429 TooManyRequests` when a PodDisruptionBudget of the pod's namespace selects the
//!   pod and the pods it selects that are healthy (Running, not being deleted, and
//!   Ready where the pod reports readiness) would fall below its `minAvailable` (an
//!   integer); else the pod is deleted as a `DELETE` with the eviction's
//!   `deleteOptions` would. Computed at the request from the pods stored, where a real
//!   cluster reads the budget's status (`disruptionsAllowed`) that its disruption
//!   controller keeps; `maxUnavailable` and percentages are not covered (such a budget
//!   is `422 Invalid` at eviction).
//! - **Pod Security admission**: a pod created in a namespace whose Namespace object is
//!   labelled `pod-security.kubernetes.io/enforce: baseline` or `restricted` is refused
//!   (`403 Forbidden`, naming each check it fails) unless it meets that Pod Security
//!   Standard (`pod_security.rs` says which checks, and where it differs).
//! - **nodes**: [`FakeApi::bind`] binds a pod (`spec.nodeName`, as the `binding`
//!   subresource), [`FakeApi::node_not_ready`] loses a node as the node lifecycle
//!   controller records it; the timed parts (its grace, the taint's eviction) are the
//!   test's.
//! - **NetworkPolicies** are stored and evaluated ([`FakeApi::network_allows`], with the
//!   semantics of a plugin that enforces them), but nothing filters the pods' sockets.
//!
//! Every request is recorded as RBAC would authorize it ([`FakeApi::accesses`]), so a
//! test can check a client's RBAC rules cover what it did; for the users a test names
//! ([`FakeApi::enforce_rbac`]) requests are authorized by the stored RBAC objects
//! (`rbac.rs`: `403 Forbidden` as the real authorizer words it), everyone else's are not.
//!
//! A field a CRD's structural schema would prune is dropped only where a test says so
//! ([`FakeApi::prune`]: a CRD older than its operator).
//!
//! Not covered: schema validation, pruning and defaulting of custom resources (the
//! manifests are validated against the real schemas by `deploy/tests`), admission other
//! than Pod Security, protobuf bodies (`415`), RBAC for users not named to
//! [`FakeApi::enforce_rbac`],
//! authentication, the ownership of updates (only applies record it), pagination, bookmarks, a Secret's
//! other checks (key names, the 1 MiB limit, the keys `kubernetes.io/*` types need),
//! and the other controllers of a cluster (scheduling and running pods is the test's own
//! kubelet, over [`FakeApi`]'s direct methods).
//!
//! Layout: this module has the resource types, errors and [`FakeApi`] (the server and the
//! direct methods a test kubelet uses); `store.rs` the objects, the resourceVersion
//! counter, the event log and the write rules; `http.rs` the REST paths, verbs,
//! subresources and watch streams; `network_policy.rs` what the stored NetworkPolicies
//! allow ([`FakeApi::network_allows`]: evaluated, not enforced on sockets).

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

mod apply;
mod http;
pub mod network_policy;
pub mod pod_security;
mod rbac;
mod store;

use store::{Store, WatchEvent, not_found};
pub use store::{base64_decode, base64_encode, merge_patch};

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

    /// Core `v1` secrets (no status; `stringData`, `type` and `immutable` kept as the
    /// API server keeps them).
    pub fn secrets() -> ResourceType {
        ResourceType::core("secrets", "Secret", false)
    }

    /// Core `v1` PersistentVolumeClaims (status subresource). The test kubelet gives
    /// each a directory that lives as long as the claim.
    pub fn persistent_volume_claims() -> ResourceType {
        ResourceType::core("persistentvolumeclaims", "PersistentVolumeClaim", true)
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

    /// edl's `TrainingJob` (`edl.dev/v1alpha1`), with its status subresource and its
    /// scale subresource on the trainer count (as `deploy/crd.yaml` declares them).
    pub fn trainingjobs() -> ResourceType {
        ResourceType {
            group: "edl.dev",
            version: "v1alpha1",
            plural: "trainingjobs",
            kind: "TrainingJob",
            namespaced: true,
            status: true,
            scale: Some(ScalePaths {
                spec_replicas: "spec.cluster.trainers",
                status_replicas: "status.trainers.running",
                selector: "status.selector",
            }),
        }
    }

    /// Core `v1` nodes (cluster-wide, status subresource).
    pub fn nodes() -> ResourceType {
        ResourceType {
            namespaced: false,
            ..ResourceType::core("nodes", "Node", true)
        }
    }

    /// `scheduling.k8s.io/v1` PriorityClasses (cluster-wide).
    pub fn priority_classes() -> ResourceType {
        ResourceType {
            group: "scheduling.k8s.io",
            version: "v1",
            plural: "priorityclasses",
            kind: "PriorityClass",
            namespaced: false,
            status: false,
            scale: None,
        }
    }

    /// `networking.k8s.io/v1` NetworkPolicies (stored and evaluated by
    /// [`FakeApi::network_allows`], not enforced: nothing here filters connections).
    pub fn network_policies() -> ResourceType {
        ResourceType {
            group: "networking.k8s.io",
            version: "v1",
            plural: "networkpolicies",
            kind: "NetworkPolicy",
            namespaced: true,
            status: false,
            scale: None,
        }
    }

    /// `policy/v1` PodDisruptionBudgets, which the pods' eviction subresource honours
    /// (see `http.rs`, `evict`).
    pub fn pod_disruption_budgets() -> ResourceType {
        ResourceType {
            group: "policy",
            version: "v1",
            plural: "poddisruptionbudgets",
            kind: "PodDisruptionBudget",
            namespaced: true,
            status: true,
            scale: None,
        }
    }

    /// Kueue's `Workload` (`kueue.x-k8s.io/v1beta1`), with its status subresource:
    /// stored; no Kueue runs here, a test writes the status Kueue would.
    pub fn kueue_workloads() -> ResourceType {
        ResourceType {
            group: "kueue.x-k8s.io",
            version: "v1beta1",
            plural: "workloads",
            kind: "Workload",
            namespaced: true,
            status: true,
            scale: None,
        }
    }

    /// Kueue's `ResourceFlavor` (`kueue.x-k8s.io/v1beta1`, cluster-wide): stored; a
    /// test makes the flavors a Workload is admitted with.
    pub fn kueue_resource_flavors() -> ResourceType {
        ResourceType {
            group: "kueue.x-k8s.io",
            version: "v1beta1",
            plural: "resourceflavors",
            kind: "ResourceFlavor",
            namespaced: false,
            status: false,
            scale: None,
        }
    }

    /// Volcano's `PodGroup` (`scheduling.volcano.sh/v1beta1`): stored; no Volcano
    /// scheduler runs here.
    pub fn volcano_pod_groups() -> ResourceType {
        ResourceType {
            group: "scheduling.volcano.sh",
            version: "v1beta1",
            plural: "podgroups",
            kind: "PodGroup",
            namespaced: true,
            status: true,
            scale: None,
        }
    }

    /// Every type the edl operator uses: pods, services, secrets (the jobs' TLS and
    /// etcd credentials), PersistentVolumeClaims, NetworkPolicies,
    /// PodDisruptionBudgets, events,
    /// TrainingJobs, the leader election's leases, the nodes and PriorityClasses its
    /// autoscaler reads, Kueue's Workloads and ResourceFlavors (`--kueue`) and Volcano's
    /// PodGroups.
    pub fn for_operator() -> Vec<ResourceType> {
        vec![
            ResourceType::pods(),
            ResourceType::services(),
            ResourceType::secrets(),
            ResourceType::persistent_volume_claims(),
            ResourceType::network_policies(),
            ResourceType::pod_disruption_budgets(),
            ResourceType::events_v1(),
            ResourceType::trainingjobs(),
            ResourceType::leases(),
            ResourceType::nodes(),
            ResourceType::priority_classes(),
            ResourceType::kueue_workloads(),
            ResourceType::kueue_resource_flavors(),
            ResourceType::volcano_pod_groups(),
        ]
    }

    /// The types of `deploy/`'s files besides the operator's own (namespaces, service
    /// accounts, RBAC, the operator's Deployment, ConfigMaps, the CRD), so that
    /// `kubectl apply -f deploy/` runs against the stand-in. They are stored, not acted
    /// on: no controller runs the Deployment, RBAC is not enforced, and TrainingJobs are
    /// served whether or not their CRD was applied.
    pub fn for_deploy() -> Vec<ResourceType> {
        let typ = |group, version, plural, kind, namespaced| ResourceType {
            group,
            version,
            plural,
            kind,
            namespaced,
            status: false,
            scale: None,
        };
        vec![
            typ("", "v1", "namespaces", "Namespace", false),
            typ("", "v1", "serviceaccounts", "ServiceAccount", true),
            typ("", "v1", "configmaps", "ConfigMap", true),
            typ("apps", "v1", "deployments", "Deployment", true),
            typ(
                "rbac.authorization.k8s.io",
                "v1",
                "clusterroles",
                "ClusterRole",
                false,
            ),
            typ(
                "rbac.authorization.k8s.io",
                "v1",
                "clusterrolebindings",
                "ClusterRoleBinding",
                false,
            ),
            typ("rbac.authorization.k8s.io", "v1", "roles", "Role", true),
            typ(
                "rbac.authorization.k8s.io",
                "v1",
                "rolebindings",
                "RoleBinding",
                true,
            ),
            typ(
                "apiextensions.k8s.io",
                "v1",
                "customresourcedefinitions",
                "CustomResourceDefinition",
                false,
            ),
        ]
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

    fn is_secret(&self) -> bool {
        self.group.is_empty() && self.plural == "secrets"
    }

    fn is_claim(&self) -> bool {
        self.group.is_empty() && self.plural == "persistentvolumeclaims"
    }

    fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
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

#[derive(Debug)]
struct Shared {
    store: Mutex<Store>,
    tx: broadcast::Sender<WatchEvent>,
    stop: CancellationToken,
    /// Per namespace, the directory of its pods' logs ([`FakeApi::serve_pod_logs`]).
    pod_logs: Mutex<BTreeMap<String, std::path::PathBuf>>,
    /// Every request, as RBAC sees it.
    accesses: Mutex<Vec<Access>>,
    /// The users whose requests RBAC authorizes ([`FakeApi::enforce_rbac`]).
    rbac_users: Mutex<std::collections::BTreeSet<String>>,
}

/// A request as RBAC authorizes it: verb, API group, resource, subresource, namespace.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Access {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`.
    pub verb: &'static str,
    /// The API group (`""` for core).
    pub group: &'static str,
    /// The resource (plural).
    pub resource: &'static str,
    /// The subresource (`status`, `scale`, `log`), if any.
    pub subresource: Option<String>,
    /// The object's name (none for list, watch and create).
    pub name: Option<String>,
    /// Who asked: the bearer token of the request's `Authorization` header, which this
    /// fake takes as the user's name (it authenticates no one).
    pub user: Option<String>,
    /// The namespace (`""` for cluster-wide requests).
    pub namespace: String,
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
                pruned: BTreeMap::new(),
            }),
            tx,
            stop: CancellationToken::new(),
            pod_logs: Mutex::default(),
            accesses: Mutex::default(),
            rbac_users: Mutex::default(),
        });
        let app = axum::Router::new()
            .fallback(http::handle)
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

    /// Whether it serves objects of type `plural`.
    pub fn serves(&self, plural: &str) -> bool {
        self.shared.lock().types.iter().any(|t| t.plural == plural)
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

    /// From now on the server drops the field at `path` (`["status", "etcdJob"]`) from
    /// every object of `plural` it stores, as an API server does with a field its
    /// custom resource's structural schema lacks (a CRD older than its operator).
    pub fn prune(&self, plural: &str, path: &[&str]) {
        let t = self.type_index(plural);
        self.shared
            .lock()
            .pruned
            .entry(t)
            .or_default()
            .push(path.iter().map(|p| (*p).to_owned()).collect());
    }

    /// Stops dropping fields of `plural` ([`FakeApi::prune`]): the CRD was updated.
    pub fn unprune(&self, plural: &str) {
        let t = self.type_index(plural);
        self.shared.lock().pruned.remove(&t);
    }

    /// From now on, `user`'s requests (its bearer token is its name; a service account's
    /// is `system:serviceaccount:<namespace>:<name>`) are authorized by the stored RBAC
    /// objects (`rbac.rs`): one no rule bound to it allows is `403 Forbidden`.
    pub fn enforce_rbac(&self, user: &str) {
        self.shared
            .rbac_users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(user.to_owned());
    }

    /// Every request served so far, in order, as RBAC would authorize it (the RBAC rules
    /// a client needs are checked against these).
    pub fn accesses(&self) -> Vec<Access> {
        self.shared
            .accesses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Serves the `log` subresource of the pods of `namespace` from `dir/<pod>.log` (the
    /// files a test kubelet writes; a real API server proxies the request to the pod's
    /// kubelet the same way).
    pub fn serve_pod_logs(&self, namespace: &str, dir: std::path::PathBuf) {
        self.shared
            .pod_logs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(namespace.to_owned(), dir);
    }

    /// Binds pod `name` of `namespace` to `node`, as the scheduler's `binding`
    /// subresource does (`spec.nodeName`; a bound pod cannot be bound again: `409`).
    pub fn bind(&self, namespace: &str, name: &str, node: &str) -> Result<Value, ApiError> {
        let t = self.type_index("pods");
        let key = (t, namespace.to_owned(), name.to_owned());
        let mut store = self.shared.lock();
        let Some(mut pod) = store.objects.get(&key).cloned() else {
            return Err(not_found(&store.types[t], name));
        };
        if let Some(bound) = pod["spec"]["nodeName"].as_str() {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!("pod {name} is already assigned to node \"{bound}\""),
            ));
        }
        pod["spec"]["nodeName"] = json!(node);
        Ok(store.write(&key, pod, &self.shared.tx))
    }

    /// Node `node` stops answering, as the node lifecycle controller then records it:
    /// its `Ready` condition `Unknown` since `since` (its kubelet stopped posting its
    /// status), the `node.kubernetes.io/unreachable` `NoExecute` taint, and each pod
    /// bound to it no longer `Ready`. The taint's eviction (after a pod's toleration, 300
    /// s by default) is the test's to do ([`FakeApi::delete`] with a grace period): a
    /// pod deleted so stays terminating, as no kubelet confirms it.
    pub fn node_not_ready(&self, node: &str, since: std::time::SystemTime) -> Result<(), ApiError> {
        let (t, pods) = (self.type_index("nodes"), self.type_index("pods"));
        let key = (t, String::new(), node.to_owned());
        let mut store = self.shared.lock();
        let Some(mut n) = store.objects.get(&key).cloned() else {
            return Err(not_found(&store.types[t], node));
        };
        let mut conditions: Vec<Value> = n["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        conditions.retain(|c| c["type"] != "Ready");
        conditions.push(json!({"type": "Ready", "status": "Unknown",
            "reason": "NodeStatusUnknown", "message": "Kubelet stopped posting node status.",
            "lastTransitionTime": rfc3339(since), "lastHeartbeatTime": rfc3339(since)}));
        n["status"]["conditions"] = json!(conditions);
        let mut taints: Vec<Value> = n["spec"]["taints"].as_array().cloned().unwrap_or_default();
        taints.retain(|t| t["key"] != "node.kubernetes.io/unreachable");
        taints.push(
            json!({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute",
                           "timeAdded": rfc3339(since)}),
        );
        n["spec"]["taints"] = json!(taints);
        store.write(&key, n, &self.shared.tx);
        let bound: Vec<_> = store
            .objects
            .iter()
            .filter(|((ty, _, _), p)| *ty == pods && p["spec"]["nodeName"] == node)
            .map(|(k, p)| (k.clone(), p.clone()))
            .collect();
        for (k, mut p) in bound {
            let mut conditions: Vec<Value> = p["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            conditions.retain(|c| c["type"] != "Ready");
            conditions.push(json!({"type": "Ready", "status": "False"}));
            p["status"]["conditions"] = json!(conditions);
            store.write(&k, p, &self.shared.tx);
        }
        Ok(())
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

    /// Applies `status` (server-side apply, through `/status`) to an object as
    /// `manager` (`force`: taking fields another manager owns), as a controller such as
    /// Kueue writes a Workload's status.
    pub fn apply_status(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
        manager: &str,
        status: &Value,
        force: bool,
    ) -> Result<Value, ApiError> {
        let t = self.type_index(plural);
        let key = (t, namespace.to_owned(), name.to_owned());
        let mut store = self.shared.lock();
        let Some(obj) = store.objects.get(&key).cloned() else {
            return Err(not_found(&store.types[t], name));
        };
        let applied = json!({ "status": status });
        let now = store::now_rfc3339();
        let new = apply::apply(&obj, &applied, manager, force, Some("status"), &now)?;
        Ok(store.write(&key, new, &self.shared.tx))
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
