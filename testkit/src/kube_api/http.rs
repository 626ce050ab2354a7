//! The fake API server's HTTP side: paths to resources, verbs to store operations,
//! subresources, watches as streams of JSON lines, errors as Status objects.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};

use super::store::{
    at_path, fields_match, labels_match, merge_patch, not_found, secret_rules, set_path,
};
use super::{ApiError, ResourceType, ScalePaths, Shared, pod_security};

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

/// The discovery documents a client such as `kubectl` reads before anything else:
/// `/api`, `/apis`, and the resource list of each group version served.
fn discovery(types: &[ResourceType], path: &str) -> Option<Value> {
    let resources = |group: &str, version: &str| -> Value {
        let mut list = Vec::new();
        for t in types
            .iter()
            .filter(|t| t.group == group && t.version == version)
        {
            list.push(json!({
                "name": t.plural,
                "singularName": t.kind.to_lowercase(),
                "namespaced": t.namespaced,
                "kind": t.kind,
                "verbs": ["create", "delete", "deletecollection", "get", "list", "patch",
                          "update", "watch"],
            }));
            if t.status {
                list.push(json!({"name": format!("{}/status", t.plural), "singularName": "",
                    "namespaced": t.namespaced, "kind": t.kind, "verbs": ["get", "patch", "update"]}));
            }
            if t.scale.is_some() {
                list.push(
                    json!({"name": format!("{}/scale", t.plural), "singularName": "",
                    "namespaced": t.namespaced, "group": "autoscaling", "version": "v1",
                    "kind": "Scale", "verbs": ["get", "patch", "update"]}),
                );
            }
            if t.group.is_empty() && t.plural == "pods" {
                list.push(
                    json!({"name": "pods/log", "singularName": "", "namespaced": true,
                    "kind": "Pod", "verbs": ["get"]}),
                );
            }
        }
        let gv = if group.is_empty() {
            version.to_owned()
        } else {
            format!("{group}/{version}")
        };
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
               "resources": list})
    };
    let group_of = |g: &str| -> Option<Value> {
        let versions: Vec<Value> = types
            .iter()
            .filter(|t| t.group == g)
            .map(|t| t.version)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
            .collect();
        let preferred = versions.first()?.clone();
        Some(json!({"name": g, "versions": versions, "preferredVersion": preferred}))
    };
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        ["api"] => Some(json!({"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}]})),
        ["api", v] => Some(resources("", v)),
        ["apis"] => {
            let groups: std::collections::BTreeSet<&str> = types
                .iter()
                .map(|t| t.group)
                .filter(|g| !g.is_empty())
                .collect();
            let groups: Vec<Value> = groups.into_iter().filter_map(group_of).collect();
            Some(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}))
        }
        ["apis", g] => group_of(g).map(|mut v| {
            v["kind"] = json!("APIGroup");
            v["apiVersion"] = json!("v1");
            v
        }),
        ["apis", g, v] if types.iter().any(|t| t.group == *g && t.version == *v) => {
            Some(resources(g, v))
        }
        _ => None,
    }
}

pub(super) async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let types = shared.lock().types.clone();
    if req.method() == Method::GET
        && let Some(doc) = discovery(&types, req.uri().path())
    {
        return json_response(200, &doc);
    }
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
    {
        let t = &types[target.type_index];
        let watch = q.get("watch").is_some_and(|w| w == "true" || w == "1");
        let verb = match (&method, target.name.is_some()) {
            (&Method::GET, _) if watch => "watch",
            (&Method::GET, true) => "get",
            (&Method::GET, false) => "list",
            (&Method::POST, _) => "create",
            (&Method::PUT, _) => "update",
            (&Method::PATCH, _) => "patch",
            (&Method::DELETE, true) => "delete",
            (&Method::DELETE, false) => "deletecollection",
            _ => "unknown",
        };
        let access = super::Access {
            verb,
            group: t.group,
            resource: t.plural,
            subresource: target.sub.clone(),
            name: target.name.clone(),
            user: req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::to_owned),
            namespace: target.namespace.clone(),
        };
        shared
            .accesses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(access.clone());
        let enforced = access.user.as_ref().filter(|u| {
            shared
                .rbac_users
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(*u)
        });
        if let Some(user) = enforced
            && !super::rbac::authorized(&shared.lock(), user, &access)
        {
            let message = super::rbac::forbidden_message(user, &access);
            return error_response(&ApiError::new(403, "Forbidden", message));
        }
    }
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
    if target.sub.as_deref() == Some("log") && types[target.type_index].plural == "pods" {
        return pod_log(&shared, &target, &q);
    }
    let watch = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    if method == Method::GET && watch {
        return watch_response(&shared, &target, &q);
    }
    if content_type.starts_with("application/vnd.kubernetes.protobuf") && !body.is_empty() {
        return error_response(&ApiError::new(
            415,
            "UnsupportedMediaType",
            format!("the fake API server reads JSON only, not {content_type}"),
        ));
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
                if ty.plural == "pods" && ty.group.is_empty() {
                    admit_pod(&store, &ns, &obj)?;
                }
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
        (Method::POST, Some("eviction")) if ty.plural == "pods" => {
            let Some(pod) = current else {
                return Err(not_found(&ty, &name));
            };
            evict(&mut store, &key, &pod, body, tx)
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
            if *method == Method::PATCH && content_type.starts_with("application/apply-patch") {
                check_rv(&current, &input, &ty, &name)?;
                let subresource = match sub {
                    None => None,
                    Some("status") if ty.status => Some("status"),
                    Some(_) => return Err(not_found(&ty, &name)),
                };
                let manager = q
                    .get("fieldManager")
                    .map(String::as_str)
                    .unwrap_or_default();
                let force = q.get("force").is_some_and(|f| f == "true");
                let new = super::apply::apply(
                    &current,
                    &input,
                    manager,
                    force,
                    subresource,
                    &super::store::now_rfc3339(),
                )?;
                return Ok((200, store.write(&key, new, tx)));
            }
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
            if ty.is_secret() {
                secret_rules(&mut result, Some(&current))?;
            }
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

/// `GET pods/NAME/log`: the pod's log file, whole or its last `tailLines` lines; with
/// `follow`, what is appended after, until the pod is removed or has ended.
fn pod_log(shared: &Arc<Shared>, target: &Target, q: &BTreeMap<String, String>) -> Response {
    let name = target.name.clone().unwrap_or_default();
    let key = (target.type_index, target.namespace.clone(), name.clone());
    let pod = {
        let store = shared.lock();
        match store.objects.get(&key) {
            Some(p) => p.clone(),
            None => return error_response(&not_found(&store.types[key.0], &name)),
        }
    };
    let dir = shared
        .pod_logs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&target.namespace)
        .cloned();
    let path = dir.map(|d| d.join(format!("{name}.log")));
    let Some(text) = path.as_ref().and_then(|p| std::fs::read(p).ok()) else {
        let container = pod["spec"]["containers"][0]["name"].as_str().unwrap_or("");
        return error_response(&ApiError::new(
            400,
            "BadRequest",
            format!("container \"{container}\" in pod \"{name}\" is waiting to start"),
        ));
    };
    let start = match q.get("tailLines").and_then(|n| n.parse::<usize>().ok()) {
        Some(n) => {
            // The offset after the (n+1)-th newline from the end (a last line without
            // a newline counts as a line).
            let body = text.strip_suffix(b"\n").unwrap_or(&text);
            let mut seen = 0;
            let mut at = 0;
            for (i, b) in body.iter().enumerate().rev() {
                if *b == b'\n' {
                    seen += 1;
                    if seen == n {
                        at = i + 1;
                        break;
                    }
                }
            }
            if n == 0 { text.len() } else { at }
        }
        None => 0,
    };
    let first = Bytes::from(text[start..].to_vec());
    let follow = q.get("follow").is_some_and(|f| f == "true" || f == "1");
    let text_response = |body: Body| {
        Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/plain")
            .body(body)
            .unwrap_or_else(|_| Response::new(Body::empty()))
    };
    if !follow {
        return text_response(Body::from(first));
    }
    let (shared, path) = (shared.clone(), path.unwrap_or_default());
    let uid = pod["metadata"]["uid"].clone();
    let offset = text.len() as u64;
    let tail = futures::stream::unfold(offset, move |offset| {
        let (shared, path, key, uid) = (shared.clone(), path.clone(), key.clone(), uid.clone());
        async move {
            loop {
                let grown = std::fs::metadata(&path).map_or(0, |m| m.len());
                if grown > offset {
                    use std::io::{Read, Seek, SeekFrom};
                    let mut buf = Vec::new();
                    let read = std::fs::File::open(&path).and_then(|mut f| {
                        f.seek(SeekFrom::Start(offset))?;
                        f.read_to_end(&mut buf)
                    });
                    if let Ok(n) = read {
                        return Some((Bytes::from(buf), offset + n as u64));
                    }
                }
                let over = shared.lock().objects.get(&key).is_none_or(|p| {
                    p["metadata"]["uid"] != uid
                        || matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
                });
                if over || shared.stop.is_cancelled() {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let stream = futures::StreamExt::map(
        futures::StreamExt::chain(futures::stream::iter([first]), tail),
        Ok::<Bytes, std::io::Error>,
    );
    text_response(Body::from_stream(stream))
}

/// Whether `pod` counts for a disruption budget: Running, not being deleted, and Ready
/// when it reports readiness at all.
/// Pod Security admission of a pod created in `ns`: refused (403) when it fails the
/// level the namespace's labels enforce ([`pod_security`]).
fn admit_pod(store: &super::store::Store, ns: &str, pod: &Value) -> Result<(), ApiError> {
    let namespaces = store.types.iter().position(|t| t.plural == "namespaces");
    let labels = namespaces
        .and_then(|t| store.objects.get(&(t, String::new(), ns.to_owned())))
        .map(|n| n["metadata"]["labels"].clone())
        .unwrap_or(Value::Null);
    let Some(level) = pod_security::enforced(&labels) else {
        return Ok(());
    };
    let failed = pod_security::violations(level, pod);
    if failed.is_empty() {
        return Ok(());
    }
    let name = pod["metadata"]["name"]
        .as_str()
        .or(pod["metadata"]["generateName"].as_str())
        .unwrap_or("");
    Err(ApiError::new(
        403,
        "Forbidden",
        format!(
            "pods {name:?} is forbidden: violates PodSecurity \"{level}:latest\": {}",
            failed.join(", ")
        ),
    ))
}

fn healthy(pod: &Value) -> bool {
    let ready = pod["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .is_none_or(|c| c["status"] == "True");
    pod["status"]["phase"] == "Running" && pod["metadata"]["deletionTimestamp"].is_null() && ready
}

/// `POST pods/NAME/eviction` of `pod` (at `key`): refused (429) when a budget that
/// selects it would have fewer healthy pods than its `minAvailable`; else the pod is
/// deleted with the eviction's `deleteOptions`.
fn evict(
    store: &mut super::store::Store,
    key: &super::store::Key,
    pod: &Value,
    body: &Bytes,
    tx: &tokio::sync::broadcast::Sender<super::store::WatchEvent>,
) -> Result<(u16, Value), ApiError> {
    let (pods_type, ns, name) = key.clone();
    let budgets_type = store
        .types
        .iter()
        .position(|t| t.plural == "poddisruptionbudgets");
    let in_ns = |type_index: usize| -> Vec<Value> {
        store
            .objects
            .iter()
            .filter(|((t, o_ns, _), _)| *t == type_index && *o_ns == ns)
            .map(|(_, o)| o.clone())
            .collect()
    };
    let pods = in_ns(pods_type);
    for budget in budgets_type.map(in_ns).unwrap_or_default() {
        let selector = &budget["spec"]["selector"];
        if selector.is_null()
            || !super::network_policy::selector_matches(selector, &pod["metadata"]["labels"])
        {
            continue;
        }
        let budget_name = budget["metadata"]["name"].as_str().unwrap_or_default();
        let Some(min) = budget["spec"]["minAvailable"].as_u64() else {
            return Err(ApiError::new(
                422,
                "Invalid",
                format!(
                    "PodDisruptionBudget {budget_name}: the fake API server honours an \
                     integer minAvailable only"
                ),
            ));
        };
        let up = pods
            .iter()
            .filter(|p| {
                healthy(p)
                    && super::network_policy::selector_matches(selector, &p["metadata"]["labels"])
            })
            .count() as u64;
        let after = if healthy(pod) {
            up.saturating_sub(1)
        } else {
            up
        };
        if after < min {
            return Err(ApiError::new(
                429,
                "TooManyRequests",
                format!(
                    "Cannot evict pod as it would violate the pod's disruption budget. \
                     The disruption budget {budget_name} needs {min} healthy pods and has {up}"
                ),
            ));
        }
    }
    let eviction: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let grace = eviction["deleteOptions"]["gracePeriodSeconds"].as_i64();
    store.delete(&(pods_type, ns, name), grace, tx)?;
    Ok((
        201,
        json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success",
               "code": 201}),
    ))
}
