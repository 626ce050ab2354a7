"""The task stream from Python against a real etcd, master and pserver: every record
exactly once across readers, acknowledgement only after training, a SIGKILLed trainer's
held task trained by another, and a SIGTERM drain handing the task back."""

from __future__ import annotations

import collections
import csv
import json
import os
import signal
import subprocess
import threading
from typing import Dict, List, Tuple

import numpy as np

import edl
from conftest import HOUSING_CSV, edl_bin, wait_until

Row = Tuple[float, ...]


def housing_rows() -> collections.Counter:
    """Every row of the dataset as (features..., label) in float32 precision."""
    rows: collections.Counter = collections.Counter()
    with open(HOUSING_CSV) as f:
        for line in csv.reader(f):
            try:
                values = [float(v) for v in line]
            except ValueError:
                continue  # a header
            rows[tuple(np.asarray(values, dtype=np.float32).tolist())] += 1
    return rows


def sample_rows(s: Dict[str, np.ndarray]) -> List[Row]:
    return [tuple(list(d) + [l]) for d, l in zip(s["dense"].tolist(), s["label"].tolist())]


def trainer(job, id: str, **kw) -> edl.Trainer:
    t = edl.Trainer(job.name, job.etcd, spec=str(job.spec), id=id, etcd_wait=20,
                    spec_wait=20, **kw)
    t.params({"w": np.zeros(1, dtype=np.float32)})
    return t


def read_all(t: edl.Trainer, rows: List[Row], tasks: List[str]) -> None:
    for task in t.tasks():
        with task:
            rows.extend(sample_rows(task.samples()))
            tasks.append(task.id)


def read_with_two(job, id_a: str, id_b: str):
    """Two trainers reading the pass at once, each in a thread: the rows and task ids each
    read (`{"a": (rows, tasks), "b": ...}`), and their final reports."""
    a, b = trainer(job, id_a), trainer(job, id_b)
    got = {"a": ([], []), "b": ([], [])}
    threads = [threading.Thread(target=read_all, args=(t, *got[k]))
               for k, t in (("a", a), ("b", b))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
        assert not th.is_alive(), "a reader did not finish the pass"
    return got, (a.close(), b.close())


def test_two_python_readers_read_every_record_exactly_once(make_job):
    job = make_job("readers")
    got, (ra, rb) = read_with_two(job, "reader-a", "reader-b")
    rows = got["a"][0] + got["b"][0]
    assert collections.Counter(rows) == housing_rows()
    # Both readers took part, and each task was acknowledged by exactly one of them.
    assert got["a"][1] and got["b"][1], (len(got["a"][1]), len(got["b"][1]))
    assert not set(got["a"][1]) & set(got["b"][1])
    assert ra["tasks"] + rb["tasks"] == len(got["a"][1]) + len(got["b"][1])
    assert ra["records"] + rb["records"] == len(rows)


def test_python_readers_read_every_record_exactly_once_from_s3(s3, make_job):
    """The job's data only on the S3 server (put there, the local copies deleted): the
    Python trainers' task stream reads it through the same ranged reads as edl's own
    trainers, every record exactly once."""
    job = make_job("readers-s3", store="s3://edl/housing")
    assert not any(os.path.exists(f) for f in job.files), "the local copies are gone"
    got, _ = read_with_two(job, "s3-reader-a", "s3-reader-b")
    rows = got["a"][0] + got["b"][0]
    assert collections.Counter(rows) == housing_rows()
    tasks = got["a"][1] + got["b"][1]
    assert tasks and len(tasks) == len(set(tasks))
    # The objects it read are on the server's disk.
    assert sorted(p.name for p in (s3.root / "edl" / "housing" / "data").iterdir()) == [
        os.path.basename(f) for f in job.files]


def reader_env(job, tmp_path, id: str, **extra) -> Dict[str, str]:
    env = {"EDL_ETCD": job.etcd, "EDL_JOB": job.name, "EDL_TRAINER_ID": id,
           "EDL_LEASE_TTL": "2s", "READER_OUT": str(tmp_path / f"{id}.out")}
    env.update(extra)
    return env


def lines(path) -> List[dict]:
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def tasks_done(job) -> int:
    """Tasks of the current pass the master has acknowledged (`edl status --json`)."""
    out = subprocess.run([edl_bin(), "status", "--json", "--etcd", job.etcd, job.name],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return -1
    jobs = json.loads(out.stdout)["jobs"]
    tasks = (jobs[0].get("tasks") if jobs else None) or {}
    return int(tasks.get("done", -1))


def start_holding(job, tmp_path, id: str):
    """A reader program that trains two tasks, then holds a third; returns it, its
    output file, and the held task's id once it holds it."""
    env = reader_env(job, tmp_path, id, TRAIN_TASKS="2")
    # The spec is in etcd once a trainer of this test stored it.
    p = job.python("programs/reader.py", env=env)
    out = env["READER_OUT"]
    wait_until(lambda: any("holding" in x for x in lines(out)) or not p.alive(), 60,
               f"{id} to hold a task")
    assert p.alive(), p.text()
    held = [x for x in lines(out) if "holding" in x][0]["holding"]
    return p, out, held


def finish_with(job, id: str) -> Tuple[List[Row], List[str]]:
    t = trainer(job, id)
    rows: List[Row] = []
    tasks: List[str] = []
    read_all(t, rows, tasks)
    t.close()
    return rows, tasks


def test_a_task_is_acknowledged_only_after_training_and_a_killed_trainers_task_goes_on(
        make_job, tmp_path):
    job = make_job("killed")
    # Stores the spec; it takes no task (it joins, declares and leaves).
    trainer(job, "first").close()
    p, out, held = start_holding(job, tmp_path, "holder")
    done = [x for x in lines(out) if "done" in x]
    assert len(done) == 2
    # The two trained tasks are acknowledged in the background: kill once the master
    # has them (a task trained but not yet acknowledged is trained again, not lost).
    wait_until(lambda: tasks_done(job) >= 2, 30, "the master to have the two tasks done")
    p.signal(signal.SIGKILL)
    p.p.wait(timeout=30)
    rows, tasks = finish_with(job, "finisher")
    # The held task was never acknowledged: the finisher trained it; the two acknowledged
    # ones it did not see again.
    assert held in tasks, (held, tasks)
    assert not {x["done"] for x in done} & set(tasks)
    killed_rows = [tuple(r + [l]) for x in done for r, l in zip(x["rows"], x["labels"])]
    assert collections.Counter(killed_rows + rows) == housing_rows()


def test_sigterm_drains_handing_the_held_task_back(make_job, tmp_path):
    job = make_job("drained")
    trainer(job, "first").close()
    p, out, held = start_holding(job, tmp_path, "drainer")
    p.signal(signal.SIGTERM)
    assert p.p.wait(timeout=60) == 0, p.text()
    report = [x for x in lines(out) if "report" in x][0]["report"]
    assert report["drained"] is True, report
    assert report["tasks"] == 2, report
    rows, tasks = finish_with(job, "after-drain")
    assert held in tasks, (held, tasks)
    done = [x for x in lines(out) if "done" in x]
    drained_rows = [tuple(r + [l]) for x in done for r, l in zip(x["rows"], x["labels"])]
    assert collections.Counter(drained_rows + rows) == housing_rows()
