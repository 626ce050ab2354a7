"""The Python package's speed against the Rust client's, measured in the same run on the
same data and the same kind of job (a real etcd, `edl master`, one `edl pserver`):

1. reading a job's records: every task of a pass through `Trainer.tasks()` (each
   record's `bytes` in Python, each task acknowledged), against the Rust `Tasks` loop
   (`trainer/examples/client_rates.rs read`); bytes/s;
2. rounds of a push of one dense parameter of 10M float32 values from NumPy
   (`Params.push` + `flush`: applied on the pserver) and a pull of the new values
   (`Params.pull(out=)`), against the Rust client doing the same (`PsStore::push_owned` +
   `flush`, `pull_dense`); floats/s of each.

Each measurement alternates Rust and Python runs on fresh jobs and reports medians and
the ratio Python / Rust (the target is >= 0.80). Run it with `scripts/bench-python`
(which builds the release binaries and wheel); arguments: `--rounds`, `--floats`, `--mb`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import string
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python" / "tests"))

import edl  # noqa: E402
from conftest import Etcd, Proc, edl_bin  # noqa: E402

RUST = os.environ.get("EDL_CLIENT_RATES") or str(REPO / "target" / "release" / "examples" / "client_rates")


def write_text(path: pathlib.Path, mb: int) -> None:
    """`mb` MB of random text lines of 100-400 bytes (each line one record)."""
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits + " "
    block = "".join(rng.choice(alphabet) for _ in range(1 << 16))
    with open(path, "w") as f:
        written = 0
        while written < mb * 1_000_000:
            n = rng.randint(100, 400)
            start = rng.randint(0, len(block) - n)
            line = block[start:start + n] + "\n"
            f.write(line)
            written += len(line)


class Jobs:
    def __init__(self, dir: pathlib.Path, mb: int) -> None:
        self.dir = dir
        self.etcd = Etcd(dir)
        self.procs = []
        text = dir / "lines.txt"
        write_text(text, mb)
        self.data = dir / "data"
        out = subprocess.run([edl_bin(), "data", "convert", "--format", "text", "--prefix",
                              "lines", "--out", str(self.data), "--shards", "4",
                              "--chunk-size", "256KiB", str(text)],
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        self.n = 0

    def job(self) -> tuple:
        """A fresh job (spec stored, master and pserver started): (name, spec path)."""
        self.n += 1
        name = f"bench-{self.n}"
        spec = self.dir / f"{name}.toml"
        spec.write_text(f'name = "{name}"\n[data]\ntrain = "{self.data}/lines-*.recordio"\n'
                        f'[train]\nmode = "async"\npasses = 1\nbatch_size = 16\n'
                        f'optimizer = "sgd"\nlearning_rate = 1e-9\n'
                        f'[trainer]\nentry = ["python", "rates.py"]\n')
        for role, args in (("master", []), ("pserver", ["--index", "0", "--shards", "1",
                                                "--checkpoint-dir", str(self.dir / name)])):
            self.procs.append(Proc([edl_bin(), role, "--etcd", self.etcd.url, "--job", name,
                                    *args], self.dir / f"{name}-{role}.log"))
        return name, spec

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        self.etcd.proc.stop()


def trainer(jobs: Jobs, name: str, spec: pathlib.Path) -> edl.Trainer:
    return edl.Trainer(name, jobs.etcd.url, spec=str(spec), id="py", etcd_wait=30, spec_wait=30)


def rust(jobs: Jobs, name: str, spec: pathlib.Path, *args: str) -> dict:
    # The spec goes into etcd through a Python trainer that joins and leaves at once.
    trainer(jobs, name, spec).abandon()
    out = subprocess.run([RUST, jobs.etcd.url, name, *args], capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"client_rates {args}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def py_read(jobs: Jobs, name: str, spec: pathlib.Path) -> dict:
    t = trainer(jobs, name, spec)
    t.params({"w": np.zeros(1, dtype=np.float32)})
    records = nbytes = 0
    start = time.perf_counter()
    for task in t.tasks():
        with task:
            for r in task.records():
                nbytes += len(r)
                records += 1
    secs = time.perf_counter() - start
    t.abandon()
    return {"records": records, "bytes": nbytes, "secs": secs}


def py_pushpull(jobs: Jobs, name: str, spec: pathlib.Path, floats: int, rounds: int) -> dict:
    t = trainer(jobs, name, spec)
    p = t.params({"w": np.zeros(floats, dtype=np.float32)})
    out = {"w": np.empty(floats, dtype=np.float32)}
    grads = {"w": np.full(floats, 1e-6, dtype=np.float32)}
    p.pull(out=out)  # warm-up, as the Rust side's
    pull_secs = push_secs = 0.0
    for _ in range(rounds):
        # A push applied on the pservers, then a pull of the new values.
        start = time.perf_counter()
        p.push(grads)
        p.flush()
        mid = time.perf_counter()
        p.pull(out=out)
        end = time.perf_counter()
        push_secs += mid - start
        pull_secs += end - mid
    t.abandon()
    return {"floats": floats, "rounds": rounds, "pull_secs": pull_secs, "push_secs": push_secs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs of each side (medians)")
    ap.add_argument("--floats", type=int, default=10_000_000, help="dense parameter size")
    ap.add_argument("--pushes", type=int, default=10, help="pulls and pushes per run")
    ap.add_argument("--mb", type=int, default=200, help="MB of records to read per run")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        jobs = Jobs(pathlib.Path(d), args.mb)
        try:
            rates = {"read_rust": [], "read_py": [], "pull_rust": [], "pull_py": [],
                     "push_rust": [], "push_py": []}
            for i in range(args.rounds):
                for side in ("rust", "py") if i % 2 == 0 else ("py", "rust"):
                    name, spec = jobs.job()
                    r = rust(jobs, name, spec, "read") if side == "rust" else py_read(jobs, name, spec)
                    rates[f"read_{side}"].append(r["bytes"] / r["secs"])
                    name, spec = jobs.job()
                    if side == "rust":
                        r = rust(jobs, name, spec, "pushpull", str(args.floats), str(args.pushes))
                    else:
                        r = py_pushpull(jobs, name, spec, args.floats, args.pushes)
                    n = r["floats"] * r["rounds"]
                    rates[f"pull_{side}"].append(n / r["pull_secs"])
                    rates[f"push_{side}"].append(n / r["push_secs"])
                print(f"round {i + 1}/{args.rounds}: " + ", ".join(
                    f"{k} {v[-1]:.3g}" for k, v in rates.items()), file=sys.stderr, flush=True)
        finally:
            jobs.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"python/bench/rates.py: {args.rounds} rounds, {args.mb} MB read per run, "
          f"{args.floats:,} floats x {args.pushes} pulls/pushes per run, medians")
    print("| what | Rust client | Python (edl package) | Python / Rust | target |")
    print("|---|---|---|---|---|")
    rows = (("read a job's records", "read", 1e6, "MB/s"),
            ("pull 10M floats into NumPy", "pull", 1e6, "M floats/s"),
            ("push 10M floats from NumPy", "push", 1e6, "M floats/s"))
    for label, key, scale, unit in rows:
        r, p = med[f"{key}_rust"], med[f"{key}_py"]
        print(f"| {label} | {r / scale:,.1f} {unit} | {p / scale:,.1f} {unit} | {p / r:.2f} | >= 0.80 |")


if __name__ == "__main__":
    main()
