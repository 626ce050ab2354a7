"""`[trainer] entry = ["python", "linreg.py"]`: `edl run` supervising Python trainer
programs (the environment contract, the report, the final evaluation), fault-free and
with one trainer SIGKILLed mid-pass."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np

from conftest import Etcd, edl_bin

PROGRAM = pathlib.Path(__file__).parent / "programs" / "linreg.py"
TRUE_W, TRUE_B, NOISE = (2.0, -3.0), 1.0, 0.1
N = 20000  # rows: 16000 train, 4000 held out
# Passes: long enough (about 6 s here) that the chaos run's kills, at 2 s and 4 s, land
# while trainers train (4 passes ran in 2.3 s on a fresh machine: the kill at 2 s found
# the job over).
PASSES = 12


def write_data(dir: pathlib.Path) -> pathlib.Path:
    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, size=(N, 2))
    y = x @ np.array(TRUE_W) + TRUE_B + rng.normal(0, NOISE, size=N)
    path = dir / "lin.csv"
    np.savetxt(path, np.column_stack([x, y]), delimiter=",", fmt="%.6f")
    return path


def spec(dir: pathlib.Path, name: str, csv: pathlib.Path) -> pathlib.Path:
    path = dir / f"{name}.toml"
    path.write_text(f"""
name = "{name}"
[data]
train = "data-{name}/lin-train-*.recordio"
test = "data-{name}/lin-test-*.recordio"
[data.prepare]
from = "{csv}"
format = "csv"
test_every = 5
shards = 2
chunk_size = "2KiB"
[trainer]
entry = ["{sys.executable}", "{PROGRAM}"]
[train]
mode = "async"
passes = {PASSES}
batch_size = 20
optimizer = "sgd"
learning_rate = 0.1
[cluster]
masters = 1
pservers = 1
trainers = 2
min_trainers = 1
max_trainers = 2
lease_ttl = "2s"
""")
    return path


def edl_run(dir: pathlib.Path, name: str, *args: str) -> dict:
    report = dir / f"{name}.report.json"
    p = subprocess.run([edl_bin(), "run", *args, "--report", str(report), "--quiet"],
                       cwd=dir, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"edl run {name} failed:\n{p.stdout}\n{p.stderr}"
    return json.loads(report.read_text())


def test_python_entry_programs_train_a_job_and_survive_a_trainer_sigkill(etcd, tmp_path):
    csv = write_data(tmp_path)
    costs = []
    for name, chaos in [("pylin-clean", None), ("pylin-killed", "kill-trainer=2s,until=5s,seed=3")]:
        args = [str(spec(tmp_path, name, csv)), "--etcd", etcd.url]
        if chaos:
            args += ["--chaos", chaos]
        r = edl_run(tmp_path, name, *args)
        assert r["lost_records"] == 0, r
        assert r["passes"] == PASSES, r
        assert r["records_trained"] == PASSES * 16000 + r["recomputed_records"], r
        metric = r["final_metric"]
        assert metric["name"] == "cost" and metric["split"] == "test", r
        costs.append(metric["value"])
        print(f"{name}: cost {metric['value']:.5f}, wall {r['wall_s']}s, "
              f"recomputed {r['recomputed_records']}")
        if chaos:
            assert any(x["role"] == "trainer" and x["fault"] == "sigkill"
                       for x in r["recoveries"]), r
        # Every trainer that ended wrote its report where `edl run` said (EDL_REPORT).
        reports = [json.loads(p.read_text()) for p in pathlib.Path(r["run_dir"]).glob("trainer-*.json")]
        assert reports and all(x["tasks"] > 0 for x in reports), reports
    clean, killed = costs
    # The noise's variance is 0.01: both fit the line, and the kill costs nothing.
    assert clean < 0.02 and killed < 0.02, costs
    assert abs(killed - clean) <= 0.05 * clean + 1e-3, costs


def test_python_entry_programs_train_under_edl_run_secure(tmp_path):
    """`edl run --secure` on its private etcd: the Python trainers (`Trainer.from_env`)
    reach etcd as the job's own user and the master and pservers over mutual TLS, from
    the environment `edl run` gives them; the job trains as well as without."""
    import os
    from conftest import etcd_bin
    csv = write_data(tmp_path)
    name = "pylin-secure"
    report = tmp_path / f"{name}.report.json"
    env = dict(os.environ)
    env["PATH"] = f"{pathlib.Path(etcd_bin()).parent}{os.pathsep}{env.get('PATH', '')}"
    p = subprocess.run([edl_bin(), "run", str(spec(tmp_path, name, csv)), "--secure",
                        "--coord", "etcd", "--report", str(report), "--quiet"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, f"edl run --secure failed:\n{p.stdout}\n{p.stderr}"
    assert "edl run: secure:" in p.stdout, p.stdout
    r = json.loads(report.read_text())
    assert r["lost_records"] == 0, r
    assert r["passes"] == PASSES, r
    assert r["final_metric"]["value"] < 0.02, r
    run_dir = pathlib.Path(r["run_dir"])
    assert (run_dir / "tls" / "ca.pem").is_file()
    assert (run_dir / "tls" / "job.key").stat().st_mode & 0o077 == 0
    # The trainers were Python programs that joined over TLS: their reports say so by
    # existing, with tasks done.
    reports = [json.loads(x.read_text()) for x in run_dir.glob("trainer-*.json")]
    assert reports and all(x["tasks"] > 0 for x in reports), reports
