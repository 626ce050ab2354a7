"""edl from Python: train on an edl job's tasks and parameter servers.

A Python program becomes one elastic trainer of a job::

    import edl

    with edl.Trainer.from_env() as trainer:          # the environment `edl run` sets
        params = trainer.params({"w": w0, "b": b0})  # the one-trainer initialisation
        for epoch in trainer.passes():
            for task in epoch:
                with task:                           # acknowledged when the block ends
                    for batch in task.batches(trainer.batch_size):
                        values = params.pull()
                        grads, loss = step(values, batch.samples())
                        params.push(grads, task=task, loss=loss)

The task stream is the master's ``cloud_reader``: a task's records are leased to this
trainer, and the task is acknowledged only after the training loop says it was trained
(``with task:`` ends without an exception, or ``task.done()``), once its pushes are
applied on the pservers. SIGTERM drains the trainer: ``task.batches`` stops, the task is
handed back, ``passes()`` ends, and ``close`` (the ``with`` block's end) leaves the job and
prints the report. ``edl.torch`` adapts this to PyTorch.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _edl
from ._edl import ConnectError, EdlError, LeaseLostError, decode_samples


def _resolve_device(choice: Optional[str]) -> Optional[str]:
    """``auto`` (or no choice) as PyTorch resolves it, when the program imported torch
    (``cuda:0`` when ``torch.cuda.is_available()``, else ``cpu``); otherwise ``choice``
    unchanged, and the native trainer reads ``auto`` as ``cpu``."""
    if choice not in (None, "auto"):
        return choice
    torch = sys.modules.get("torch")
    if torch is None:
        return choice
    try:
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except Exception:  # a broken CUDA setup: the CPU, as ``auto`` does elsewhere
        return "cpu"

__all__ = [
    "Trainer",
    "Pass",
    "Task",
    "Batch",
    "Params",
    "EdlError",
    "ConnectError",
    "LeaseLostError",
    "decode_samples",
]
__version__ = _edl.__version__


class Trainer:
    """One elastic trainer of an edl job (see the module docs).

    ``Trainer(job, etcd, ...)`` joins ``job`` on the etcd at ``etcd`` (client URLs);
    ``Trainer.from_env()`` is the trainer ``edl run`` starts for ``[trainer] entry``.
    ``spec``: a TOML job spec to store in etcd when the job has none. Times are seconds.
    Every other setting is a variable of the environment contract under a keyword name
    (``id`` is ``EDL_TRAINER_ID``, ``etcd_ca`` ``EDL_ETCD_CA``, ``tls_ca``
    ``EDL_TLS_CA``, ...; docs/trainer-api.md) and is checked as ``from_env`` checks it:
    a bad value raises ``ValueError`` naming the variable.
    Joining takes a lease and registers under it, defines the dataset at the master and
    connects to the pservers; an unreachable etcd raises ``ConnectError`` after
    ``etcd_wait``, a job with no spec ``EdlError`` after ``spec_wait``.
    """

    def __init__(
        self,
        job: str,
        etcd: Union[str, Sequence[str]],
        *,
        spec: Optional[str] = None,
        id: Optional[str] = None,
        device: Optional[str] = None,
        token: Optional[str] = None,
        metrics_token: Optional[str] = None,
        lease_ttl: Optional[float] = None,
        etcd_wait: Optional[float] = None,
        spec_wait: Optional[float] = None,
        metrics_addr: Optional[str] = None,
        report: Optional[str] = None,
        evaluate: bool = False,
        handle_sigterm: bool = False,
        etcd_user: Optional[str] = None,
        etcd_password: Optional[str] = None,
        etcd_ca: Optional[str] = None,
        etcd_cert: Optional[str] = None,
        etcd_key: Optional[str] = None,
        etcd_domain: Optional[str] = None,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        tls_domain: Optional[str] = None,
        _native: Optional[_edl.Trainer] = None,
    ) -> None:
        if _native is None:
            endpoints = [etcd] if isinstance(etcd, str) else list(etcd)
            # Each setting is a variable of the environment contract
            # (docs/trainer-api.md), parsed as ``from_env`` parses the environment.
            settings = dict(
                id=id,
                device=device,
                token=token,
                metrics_token=metrics_token,
                lease_ttl=lease_ttl,
                etcd_wait=etcd_wait,
                spec_wait=spec_wait,
                metrics_addr=metrics_addr,
                report=report,
                evaluate=evaluate,
                etcd_user=etcd_user,
                etcd_password=etcd_password,
                etcd_ca=etcd_ca,
                etcd_cert=etcd_cert,
                etcd_key=etcd_key,
                etcd_domain=etcd_domain,
                tls_ca=tls_ca,
                tls_cert=tls_cert,
                tls_key=tls_key,
                tls_domain=tls_domain,
            )
            settings["device"] = _resolve_device(device)
            _native = _edl.Trainer(
                job,
                endpoints,
                spec=spec,
                handle_sigterm=handle_sigterm,
                **{k: v for k, v in settings.items() if v is not None},
            )
        self._t = _native
        self._spec: Optional[Dict[str, Any]] = None
        self._pass = 0

    @classmethod
    def from_env(cls, *, handle_sigterm: bool = True) -> "Trainer":
        """The trainer of an ``entry`` program, configured by the environment ``edl
        run`` sets (``EDL_ETCD``, ``EDL_JOB``, ``EDL_TRAINER_ID``, ...). A missing or
        malformed variable raises ``ValueError`` naming it. SIGTERM drains it."""
        # Stands for EDL_DEVICE only where that is ``auto`` (or unset).
        device = _resolve_device(None)
        return cls("", [], _native=_edl.Trainer.from_env(handle_sigterm=handle_sigterm,
                                                         device=device))

    # -- what the trainer is -------------------------------------------------------

    @property
    def id(self) -> str:
        """This trainer's id, unique in the job."""
        return self._t.id

    @property
    def device(self) -> str:
        """The device to compute on, ``cpu`` or ``cuda:N`` (``torch.device(trainer.device)``).
        ``--device auto`` (the default) is resolved here: by PyTorch when the program
        imported it before making the trainer (a GPU when ``torch.cuda.is_available()``),
        else ``cpu``. The registry and the report name this device."""
        return self._t.device

    @property
    def job(self) -> str:
        """The job's name."""
        return self._t.job

    @property
    def mode(self) -> str:
        """``train``, or ``evaluate``: evaluate the job's parameters once and report
        (``edl run`` asks an entry program for this when the job finished)."""
        return self._t.mode

    @property
    def spec(self) -> Dict[str, Any]:
        """The job's spec (``data``, ``train``, ``cluster``, ...) as a dict."""
        if self._spec is None:
            self._spec = json.loads(self._t.spec_json)
        return self._spec

    @property
    def batch_size(self) -> int:
        """The spec's ``train.batch_size``."""
        return int(self.spec["train"]["batch_size"])

    @property
    def learning_rate(self) -> float:
        """The spec's ``train.learning_rate`` (the pservers' optimizer uses it)."""
        return float(self.spec["train"]["learning_rate"])

    @property
    def seed(self) -> int:
        """The spec's ``train.seed``: the same in every trainer of the job."""
        return int(self.spec["train"]["seed"])

    @property
    def draining(self) -> bool:
        """Whether the trainer is draining (SIGTERM, ``stop()``, or its lease lost)."""
        return self._t.draining

    def stop(self) -> None:
        """Starts a drain, as SIGTERM does."""
        self._t.stop()

    # -- parameters ----------------------------------------------------------------

    def params(
        self,
        dense: Mapping[str, np.ndarray],
        sparse: Optional[Mapping[str, Tuple[int, int, float]]] = None,
    ) -> "Params":
        """Declares the model's parameters and makes sure the job's pservers hold them.

        ``dense``: name -> float32 array of its initial value (the order is the
        parameters' order); ``sparse``: name -> ``(rows, dim, init_bound)``, rows
        starting uniform in ``[-init_bound, init_bound)`` (zeros for 0). Exactly one
        trainer of the job has its values installed (``Params.initialised``); every
        trainer must declare the same names and shapes."""
        return Params(self._t._params(dict(dense), dict(sparse) if sparse else None))

    # -- the task stream -----------------------------------------------------------

    def passes(self) -> Iterator["Pass"]:
        """The job's passes from the current one, each an iterable of tasks; ends when
        every pass is done or the trainer drains."""
        while True:
            p = Pass(self, self._pass)
            yield p
            p._finish()
            if p.ended_by != "pass":
                return

    def tasks(self) -> Iterator["Task"]:
        """Every task of the remaining passes, in one stream."""
        for p in self.passes():
            yield from p

    # -- reports -------------------------------------------------------------------

    def record_evaluation(self, pass_: int, metric: str, value: float, loss: float) -> None:
        """Records an evaluation of pass ``pass_`` in the report (``metric``:
        ``accuracy``, ``cost`` or ``loss``)."""
        self._t.record_evaluation(pass_, metric, value, loss)

    def evaluation_records(self) -> Tuple[str, List[bytes]]:
        """``(split, records)``: the held-out split when the job has one, else the
        training split."""
        return self._t.evaluation_records()

    def report_evaluation(
        self, metric: str, value: float, loss: float, split: str, records: int
    ) -> Dict[str, Any]:
        """Reports the evaluation of evaluate mode (printed, and written where ``edl
        run`` reads it)."""
        return json.loads(self._t.report_evaluation(metric, value, loss, split, records))

    def close(self) -> Optional[Dict[str, Any]]:
        """Leaves the job (out of the sync steps, deregistered, the lease revoked),
        prints the report as one JSON line and writes it to ``EDL_REPORT``; returns it.
        Idempotent. Raises ``LeaseLostError`` if etcd ended the lease."""
        line = self._t.close()
        return json.loads(line) if line else None

    def abandon(self) -> None:
        """Leaves the job after an error, without a report (its task goes back to the
        queue at once)."""
        self._t.abandon()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    def __repr__(self) -> str:
        return f"<edl.Trainer {self.id} of job {self.job} ({self.mode})>"


class Pass:
    """The tasks of one pass, in the order the master leases them."""

    def __init__(self, trainer: Trainer, number: int) -> None:
        self.trainer = trainer
        self.number = number
        #: ``pass`` (the pass ended), ``job`` (every pass done), ``drained`` or ``closed``;
        #: ``None`` while the pass goes on.
        self.ended_by: Optional[str] = None
        self._open: Optional[Task] = None

    def __iter__(self) -> Iterator["Task"]:
        while self.ended_by is None:
            if self._open is not None and self._open.ended is None:
                raise EdlError(
                    f"task {self._open.id} was neither done nor handed back before the next "
                    "one: train each task in `with task:` (or call task.done())"
                )
            item = self.trainer._t._next()
            kind = item[0]
            if kind == "task":
                task = Task(self.trainer, item[1])
                self._open = task
                yield task
            elif kind == "pass":
                self.ended_by = "pass"
                self.trainer._pass = item[2]
            else:
                self.ended_by = kind

    def _finish(self) -> None:
        # The loop over the pass ended. Unless the pass did, that was a drain (the next
        # item says so) or a loop that broke out early, which cannot skip tasks: the
        # master gives every task of a pass to somebody before the next pass starts.
        if self.ended_by is not None:
            return
        if not self.trainer.draining:
            raise EdlError(
                f"the loop left pass {self.number} before it ended: a pass ends when the "
                "master says so (every task trained); to leave early, stop() the trainer"
            )
        for task in self:
            task.hand_back()

    def __repr__(self) -> str:
        return f"<edl.Pass {self.number}>"


class Batch:
    """A slice of a task's records."""

    def __init__(self, task: "Task", start: int, stop: int) -> None:
        self.task = task
        self.start = start
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.start

    def records(self) -> List[bytes]:
        """The records as ``bytes``."""
        return self.task._t.records(self.start, self.stop)

    def samples(self) -> Dict[str, np.ndarray]:
        """The records decoded as edl samples into NumPy arrays (``dense``, ``label``,
        and the sparse columns when there are any; see ``edl.decode_samples``)."""
        return self.task._t.samples(self.start, self.stop)


class Task:
    """A task leased to this trainer: a range of chunks of one RecordIO file.

    Train it in ``with task:``. Leaving the block normally acknowledges it (``done``:
    once its pushes are applied, in the background); leaving it while the trainer drains
    hands it back; an exception fails it (the master retries it up to the job's
    ``max_failures``) and propagates; ``KeyboardInterrupt`` hands it back."""

    def __init__(self, trainer: Trainer, native: _edl.Task) -> None:
        self.trainer = trainer
        self._t = native

    @property
    def id(self) -> str:
        return self._t.id

    @property
    def pass_(self) -> int:
        return self._t.pass_

    @property
    def index(self) -> int:
        return self._t.index

    @property
    def path(self) -> str:
        return self._t.path

    @property
    def ended(self) -> Optional[str]:
        """``None`` while it is trained; then ``done``, ``handed back`` or ``failed``."""
        return self._t.ended

    @property
    def trained(self) -> int:
        """Records counted as trained (``batches`` counts them as it goes)."""
        return self._t.trained

    def __len__(self) -> int:
        return len(self._t)

    def records(self) -> List[bytes]:
        """Every record, as ``bytes``."""
        return self._t.records()

    def samples(self) -> Dict[str, np.ndarray]:
        """Every record decoded as an edl sample (see ``Batch.samples``)."""
        return self._t.samples()

    def batches(self, size: int) -> Iterator[Batch]:
        """The records in batches of ``size`` (the last may be smaller). A batch counts
        as trained when the next one is asked for; the batches stop early when the
        trainer drains."""
        if size <= 0:
            raise ValueError(f"batch size must be positive, not {size}")
        n = len(self)
        for start in range(0, n, size):
            if self.trainer.draining:
                return
            stop = min(start + size, n)
            yield Batch(self, start, stop)
            self._t.mark_trained(stop - start)

    def done(self) -> None:
        """Every record was trained: acknowledge the task (after its pushes apply)."""
        self._t.done()

    def hand_back(self) -> None:
        """Hand the task back untrained (whoever gets it trains it whole)."""
        self._t.hand_back()

    def fail(self, reason: str) -> None:
        """The task's data cannot be trained: fail it for ``reason``."""
        self._t.fail(reason)

    def __enter__(self) -> "Task":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.ended is not None:
            return False
        if exc_type is None:
            if self.trainer.draining and self.trained < len(self):
                self.hand_back()
            else:
                self.done()
        elif issubclass(exc_type, Exception):
            self.fail(f"{exc_type.__name__}: {exc}"[:1000])
        else:
            self.hand_back()
        return False

    def __repr__(self) -> str:
        return repr(self._t)


class Params:
    """A trainer's parameters on the job's pservers, as NumPy float32 arrays (from
    ``Trainer.params``)."""

    def __init__(self, native: _edl.Params) -> None:
        self._p = native

    @property
    def initialised(self) -> bool:
        """Whether this trainer's values initialised the job's parameters."""
        return self._p.initialised

    @property
    def names(self) -> List[str]:
        """The dense parameters' names, in order."""
        return self._p.names

    def shape(self, name: str) -> List[int]:
        """The shape of dense parameter ``name``."""
        return self._p.shape(name)

    def pull(self, out: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
        """The dense parameters by name: written into the float32 arrays of ``out`` when
        given (each C-contiguous, of its parameter's size: no other copy is made), else
        into new arrays."""
        return self._p.pull(out)

    def pull_sparse(self, table: str, ids: Union[np.ndarray, Sequence[int]]) -> np.ndarray:
        """Rows ``ids`` of sparse table ``table``, shape ``(len(ids), dim)``."""
        return self._p.pull_sparse(table, ids)

    def push(
        self,
        grads: Mapping[str, np.ndarray],
        *,
        sparse: Optional[Mapping[str, Tuple[np.ndarray, np.ndarray]]] = None,
        task: Optional[Task] = None,
        loss: Optional[float] = None,
    ) -> None:
        """Pushes a step's gradients: a float32 array for every dense parameter, and
        ``sparse``: table -> ``(ids, values)`` with values of shape ``(len(ids), dim)``.
        ``task``: the task being trained (its updates are kept exactly once however
        often it is retried); ``loss``: for the report. A NaN or infinite gradient is
        refused (``ValueError``) and nothing is pushed."""
        self._p.push(
            dict(grads),
            sparse=dict(sparse) if sparse else None,
            task=task._t if task is not None else None,
            loss=loss,
        )

    def flush(self) -> None:
        """Waits until every push made so far is applied."""
        self._p.flush()
