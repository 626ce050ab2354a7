//! The fake API server (`edl_testkit::kube_api`) against the real client (kube-rs):
//! the semantics the operator's end-to-end test relies on.

use edl_operator::TrainingJob;
use edl_operator::crd::EtcdSpec;
use edl_testkit::kube_api::{FakeApi, ResourceType, merge_patch};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::{Api, Client, Config};
use serde_json::json;

const NS: &str = "ml";

async fn fake(window: usize) -> (FakeApi, Client) {
    let api = FakeApi::start_with_window(
        vec![ResourceType::pods(), ResourceType::trainingjobs()],
        window,
    )
    .await
    .expect("start the fake API server");
    let config = Config::new(api.url().parse().expect("url"));
    let client = Client::try_from(config).expect("client");
    (api, client)
}

fn job(name: &str) -> TrainingJob {
    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{name}\"\n[data]\ntrain = [\"/d/a-*.recordio\"]\n[model]\nkind = \"mnist_mlp\"\n"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(NS));
    tj.spec.etcd = EtcdSpec {
        endpoints: vec!["http://127.0.0.1:1".into()],
        ..EtcdSpec::default()
    };
    tj
}

fn pod(name: &str, owner: Option<&TrainingJob>) -> Pod {
    let mut p: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"edl.dev/job": "a", "edl.dev/role": "trainer"}},
        "spec": {"containers": [{"name": "c", "image": "edl:test"}]},
    }))
    .expect("pod");
    if let Some(tj) = owner {
        p.metadata.owner_references = Some(vec![edl_operator::objects::owner(tj)]);
    }
    p
}

fn code(e: kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        other => panic!("not an API error: {other}"),
    }
}

#[tokio::test]
async fn create_get_list_conflicts_and_selectors() {
    let (_api, client) = fake(100).await;
    let pods: Api<Pod> = Api::namespaced(client, NS);
    let a = pods
        .create(&PostParams::default(), &pod("a", None))
        .await
        .expect("create");
    assert_eq!(a.metadata.namespace.as_deref(), Some(NS));
    assert!(a.metadata.uid.is_some() && a.metadata.resource_version.is_some());
    let again = pods.create(&PostParams::default(), &pod("a", None)).await;
    assert_eq!(code(again.expect_err("a second a")), 409);
    let mut other = pod("b", None);
    other.metadata.labels = Some([("edl.dev/job".to_owned(), "b".to_owned())].into());
    pods.create(&PostParams::default(), &other)
        .await
        .expect("create b");
    let listed = pods
        .list(&ListParams::default().labels("edl.dev/job=a"))
        .await
        .expect("list");
    assert_eq!(listed.items.len(), 1);
    let all = pods.list(&ListParams::default()).await.expect("list");
    assert_eq!(all.items.len(), 2);
    assert_eq!(code(pods.get("nope").await.expect_err("absent")), 404);

    // Optimistic concurrency: a write from a stale read is refused.
    let stale = pods.get("a").await.expect("get");
    let mut fresh = stale.clone();
    fresh
        .metadata
        .labels
        .get_or_insert_default()
        .insert("x".into(), "1".into());
    pods.replace("a", &PostParams::default(), &fresh)
        .await
        .expect("replace");
    let mut late = stale;
    late.metadata
        .labels
        .get_or_insert_default()
        .insert("x".into(), "2".into());
    let refused = pods.replace("a", &PostParams::default(), &late).await;
    assert_eq!(code(refused.expect_err("stale")), 409);
    let patch = json!({"metadata": {"resourceVersion": "1", "labels": {"y": "1"}}});
    let refused = pods
        .patch("a", &PatchParams::default(), &Patch::Merge(&patch))
        .await;
    assert_eq!(code(refused.expect_err("stale patch")), 409);
    // Server-side apply: the label set and owned by its manager; without a manager,
    // refused.
    let apply = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"z": "1"}}});
    let applied = pods
        .patch("a", &PatchParams::apply("edl"), &Patch::Apply(&apply))
        .await
        .expect("apply");
    assert_eq!(
        applied
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("z"))
            .map(String::as_str),
        Some("1")
    );
    let owned = applied.metadata.managed_fields.unwrap_or_default();
    assert_eq!(owned.len(), 1, "{owned:?}");
    assert_eq!(owned[0].manager.as_deref(), Some("edl"));
    assert_eq!(owned[0].operation.as_deref(), Some("Apply"));
    let fields = serde_json::to_value(&owned[0].fields_v1).expect("json");
    assert!(
        fields["f:metadata"]["f:labels"]["f:z"].is_object(),
        "{fields}"
    );
    let refused = pods
        .patch("a", &PatchParams::default(), &Patch::Apply(&apply))
        .await;
    assert_eq!(code(refused.expect_err("no manager")), 400);
}

#[tokio::test]
async fn watches_resume_from_a_resource_version_and_an_expired_one_is_gone() {
    let (_api, client) = fake(3).await;
    let pods: Api<Pod> = Api::namespaced(client, NS);
    let first = pods
        .create(&PostParams::default(), &pod("p0", None))
        .await
        .expect("create");
    let from = first.metadata.resource_version.expect("rv");
    for i in 1..3 {
        pods.create(&PostParams::default(), &pod(&format!("p{i}"), None))
            .await
            .expect("create");
    }
    let events: Vec<_> = pods
        .watch(&WatchParams::default().timeout(1), &from)
        .await
        .expect("watch")
        .try_collect()
        .await
        .expect("events");
    let added: Vec<String> = events
        .iter()
        .filter_map(|e| match e {
            WatchEvent::Added(p) => p.metadata.name.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(added, ["p1", "p2"], "the events after {from}");

    // Three more writes push p0's version out of the window of 3.
    for i in 3..6 {
        pods.create(&PostParams::default(), &pod(&format!("p{i}"), None))
            .await
            .expect("create");
    }
    let mut stream = pods
        .watch(&WatchParams::default().timeout(1), &from)
        .await
        .expect("watch")
        .boxed();
    match stream.next().await {
        Some(Ok(WatchEvent::Error(e))) => assert_eq!(e.code, 410, "{e:?}"),
        other => panic!("expected 410 Gone, got {other:?}"),
    }
}

#[tokio::test]
async fn status_and_scale_subresources() {
    let (api, client) = fake(100).await;
    let jobs: Api<TrainingJob> = Api::namespaced(client, NS);
    let mut tj = job("a");
    tj.status = Some(Default::default());
    let created = jobs
        .create(&PostParams::default(), &tj)
        .await
        .expect("create");
    assert_eq!(created.status, None, "a create drops the status");
    assert_eq!(created.metadata.generation, Some(1));

    let status = json!({"status": {
        "phase": "Running",
        "trainers": {"running": 2, "desired": 2},
        "selector": "edl.dev/job=a",
    }});
    let with_status = jobs
        .patch_status("a", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("status");
    assert_eq!(
        with_status.metadata.generation,
        Some(1),
        "status is not the spec"
    );
    // The main resource ignores status changes.
    let main = json!({"status": {"phase": "Failed"}, "metadata": {"labels": {"k": "v"}}});
    let after = jobs
        .patch("a", &PatchParams::default(), &Patch::Merge(&main))
        .await
        .expect("patch");
    assert_eq!(
        after.status.expect("status").phase,
        edl_operator::crd::Phase::Running
    );

    let scale = jobs.get_scale("a").await.expect("scale");
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(2));
    let s = scale.status.expect("scale status");
    assert_eq!(
        (s.replicas, s.selector.as_deref()),
        (2, Some("edl.dev/job=a"))
    );
    let to4 = json!({"spec": {"replicas": 4}});
    jobs.patch_scale("a", &PatchParams::default(), &Patch::Merge(&to4))
        .await
        .expect("scale to 4");
    let now = jobs.get("a").await.expect("get");
    assert_eq!(now.spec.cluster.trainers, 4);
    assert_eq!(now.metadata.generation, Some(2), "a scale changes the spec");
    let raw = api.get("trainingjobs", NS, "a").expect("stored");
    assert_eq!(raw["spec"]["cluster"]["trainers"], 4);
}

#[tokio::test]
async fn finalizers_hold_a_deletion_and_owners_take_their_dependents() {
    let (api, client) = fake(100).await;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client, NS);
    let mut tj = job("a");
    tj.metadata.finalizers = Some(vec!["edl.dev/etcd-cleanup".into()]);
    let tj = jobs
        .create(&PostParams::default(), &tj)
        .await
        .expect("create");
    pods.create(&PostParams::default(), &pod("a-trainer-0", Some(&tj)))
        .await
        .expect("pod");
    pods.create(&PostParams::default(), &pod("free", None))
        .await
        .expect("pod");

    jobs.delete("a", &DeleteParams::default())
        .await
        .expect("delete");
    let held = jobs.get("a").await.expect("still there");
    assert!(held.metadata.deletion_timestamp.is_some());
    assert!(
        api.get("pods", NS, "a-trainer-0").is_some(),
        "dependents stay while it does"
    );

    let drop_finalizer = json!({"metadata": {"finalizers": null}});
    jobs.patch("a", &PatchParams::default(), &Patch::Merge(&drop_finalizer))
        .await
        .expect("patch");
    assert_eq!(code(jobs.get("a").await.expect_err("gone")), 404);
    // Its pod is deleted (gracefully: a pod waits for its kubelet), the other is not.
    let owned = api.get("pods", NS, "a-trainer-0").expect("terminating pod");
    assert!(!owned["metadata"]["deletionTimestamp"].is_null(), "{owned}");
    assert_eq!(owned["metadata"]["deletionGracePeriodSeconds"], 30);
    let free = api.get("pods", NS, "free").expect("free");
    assert!(free["metadata"]["deletionTimestamp"].is_null());
    // The kubelet's final delete (grace 0) removes it.
    api.delete("pods", NS, "a-trainer-0", Some(0))
        .expect("remove");
    assert!(api.get("pods", NS, "a-trainer-0").is_none());
}

#[tokio::test]
async fn secrets_are_created_read_listed_and_deleted_as_the_api_server_does() {
    use edl_testkit::kube_api::{base64_decode, base64_encode};
    use k8s_openapi::api::core::v1::Secret;

    let api = FakeApi::start(vec![ResourceType::secrets()])
        .await
        .expect("start the fake API server");
    let client = Client::try_from(Config::new(api.url().parse().expect("url"))).expect("client");
    let secrets: Api<Secret> = Api::namespaced(client, NS);
    let secret = |name: &str, body: serde_json::Value| -> Secret {
        let mut v = json!({"metadata": {"name": name, "labels": {"edl.dev/job": name}}});
        merge_patch(&mut v, &body);
        serde_json::from_value(v).expect("a Secret")
    };
    // stringData is merged into data (base64), never stored or returned; type defaults.
    let a = secrets
        .create(
            &PostParams::default(),
            &secret(
                "a",
                json!({"data": {"k": base64_encode(b"from data")},
                       "stringData": {"EDL_JOB_TOKEN": "t0k", "k": "from stringData"}}),
            ),
        )
        .await
        .expect("create");
    let data = a.data.clone().expect("data");
    assert_eq!(data["EDL_JOB_TOKEN"].0, b"t0k");
    assert_eq!(data["k"].0, b"from stringData", "stringData wins");
    assert!(a.string_data.is_none());
    assert_eq!(a.type_.as_deref(), Some("Opaque"));
    let raw = api.get("secrets", NS, "a").expect("stored");
    assert!(raw.get("stringData").is_none(), "{raw}");
    assert_eq!(
        raw["data"]["EDL_JOB_TOKEN"]
            .as_str()
            .and_then(base64_decode)
            .as_deref(),
        Some(&b"t0k"[..])
    );
    assert_eq!(secrets.get("a").await.expect("get").data, Some(data));
    assert_eq!(
        code(
            secrets
                .create(&PostParams::default(), &secret("a", json!({})))
                .await
                .expect_err("a second a")
        ),
        409
    );
    // data must be base64; type cannot change; an immutable Secret's data cannot.
    let patch = |v: serde_json::Value| Patch::Merge(v);
    let bad = secrets
        .patch(
            "a",
            &PatchParams::default(),
            &patch(json!({"data": {"x": "not base64!"}})),
        )
        .await;
    assert_eq!(code(bad.expect_err("not base64")), 422);
    let bad = secrets
        .patch(
            "a",
            &PatchParams::default(),
            &patch(json!({"type": "kubernetes.io/tls"})),
        )
        .await;
    assert_eq!(code(bad.expect_err("type changed")), 422);
    let updated = secrets
        .patch(
            "a",
            &PatchParams::default(),
            &patch(json!({"stringData": {"EDL_JOB_TOKEN": "new"}})),
        )
        .await
        .expect("patch stringData");
    assert_eq!(updated.data.expect("data")["EDL_JOB_TOKEN"].0, b"new");
    secrets
        .create(
            &PostParams::default(),
            &secret("b", json!({"immutable": true, "stringData": {"k": "v"}})),
        )
        .await
        .expect("create b");
    let bad = secrets
        .patch(
            "b",
            &PatchParams::default(),
            &patch(json!({"stringData": {"k": "w"}})),
        )
        .await;
    assert_eq!(code(bad.expect_err("immutable")), 422);
    // list (with a selector), delete.
    let listed = secrets
        .list(&ListParams::default().labels("edl.dev/job=b"))
        .await
        .expect("list");
    assert_eq!(listed.items.len(), 1);
    assert_eq!(
        secrets
            .list(&ListParams::default())
            .await
            .expect("list")
            .items
            .len(),
        2
    );
    secrets
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete");
    assert_eq!(code(secrets.get("a").await.expect_err("gone")), 404);
    assert_eq!(
        code(
            secrets
                .delete("a", &DeleteParams::default())
                .await
                .expect_err("gone")
        ),
        404
    );
}

#[tokio::test]
async fn pod_logs_are_served_tailed_and_followed_until_the_pod_ends() {
    let (api, client) = fake(100).await;
    let dir = tempfile::tempdir().expect("tempdir");
    api.serve_pod_logs(NS, dir.path().to_owned());
    let pods: Api<Pod> = Api::namespaced(client, NS);
    pods.create(&PostParams::default(), &pod("p", None))
        .await
        .expect("create");
    // Not started: no log yet, as a waiting container.
    let err = pods
        .logs("p", &kube::api::LogParams::default())
        .await
        .expect_err("no log yet");
    assert_eq!(code(err), 400);
    let log = dir.path().join("p.log");
    std::fs::write(&log, "one\ntwo\nthree\n").expect("write");
    let all = pods
        .logs("p", &kube::api::LogParams::default())
        .await
        .expect("logs");
    assert_eq!(all, "one\ntwo\nthree\n");
    let tail = pods
        .logs(
            "p",
            &kube::api::LogParams {
                tail_lines: Some(2),
                ..kube::api::LogParams::default()
            },
        )
        .await
        .expect("tail");
    assert_eq!(tail, "two\nthree\n");
    // Following: what is appended comes, and the stream ends when the pod has ended.
    let mut lines = futures::AsyncBufReadExt::lines(
        pods.log_stream(
            "p",
            &kube::api::LogParams {
                follow: true,
                ..kube::api::LogParams::default()
            },
        )
        .await
        .expect("follow"),
    );
    for want in ["one", "two", "three"] {
        assert_eq!(
            lines.next().await.transpose().expect("read"),
            Some(want.to_owned())
        );
    }
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&log)
        .expect("open");
    std::io::Write::write_all(&mut f, b"four\n").expect("append");
    assert_eq!(
        lines.next().await.transpose().expect("read"),
        Some("four".to_owned())
    );
    api.patch_status("pods", NS, "p", &json!({"phase": "Succeeded"}))
        .expect("end the pod");
    let end = tokio::time::timeout(std::time::Duration::from_secs(10), lines.next())
        .await
        .expect("the stream ends once the pod has ended");
    assert!(end.is_none(), "{end:?}");
}
