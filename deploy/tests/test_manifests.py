"""The Kubernetes manifests edl ships and creates, validated against the official
Kubernetes JSON schemas (the `kubernetes-validate` package) and, for TrainingJobs,
against the generated CRD's OpenAPI schema.

- every file in deploy/ (the CRD, and later RBAC, the operator's Deployment);
- the TrainingJob examples in deploy/examples/ against the CRD's schema;
- every object `edl operator render` says the operator creates for those examples and
  for the repository's job specs (pods, services), strictly (no unknown fields).

CEL rules (`x-kubernetes-validations`) are not evaluated here: jsonschema ignores them.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
from typing import Any, Dict, List

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
    for p in pods:
        (owner,) = p["metadata"]["ownerReferences"]
        assert owner["kind"] == "TrainingJob" and owner["controller"] is True


def test_a_job_the_operator_would_fail_is_refused_naming_the_field(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.yaml"
    (good,) = documents((DEPLOY / "examples" / "mnist-mlp.yaml").read_text())
    good["spec"]["cluster"]["healthy_after"] = "10ms"
    bad.write_text(yaml.safe_dump(good))
    out = subprocess.run([edl_bin(), "operator", "render", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "spec.cluster.healthy_after" in out.stderr, out.stderr
