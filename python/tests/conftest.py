"""Real parts for the Python package's tests: an etcd on free loopback ports in a temp
dir, `edl` master and pserver processes of a job (killed by pid at the end), and an S3
server (`edl-s3-server`) for data and checkpoints in an object store.

The `edl` binary is `$EDL_BIN`, else the workspace's `target/debug/edl` (scripts/test
builds it before running these tests); etcd is `$EDL_ETCD_BIN`, else `etcd` on PATH.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Callable, List, Optional

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
HOUSING_CSV = REPO / "examples" / "data" / "boston_housing.csv"


def edl_bin() -> str:
    path = os.environ.get("EDL_BIN") or str(REPO / "target" / "debug" / "edl")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no edl binary at {path}: build it (cargo build -p edl) or set EDL_BIN")
    return path


def etcd_bin() -> str:
    path = os.environ.get("EDL_ETCD_BIN") or shutil.which("etcd")
    if not path:
        pytest.fail("etcd is not installed: scripts/setup installs it (etcd-server)")
    return path


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls `cond` until it holds; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Proc:
    """A child process of the test, with its log; stopped by pid."""

    def __init__(self, args: List[str], log: pathlib.Path, env: Optional[dict] = None) -> None:
        self.log = log
        self._out = open(log, "ab")
        self.p = subprocess.Popen(
            args, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.p.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGKILL)
        self.p.wait(timeout=30)
        self._out.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class Etcd:
    def __init__(self, dir: pathlib.Path) -> None:
        last = ""
        for attempt in range(5):
            client, peer = free_ports(2)
            self.url = f"http://127.0.0.1:{client}"
            data = dir / f"etcd-{attempt}"
            self.proc = Proc(
                [
                    etcd_bin(),
                    "--data-dir", str(data),
                    "--listen-client-urls", self.url,
                    "--advertise-client-urls", self.url,
                    "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                ],
                dir / f"etcd-{attempt}.log",
            )
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.proc.alive():
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                        if b'"health":"true"' in r.read():
                            return
                except OSError:
                    pass
                time.sleep(0.05)
            last = self.proc.text()[-2000:]
            self.proc.stop()
        raise RuntimeError(f"etcd did not start (a port taken?):\n{last}")


class Job:
    """A job on the test's etcd: its data, its spec file, a master and pservers."""

    def __init__(self, etcd: Etcd, dir: pathlib.Path, name: str, mode: str = "async",
                 pservers: int = 1, passes: int = 1, extra: str = "",
                 store: Optional[str] = None) -> None:
        """`store`: an object URL (`s3://bucket/prefix`) the data is put under and the
        pservers checkpoint to, with the credentials of this process's environment."""
        self.etcd = etcd.url
        self.name = name
        self.dir = dir
        data = dir / "data"
        data.mkdir(exist_ok=True)
        out = subprocess.run(
            [edl_bin(), "data", "convert", "--format", "csv", "--prefix", "housing",
             "--out", str(data), "--shards", "2", "--chunk-size", "1KiB", str(HOUSING_CSV)],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        self.files = sorted(str(p) for p in data.glob("housing-*.recordio"))
        train, ckpt = f"{data}/housing-*.recordio", str(dir / "ckpt")
        if store:
            out = subprocess.run([edl_bin(), "data", "put", str(data), f"{store}/data/"],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            shutil.rmtree(data)
            train, ckpt = f"{store}/data/housing-*.recordio", f"{store}/ckpt"
        self.spec = dir / f"{name}.toml"
        self.spec.write_text(
            f'name = "{name}"\n[data]\ntrain = "{train}"\n'
            f'[train]\nmode = "{mode}"\npasses = {passes}\nbatch_size = 16\n'
            f'optimizer = "sgd"\nlearning_rate = 0.5\n'
            f'[trainer]\nentry = ["python", "train.py"]\n{extra}'
        )
        self.procs: List[Proc] = []
        self.procs.append(self.role("master", []))
        for i in range(pservers):
            self.procs.append(self.role("pserver", ["--index", str(i), "--shards", str(pservers),
                                                    "--checkpoint-dir", ckpt]))

    def role(self, role: str, args: List[str]) -> Proc:
        n = len(list(self.dir.glob(f"{role}-*.log")))
        return Proc([edl_bin(), role, "--etcd", self.etcd, "--job", self.name, *args],
                    self.dir / f"{role}-{n}.log")

    def python(self, script: str, *args: str, env: Optional[dict] = None) -> Proc:
        """Runs a Python trainer program of the tests with this interpreter."""
        e = dict(os.environ)
        e.update(env or {})
        n = len(list(self.dir.glob("py-*.log")))
        return Proc([sys.executable, str(pathlib.Path(__file__).parent / script), *args],
                    self.dir / f"py-{n}.log", env=e)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


class S3Server:
    """edl-s3-server (the workspace's, beside the edl binary) on a free loopback port with
    its own data directory; `env` reaches it."""

    def __init__(self, dir: pathlib.Path) -> None:
        binary = pathlib.Path(edl_bin()).with_name("edl-s3-server")
        root = dir / "s3"
        (root / "edl").mkdir(parents=True)
        self.p = subprocess.Popen(
            [str(binary), "--root", str(root), "--access-key", "py", "--secret-key", "py-secret"],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )
        line = self.p.stdout.readline().strip()
        assert line.startswith("listening on "), line
        self.env = {
            "AWS_ACCESS_KEY_ID": "py", "AWS_SECRET_ACCESS_KEY": "py-secret",
            "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": "http://" + line.split()[-1],
            "AWS_ALLOW_HTTP": "true",
        }
        self.root = root

    def stop(self) -> None:
        self.p.kill()
        self.p.wait(timeout=30)


@pytest.fixture
def s3(tmp_path, monkeypatch):
    """An S3 server with bucket `edl`; this process and the processes it starts reach it."""
    server = S3Server(tmp_path)
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    yield server
    server.stop()


@pytest.fixture
def etcd(tmp_path):
    e = Etcd(tmp_path)
    yield e
    e.proc.stop()


@pytest.fixture
def make_job(etcd, tmp_path):
    jobs: List[Job] = []

    def make(name: str = "pyjob", **kw) -> Job:
        d = tmp_path / name
        d.mkdir()
        j = Job(etcd, d, name, **kw)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.stop()
