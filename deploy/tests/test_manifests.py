"""The Kubernetes manifests edl ships and creates, validated against the official
Kubernetes JSON schemas (the `kubernetes-validate` package) and, for TrainingJobs,
against the generated CRD's OpenAPI schema.

- every file in deploy/ (the CRD, the namespace, RBAC, the operator's Deployment);
- the TrainingJob examples in deploy/examples/ against the CRD's schema, including its
  CEL rules (`x-kubernetes-validations`, evaluated with cel-python after the schema's
  defaults are applied, as the API server does), and bad variants refused by them;
- every object `edl operator render` says the operator creates for those examples and
  for the repository's job specs (pods, services), strictly (no unknown fields), and
  the pods against the "restricted" Pod Security Standard;
- the Dockerfile: multi-stage, shipping a non-root image;
- RBAC: every binding names a role and a service account that exist; no wildcards; the
  only rule on secrets is the operator's per-job credentials, bound per namespace.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import Any, Dict, List

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# The oldest Kubernetes the manifests target (k8s-openapi's v1_33 feature).
K8S_VERSION = "1.33"


def edl_bin() -> str:
    path = os.environ.get("EDL_BIN") or str(REPO / "target" / "debug" / "edl")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no edl binary at {path}: build it (cargo build -p edl) or set EDL_BIN")
    return path


def documents(text: str) -> List[Dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def deploy_files() -> List[pathlib.Path]:
    return sorted(p for p in DEPLOY.glob("*.yaml"))


def crd_schema() -> Dict[str, Any]:
    (crd,) = documents((DEPLOY / "crd.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def validate_k8s(obj: Dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{where}: {obj.get('kind')} {e.message} at {list(e.path)}") from e


def test_the_deploy_files_are_valid_kubernetes_objects() -> None:
    files = deploy_files()
    assert DEPLOY / "crd.yaml" in files, files
    for path in files:
        docs = documents(path.read_text())
        assert docs, f"{path} is empty"
        for obj in docs:
            validate_k8s(obj, str(path))


def structural_errors(node: Dict[str, Any], path: str) -> List[str]:
    """Where `node` breaks Kubernetes' structural schema rules (every node typed unless
    it keeps unknown fields or is int-or-string; no $ref; properties and
    additionalProperties not together; allOf/anyOf/oneOf/not only constraining)."""
    errors = []
    free = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
    if "type" not in node and not free:
        errors.append(f"{path}: no type")
    if "$ref" in node or "definitions" in node:
        errors.append(f"{path}: $ref or definitions")
    if "properties" in node and "additionalProperties" in node:
        errors.append(f"{path}: properties with additionalProperties")
    if node.get("additionalProperties") is False:
        errors.append(f"{path}: additionalProperties false")
    for key in ("allOf", "anyOf", "oneOf", "not"):
        for sub in node.get(key, []) if key != "not" else [node.get("not", {})]:
            if any(k in sub for k in ("type", "properties", "items", "default", "description")):
                errors.append(f"{path}.{key}: a branch that declares structure")
    for name, sub in node.get("properties", {}).items():
        errors += structural_errors(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            errors += structural_errors(node[key], f"{path}[{key}]")
    return errors


def test_the_crd_schema_is_structural() -> None:
    schema = crd_schema()
    assert structural_errors(schema, "") == []
    spec = schema["properties"]["spec"]
    rules = [r["rule"] for r in schema.get("x-kubernetes-validations", [])]
    assert any("min_trainers <= self.spec.cluster.trainers" in r for r in rules), rules
    assert "image" in spec["required"]


def test_the_crd_is_the_one_edl_generates() -> None:
    out = subprocess.run([edl_bin(), "operator", "crd"], check=True, capture_output=True, text=True)
    assert out.stdout == (DEPLOY / "crd.yaml").read_text()


def test_the_examples_match_the_crd_schema_and_bad_ones_do_not() -> None:
    schema = crd_schema()
    examples = sorted((DEPLOY / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        for obj in documents(path.read_text()):
            assert obj["kind"] == "TrainingJob", path
            jsonschema.validate(obj, schema)
    (good,) = documents(examples[0].read_text())
    for path, value in [
        (("spec", "cluster", "trainers"), "two"),
        (("spec", "data", "train"), "one-glob-not-a-list"),
        (("spec", "model", "kind"), "resnet"),
        (("spec", "imagePullPolicy"), "Sometimes"),
        (("spec", "train", "mode"), "eventually"),
    ]:
        bad = yaml.safe_load(yaml.safe_dump(good))
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    bad = yaml.safe_load(yaml.safe_dump(good))
    del bad["spec"]["image"]
    with pytest.raises(jsonschema.ValidationError, match="image"):
        jsonschema.validate(bad, schema)


def render(*args: str) -> List[Dict[str, Any]]:
    out = subprocess.run(
        [edl_bin(), "operator", "render", *args], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return documents(out.stdout)


@pytest.mark.parametrize(
    "source",
    [
        ["deploy/examples/mnist-mlp.yaml"],
        ["deploy/examples/mnist-cnn-gpu.yaml"],
        ["examples/fit_a_line/job.toml", "--image", "edl:0.1.0", "--data", "claim:housing"],
    ],
)
def test_every_object_the_operator_creates_is_valid(source: List[str], tmp_path: pathlib.Path) -> None:
    src = REPO / source[0]
    if src.suffix == ".toml":
        # A cluster has no `[data.prepare]`: its data is converted into the volume.
        text = src.read_text()
        start = text.find("[data.prepare]")
        if start >= 0:
            end = text.find("\n[", start + 1)
            text = text[:start] + (text[end + 1 :] if end >= 0 else "")
        src = tmp_path / src.name
        src.write_text(text)
    objs = render(str(src), *source[1:])
    kinds = [o["kind"] for o in objs]
    assert kinds[0] == "TrainingJob"
    assert "Pod" in kinds and "Service" in kinds, kinds
    jsonschema.validate(objs[0], crd_schema())
    for obj in objs[1:]:
        validate_k8s(obj, f"render {source[0]}")
    pods = [o for o in objs if o["kind"] == "Pod"]
    roles = sorted({p["metadata"]["labels"]["edl.dev/role"] for p in pods})
    assert {"master", "pserver", "trainer"} <= set(roles), roles
    # With no checkpoint volume named, each pserver pod mounts a claim the operator makes.
    claims = {o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"}
    for p in pods:
        if p["metadata"]["labels"]["edl.dev/role"] == "pserver":
            mounted = {v["persistentVolumeClaim"]["claimName"] for v in p["spec"]["volumes"] if "persistentVolumeClaim" in v}
            assert mounted & claims, (mounted, claims)
    for p in pods:
        (owner,) = p["metadata"]["ownerReferences"]
        assert owner["kind"] == "TrainingJob" and owner["controller"] is True
    # A job's placement reaches its pods: each role's own over every role's.
    placement = objs[0]["spec"].get("placement", {})
    for p in pods:
        role = p["metadata"]["labels"]["edl.dev/role"]
        want = {**placement.get("all", {}), **placement.get(role, {})}
        for field in ("nodeSelector", "tolerations", "imagePullSecrets"):
            assert p["spec"].get(field) == want.get(field), (role, field, p["spec"].get(field))


def test_a_job_the_operator_would_fail_is_refused_naming_the_field(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.yaml"
    (good,) = documents((DEPLOY / "examples" / "mnist-mlp.yaml").read_text())
    good["spec"]["cluster"]["healthy_after"] = "10ms"
    bad.write_text(yaml.safe_dump(good))
    out = subprocess.run([edl_bin(), "operator", "render", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "spec.cluster.healthy_after" in out.stderr, out.stderr


def with_defaults(obj: Any, schema: Dict[str, Any]) -> Any:
    """`obj` with the schema's defaults filled in where a field is absent, as the API
    server defaults a custom resource before validating it."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        out = dict(obj)
        for name, sub in schema.get("properties", {}).items():
            if name not in out and "default" in sub:
                out[name] = sub["default"]
            if name in out:
                out[name] = with_defaults(out[name], sub)
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [with_defaults(x, schema["items"]) for x in obj]
    return obj


def cel_violations(obj: Any, schema: Dict[str, Any], path: str = "") -> List[str]:
    """The messages of the CEL rules `obj` breaks, at every level of the schema."""
    env = celpy.Environment()
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(obj)}):
            out.append(f"{path or '.'}: {rule.get('message', rule['rule'])}")
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                out += cel_violations(obj[name], sub, f"{path}.{name}")
    return out


def test_the_examples_pass_the_crd_rules_and_bad_ones_are_refused_by_them() -> None:
    schema = crd_schema()
    examples = sorted((DEPLOY / "examples").glob("*.yaml"))
    for path in examples:
        for obj in documents(path.read_text()):
            assert cel_violations(with_defaults(obj, schema), schema) == [], path
    (good,) = documents(examples[0].read_text())

    def variant(change: Any) -> List[str]:
        bad = yaml.safe_load(yaml.safe_dump(good))
        change(bad)
        jsonschema.validate(bad, schema)  # well-formed: only a rule refuses it
        return cel_violations(with_defaults(bad, schema), schema)

    def cluster(**kv: Any) -> Any:
        return lambda o: o["spec"].setdefault("cluster", {}).update(kv)

    assert any("at most spec.cluster.max_trainers" in v for v in variant(cluster(trainers=9, max_trainers=4)))
    assert any("min_trainers" in v for v in variant(cluster(trainers=1, min_trainers=2)))
    assert any("40 characters" in v for v in variant(lambda o: o["metadata"].update(name="j" * 41)))
    both_etcds = variant(lambda o: o["spec"].update(etcd={"endpoints": ["http://e:2379"], "managed": True}))
    assert any(v.startswith(".spec.etcd") for v in both_etcds), both_etcds
    two_sources = variant(
        lambda o: o["spec"].setdefault("volumes", {}).update(data={"claimName": "a", "hostPath": "/d"})
    )
    assert any("exactly one of claimName" in v for v in two_sources), two_sources
    # Within the bounds is fine, and so is 0: the job held without trainers.
    assert variant(cluster(trainers=3, min_trainers=1, max_trainers=4)) == []
    assert variant(cluster(trainers=0, min_trainers=2, max_trainers=4)) == []


RESTRICTED_CAPS = {"NET_BIND_SERVICE"}


def restricted_violations(pod_spec: Dict[str, Any]) -> List[str]:
    """Where a pod spec breaks the "restricted" Pod Security Standard (the checks that
    apply to edl's pods)."""
    out = []
    pod_sc = pod_spec.get("securityContext", {})
    for c in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        name = c.get("name")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            out.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - RESTRICTED_CAPS:
            out.append(f"{name}: capabilities")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile")
    for v in pod_spec.get("volumes", []):
        if "hostPath" in v:
            out.append(f"volume {v.get('name')}: hostPath")
    return out


def test_the_pods_meet_the_restricted_pod_security_standard() -> None:
    (deployment,) = [d for d in documents((DEPLOY / "operator.yaml").read_text()) if d["kind"] == "Deployment"]
    assert restricted_violations(deployment["spec"]["template"]["spec"]) == []
    pods = [o for o in render("deploy/examples/mnist-mlp.yaml") if o["kind"] == "Pod"]
    assert pods
    for p in pods:
        # A hostPath volume is the user's choice (a single-node cluster); the example has none.
        assert restricted_violations(p["spec"]) == [], p["metadata"]["name"]


def test_rbac_bindings_name_roles_and_accounts_that_exist() -> None:
    docs = [d for p in deploy_files() for d in documents(p.read_text())]
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs if d["kind"] in ("Role", "ClusterRole")}
    accounts = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "ServiceAccount"}
    # Those deploy/ creates, and `default`, which every cluster has.
    namespaces = {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"} | {"default"}
    bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert bindings
    for b in bindings:
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ref["kind"], ns, ref["name"]) in roles, b["metadata"]["name"]
        for s in b["subjects"]:
            assert (s["namespace"], s["name"]) in accounts, s
    for d in docs:
        ns = d["metadata"].get("namespace")
        assert ns is None or ns in namespaces, (d["kind"], d["metadata"]["name"])
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert (deployment["metadata"]["namespace"], deployment["spec"]["template"]["spec"]["serviceAccountName"]) in accounts
    secret_roles = set()
    for d in docs:
        for rule in d.get("rules", []):
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], (d["metadata"]["name"], rule)
            if "secrets" in rule["resources"]:
                # Only the jobs' Secrets the operator makes: listed (a job's, by its label,
                # once a round: `get` of any name reads as much) but never watched, updated
                # only to renew a certificate, and bound per namespace, never cluster-wide.
                assert (d["kind"], d["metadata"]["name"]) == ("ClusterRole", "edl-operator-credentials"), d["metadata"]["name"]
                assert rule["resources"] == ["secrets"] and sorted(rule["verbs"]) == ["create", "delete", "get", "list", "update"], rule
                secret_roles.add(d["metadata"]["name"])
    assert secret_roles == {"edl-operator-credentials"}
    for b in bindings:
        if b["roleRef"]["name"] in secret_roles:
            assert b["kind"] == "RoleBinding", b["metadata"]["name"]


def test_the_dockerfile_builds_in_stages_and_ships_a_non_root_image() -> None:
    lines = [ln.strip() for ln in (REPO / "Dockerfile").read_text().splitlines()]
    stages = [i for i, ln in enumerate(lines) if ln.upper().startswith("FROM ")]
    assert len(stages) >= 2, "multi-stage"
    last = lines[stages[-1] :]
    users = [ln.split()[1] for ln in last if ln.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    assert any(ln.startswith("COPY --from=") for ln in last)
    assert any("cargo build --release --locked -p edl" in ln for ln in lines)
    assert any(ln.startswith("ENTRYPOINT") and "edl" in ln for ln in last)
    # The operator's Deployment runs as the image's user.
    (deployment,) = [d for d in documents((DEPLOY / "operator.yaml").read_text()) if d["kind"] == "Deployment"]
    run_as = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert str(run_as) == users[-1].split(":")[0]
    # etcd's restore tool (`edl operator restore-etcd-member`), from the image the
    # operator runs the managed etcd with.
    crd = (REPO / "operator" / "src" / "crd.rs").read_text()
    etcd_image = re.search(r'pub const ETCD_IMAGE: &str = "([^"]+)"', crd).group(1)
    assert f"FROM {etcd_image} AS etcd" in lines, etcd_image
    assert "COPY --from=etcd /usr/local/bin/etcdutl /usr/local/bin/etcdutl" in last
    ignored = (REPO / ".dockerignore").read_text().split()
    assert "target/" in ignored, "the build context leaves out target/"


def test_the_monitoring_dashboard_and_rules_are_well_formed(tmp_path: pathlib.Path) -> None:
    """deploy/monitoring.yaml: a Grafana dashboard whose every panel query, and alert
    rules whose every expression, parse as PromQL (promql-parser); every rule has a
    severity, a summary and a description; the dashboard is regenerated by
    scripts/monitoring.py. (That every metric they name is served: the e2e test
    monitoring::every_metric_the_dashboard_and_the_alerts_name_is_served.)"""
    import json
    import promql_parser

    docs = {d["metadata"]["name"]: d for d in documents((DEPLOY / "monitoring.yaml").read_text())}
    dashboard = json.loads(docs["edl-grafana-dashboard"]["data"]["edl-jobs.json"])
    assert docs["edl-grafana-dashboard"]["metadata"]["labels"]["grafana_dashboard"] == "1"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(dashboard["panels"]) >= 10 and len(exprs) >= 15
    rules = yaml.safe_load(docs["edl-prometheus-rules"]["data"]["edl.rules.yaml"])
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert len(alerts) >= 8
    for r in alerts:
        assert r["labels"]["severity"] in ("warning", "critical"), r
        assert r["annotations"]["summary"] and r["annotations"]["description"], r
        exprs.append(r["expr"])
    for e in exprs:
        # Grafana's variables are not PromQL: the job selector's value stands in.
        promql_parser.parse(e.replace("$job", ".*"))
    # A broken expression is refused: the check can fail.
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (job (edl_master_leader)")
    out = tmp_path / "monitoring.yaml"
    subprocess.run([sys.executable, str(REPO / "scripts" / "monitoring.py"), str(out)], check=True)
    assert out.read_text() == (DEPLOY / "monitoring.yaml").read_text(), (
        "deploy/monitoring.yaml is not what scripts/monitoring.py writes: run it"
    )
