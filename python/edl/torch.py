"""PyTorch on edl: an elastic ``DataLoader`` over a job's tasks, and a module's parameters
on the job's pservers.

::

    import edl, edl.torch

    with edl.Trainer.from_env() as trainer:
        torch.manual_seed(trainer.seed)
        model = Net()
        params = edl.torch.ModuleParams(trainer, model)   # the one-trainer initialisation
        loader = edl.torch.ElasticLoader(trainer, decode, num_workers=2)
        for epoch in loader.passes():
            for (x, y), task in epoch:
                params.pull()                                # into the module's tensors
                model.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                params.push(task=task, loss=loss.item())     # the .grads; pservers step

``ElasticLoader`` runs a ``torch.utils.data.DataLoader`` over ``TaskDataset``, an
``IterableDataset`` whose workers take whole tasks from the trainer's one reader
(``edl.feed``): each task goes to one worker, is cut into batches of ``batch_size``
records and decoded there by ``decode(records) -> batch``; so with any number of workers
no record is read twice and none is skipped, and a task is acknowledged only after its
last batch was trained (the loop asked for the next one). A batch ``decode`` raises on
fails its task (the master retries it elsewhere); SIGTERM ends the pass and hands the
tasks in flight back. The workers need no access to etcd or the pservers.

``decode`` runs in the workers: with the default ``fork`` start method any function
works; with ``spawn`` or ``forkserver`` (``multiprocessing_context=``) it must be
importable (a module-level function). It gets a list of ``bytes`` records; the default
decodes edl samples (``edl.decode_samples``) into ``(dense, label)`` tensors.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

try:
    import torch
    from torch.utils.data import DataLoader, IterableDataset
except ImportError as e:  # said once, with the fix
    raise ImportError(
        "edl.torch needs PyTorch, which is not installed here: pip install torch "
        "(examples/pytorch_mnist/setup makes an environment with it)"
    ) from e

from . import Params, Task, Trainer, decode_samples
from .feed import Feed, FeedPass, worker_items

__all__ = ["ElasticLoader", "TaskDataset", "ModuleParams", "decode_dense"]


def decode_dense(records: List[bytes]) -> Tuple[torch.Tensor, torch.Tensor]:
    """edl samples as ``(dense float32 (n, d), label)`` tensors: the default decode."""
    s = decode_samples(records)
    return torch.from_numpy(s["dense"]), torch.from_numpy(s["label"])


class TaskDataset(IterableDataset):
    """The batches of the tasks a ``Feed`` puts on ``queue``, as one ``DataLoader``
    worker decodes them (use it with ``batch_size=None``: it yields whole batches, each
    tagged with its task; ``ElasticLoader`` reads the tags)."""

    def __init__(self, queue: Any, decode: Callable[[List[bytes]], Any], batch_size: int) -> None:
        super().__init__()
        self.queue = queue
        self.decode = decode
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[Tuple[Any, ...]]:
        return worker_items(self.queue, self.decode, self.batch_size)


class ElasticLoader:
    """The tasks of ``trainer`` as PyTorch batches, decoded by ``num_workers``
    ``DataLoader`` workers (see the module docs). ``batch_size``: records per batch (the
    spec's ``train.batch_size`` when not given); ``read_ahead``: tasks leased beyond one
    per worker; other keyword arguments go to the ``DataLoader`` (``pin_memory``,
    ``multiprocessing_context``, ``persistent_workers``, ...)."""

    def __init__(
        self,
        trainer: Trainer,
        decode: Optional[Callable[[List[bytes]], Any]] = None,
        *,
        batch_size: Optional[int] = None,
        num_workers: int = 0,
        read_ahead: int = 1,
        **loader_kwargs: Any,
    ) -> None:
        for k in ("batch_size", "shuffle", "sampler", "batch_sampler", "collate_fn"):
            if k in loader_kwargs:
                raise ValueError(f"ElasticLoader makes the batches itself: {k}= is not allowed")
        self.trainer = trainer
        self.batch_size = batch_size or trainer.batch_size
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, not {self.batch_size}")
        ctx = loader_kwargs.get("multiprocessing_context")
        if isinstance(ctx, str):
            import multiprocessing

            ctx = multiprocessing.get_context(ctx)
        self.feed = Feed(trainer, workers=max(num_workers, 1), read_ahead=read_ahead,
                         context=ctx)
        self.dataset = TaskDataset(self.feed.queue, decode or decode_dense, self.batch_size)
        if num_workers > 0 and "in_order" in inspect.signature(DataLoader).parameters:
            # Batches as they come (each worker's still in order): no waiting on a
            # worker that has no task while another holds batches (torch >= 2.6).
            loader_kwargs.setdefault("in_order", False)
        self.loader = DataLoader(self.dataset, batch_size=None, num_workers=num_workers,
                                 **loader_kwargs)

    def passes(self) -> Iterator[FeedPass]:
        """The job's passes from the current one; each yields ``(batch, task)``. Ends
        when every pass is done or the trainer drains."""
        return self.feed.passes(lambda: iter(self.loader))


class ModuleParams:
    """The parameters of ``module`` on the job's pservers: one dense parameter per
    ``named_parameters()`` entry, under its name (every trainer must build the same
    module). Declaring them is the one-trainer initialisation: one trainer's initial
    values are installed, and ``pull`` gives every trainer the job's values.

    CPU float32 parameters are pulled straight into the tensors' memory (no copy beyond
    the one from the network). Parameters on a GPU go through float32 host buffers that
    are pinned (page-locked) once: ``pull`` lands in them and uploads them with
    non-blocking copies, ``push`` downloads every ``.grad`` into them with non-blocking
    copies and waits once for the lot; nothing is allocated per step. Other parameters
    (another dtype, another device) go through a float32 staging array."""

    def __init__(
        self,
        trainer: Trainer,
        module: torch.nn.Module,
        *,
        sparse: Optional[Dict[str, Tuple[int, int, float]]] = None,
    ) -> None:
        self.module = module
        self._named = [(n, p) for n, p in module.named_parameters()]
        if not self._named:
            raise ValueError("the module has no parameters")
        init = {n: p.detach().to("cpu", torch.float32).contiguous().numpy().copy()
                for n, p in self._named}
        #: The underlying ``edl.Params``.
        self.params: Params = trainer.params(init, sparse)
        self._out: Dict[str, np.ndarray] = {}
        #: (parameter, float32 host buffer, whether the buffer is pinned)
        self._staged: List[Tuple[torch.nn.Parameter, torch.Tensor, bool]] = []
        #: Pinned host buffers of the gradients of parameters on a GPU.
        self._grad_bufs: Dict[str, torch.Tensor] = {}
        for n, p in self._named:
            if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
                self._out[n] = p.data.numpy().reshape(-1)
                continue
            pinned = p.device.type == "cuda"
            buf = torch.empty(p.numel(), dtype=torch.float32, pin_memory=pinned)
            self._out[n] = buf.numpy()
            self._staged.append((p, buf, pinned))
            if pinned:
                self._grad_bufs[n] = torch.empty(p.numel(), dtype=torch.float32,
                                                 pin_memory=True)
        self._zeros: Dict[str, np.ndarray] = {}
        #: One event per GPU, recorded after the last pull's uploads were queued.
        self._uploads: List[Any] = []
        self.pull()

    @property
    def initialised(self) -> bool:
        """Whether this trainer's values initialised the job's parameters."""
        return self.params.initialised

    @torch.no_grad()
    def pull(self) -> None:
        """Sets the module's parameters to the job's current values."""
        # The pinned buffers are written below only once the last pull's uploads from
        # them are done (a push in between has already waited for them).
        for event in self._uploads:
            event.synchronize()
        self._uploads = []
        self.params.pull(out=self._out)
        devices = set()
        for p, buf, pinned in self._staged:
            # From a pinned buffer the copy is queued on the GPU's stream, ordered before
            # the steps that read the parameter.
            p.data.copy_(buf.view_as(p), non_blocking=pinned)
            if pinned:
                devices.add(p.device)
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._uploads.append(event)

    @torch.no_grad()
    def push(
        self,
        *,
        task: Optional[Task] = None,
        loss: Optional[float] = None,
        sparse: Optional[Dict[str, Tuple[np.ndarray, np.ndarray]]] = None,
    ) -> None:
        """Pushes the parameters' ``.grad``s (zeros for a parameter without one) to the
        pservers, whose optimizer applies them; ``task``: the task being trained (its
        updates are kept exactly once however often it is retried)."""
        grads: Dict[str, np.ndarray] = {}
        downloads = set()
        for n, p in self._named:
            g = p.grad
            buf = self._grad_bufs.get(n)
            if g is None:
                zeros = self._zeros.get(n)
                if zeros is None:
                    zeros = self._zeros[n] = np.zeros(p.numel(), dtype=np.float32)
                grads[n] = zeros
            elif buf is not None and g.device.type == "cuda":
                buf.copy_(g.detach().reshape(-1), non_blocking=True)
                downloads.add(g.device)
                grads[n] = buf.numpy()
            else:
                grads[n] = g.detach().to("cpu", torch.float32).reshape(-1).numpy()
        for device in downloads:  # one wait for every queued download
            torch.cuda.current_stream(device).synchronize()
        self.params.push(grads, task=task, loss=loss, sparse=sparse)

    def flush(self) -> None:
        """Waits until every push made so far is applied."""
        self.params.flush()
