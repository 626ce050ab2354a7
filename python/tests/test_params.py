"""The pserver client from NumPy against real pserver processes: the one-trainer
initialisation, dense and sparse push/pull round trips in sync and async mode, and bad
input raising Python exceptions with clear messages."""

from __future__ import annotations

import numpy as np
import pytest

import edl

LR = 0.5  # the test job's SGD learning rate (conftest.Job)


def join(job, id: str, **kw) -> edl.Trainer:
    return edl.Trainer(job.name, job.etcd, spec=str(job.spec), id=id, etcd_wait=20,
                       spec_wait=20, **kw)


def declare(t: edl.Trainer) -> edl.Params:
    return t.params(
        {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(1, dtype=np.float32)},
        sparse={"emb": (1000, 4, 0.0)},
    )


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_push_pull_round_trips(make_job, mode):
    job = make_job(f"params-{mode}", mode=mode, pservers=2)
    a = join(job, "a")
    pa = declare(a)
    assert pa.initialised
    values = pa.pull()
    np.testing.assert_array_equal(values["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(values["b"], [1.0])
    assert pa.names == ["w", "b"] and pa.shape("w") == [2, 3]

    # A second trainer's declaration finds them initialised (its values are not used).
    b = join(job, "b")
    pb = b.params({"w": np.full((2, 3), 9, dtype=np.float32), "b": np.zeros(1, np.float32)},
                  sparse={"emb": (1000, 4, 0.0)})
    assert not pb.initialised
    np.testing.assert_array_equal(pb.pull()["w"], values["w"])
    assert b.close()["initialised"] is False  # out of the sync steps: a's need only a

    g = {"w": np.full((2, 3), 0.25, dtype=np.float32), "b": np.array([-1.0], np.float32)}
    pa.push(g)
    pa.flush()
    out = {"w": np.empty((2, 3), np.float32), "b": np.empty(1, np.float32)}
    got = pa.pull(out=out)
    assert got["w"] is out["w"]
    np.testing.assert_allclose(out["w"], values["w"] - LR * 0.25, rtol=1e-6)
    np.testing.assert_allclose(out["b"], [1.0 + LR], rtol=1e-6)

    ids = np.array([3, 999, 3], dtype=np.int64)
    rows = pa.pull_sparse("emb", ids)
    assert rows.shape == (3, 4) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows, 0)
    pa.push({"w": np.zeros((2, 3), np.float32), "b": np.zeros(1, np.float32)},
            sparse={"emb": (np.array([3], np.uint64), np.ones((1, 4), np.float32))})
    pa.flush()
    pa.pull()
    rows = pa.pull_sparse("emb", [3, 999])
    np.testing.assert_allclose(rows[0], -LR, rtol=1e-6)
    np.testing.assert_array_equal(rows[1], 0)
    report = a.close()
    assert report["steps"] == 2 and report["initialised"] is True, report


def test_bad_input_raises_clear_python_exceptions(make_job, tmp_path):
    job = make_job("bad")
    t = join(job, "t")
    p = declare(t)
    p.pull()
    good = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(1, np.float32)}

    with pytest.raises(TypeError, match=r'gradient of "w" must be a NumPy float32 array, not float64'):
        p.push({**good, "w": np.zeros((2, 3))})
    with pytest.raises(ValueError, match=r'gradient of "w" has shape \[3, 3\]; the parameter has shape \[2, 3\]'):
        p.push({**good, "w": np.zeros((3, 3), np.float32)})
    with pytest.raises(KeyError, match='no gradient for dense parameter "b"'):
        p.push({"w": good["w"]})
    with pytest.raises(KeyError, match='"c", which is not a declared dense parameter'):
        p.push({**good, "c": np.zeros(1, np.float32)})
    with pytest.raises(KeyError, match=r'no sparse table "nope" \(declared: \["emb"\]\)'):
        p.pull_sparse("nope", [1])
    with pytest.raises(ValueError, match='row id -1 of table "emb" is negative'):
        p.pull_sparse("emb", [-1])
    with pytest.raises(ValueError, match="NaN or infinite"):
        p.push({**good, "b": np.array([np.nan], np.float32)})
    with pytest.raises(ValueError, match="must be C-contiguous"):
        p.pull(out={"w": np.zeros((3, 2), np.float32).T, "b": np.zeros(1, np.float32)})

    # A trainer declaring other parameters than the job's.
    other = join(job, "other")
    with pytest.raises(ValueError, match="initialised with another model spec"):
        other.params({"w": np.zeros(5, np.float32)})
    other.close()

    # The refused pushes pushed nothing; a good one still works, a transposed (not
    # C-contiguous) gradient taken in its logical order.
    g = np.arange(6, dtype=np.float32).reshape(3, 2).T
    assert not g.flags["C_CONTIGUOUS"]
    p.push({"w": g, "b": np.zeros(1, np.float32)})
    p.flush()
    expected = np.arange(6, dtype=np.float32).reshape(2, 3) - LR * g
    np.testing.assert_allclose(p.pull()["w"], expected, rtol=1e-6)
    assert t.close()["steps"] == 1

    with pytest.raises(edl.EdlError, match="no-such-job"):
        edl.Trainer("no-such-job", job.etcd, spec_wait=1, etcd_wait=5)
    with pytest.raises(edl.ConnectError, match="cannot reach etcd"):
        edl.Trainer("bad", "http://127.0.0.1:9", etcd_wait=0.5)
    with pytest.raises(ValueError, match="invalid job name"):
        edl.Trainer("../x", job.etcd)
    with pytest.raises(ValueError, match="spec of job"):
        edl.Trainer("another", job.etcd, spec=str(job.spec))
    # Settings are checked as the trainer API checks the environment, before connecting.
    with pytest.raises(ValueError, match='EDL_DEVICE="tpu"'):
        edl.Trainer("j", job.etcd, device="tpu")
    with pytest.raises(ValueError, match="lease_ttl must be a non-negative"):
        edl.Trainer("j", job.etcd, lease_ttl=-1)
    with pytest.raises(ValueError, match="EDL_ETCD_PASSWORD is not set"):
        edl.Trainer("j", job.etcd, etcd_user="u")


def test_from_env_names_the_missing_variable(monkeypatch):
    for var in ("EDL_ETCD", "PADDLE_ETCD_ENDPOINTS", "EDL_JOB", "PADDLE_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="EDL_ETCD is not set"):
        edl.Trainer.from_env(handle_sigterm=False)
    monkeypatch.setenv("EDL_ETCD", "http://127.0.0.1:9")
    monkeypatch.setenv("EDL_JOB", "j")
    monkeypatch.setenv("EDL_LEASE_TTL", "ten")
    with pytest.raises(ValueError, match='EDL_LEASE_TTL="ten"'):
        edl.Trainer.from_env(handle_sigterm=False)


def test_decode_samples_rejects_records_that_are_not_samples():
    with pytest.raises(ValueError, match="not edl samples: record 0"):
        edl.decode_samples([b"\xff\xff\xff"])
    assert edl.decode_samples([])["dense"].shape == (0, 0)


def test_the_device_is_resolved_and_reported(make_job, monkeypatch):
    """``auto`` reads as ``cpu`` without PyTorch, as PyTorch resolves it when the program
    imported torch, and an explicit ``cuda:N`` is kept; the report names the device."""
    import sys
    import types

    job = make_job("device")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    t = join(job, "plain")
    assert t.device == "cpu"
    assert t.close()["device"] == "cpu"

    t = join(job, "explicit", device="cuda:1")
    assert t.device == "cuda:1"
    assert t.close()["device"] == "cuda:1"

    gpu = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", gpu)
    t = join(job, "torch-gpu")
    assert t.device == "cuda:0"
    assert t.close()["device"] == "cuda:0"
    t = join(job, "torch-told-cpu", device="cpu")
    assert t.device == "cpu"
    t.close()

    # From the environment: EDL_DEVICE names a device, which wins over PyTorch's answer;
    # unset (auto), PyTorch's answer stands.
    for var, value in (("EDL_ETCD", job.etcd), ("EDL_JOB", job.name),
                       ("EDL_SPEC_WAIT", "20s"), ("EDL_ETCD_WAIT", "20s")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("EDL_TRAINER_ID", "env-cpu")
    monkeypatch.setenv("EDL_DEVICE", "cpu")
    t = edl.Trainer.from_env(handle_sigterm=False)
    assert t.device == "cpu"
    t.close()
    monkeypatch.setenv("EDL_TRAINER_ID", "env-auto")
    monkeypatch.delenv("EDL_DEVICE")
    t = edl.Trainer.from_env(handle_sigterm=False)
    assert t.device == "cuda:0"
    assert t.close()["device"] == "cuda:0"
