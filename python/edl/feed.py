"""One trainer's tasks fed to worker processes: the reader stays in the trainer's process,
the workers decode.

A trainer holds the master's leases and says how each task went, so exactly one process
may read a job's tasks for it. Decoding records (images, text) is what wants several
processes. ``Feed`` splits the two, the way ``edl.torch.ElasticLoader`` uses it with a
PyTorch ``DataLoader``:

- a thread of the trainer's process takes tasks from the trainer and puts each task's
  records on a ``multiprocessing`` queue, keeping at most ``workers + read_ahead`` tasks
  in flight (leased, not yet acknowledged);
- each worker process runs ``worker_items``: it takes whole tasks from the queue, cuts
  each into batches of ``batch_size`` records, decodes each batch with the user's
  ``decode`` and yields it tagged with its task and place; a worker trains no task twice
  and a task goes to one worker, so no record is read twice and none is skipped;
- the training loop iterates ``FeedPass``: batches with their ``Task`` (for
  ``Params.push(task=...)``). A batch counts as trained when the loop asks for the next
  one; a task is acknowledged when its last batch was trained, failed when ``decode``
  raised on it, and handed back (with its trained records) when the trainer drains.

The order of the batches of one task is kept (a worker yields them in order, and a
``DataLoader`` keeps each worker's order), which is what "its last batch was trained"
relies on. ``FeedPass`` ends with the pass (or the drain); the workers end when the
feeding thread puts one end marker per worker on the queue.
"""

from __future__ import annotations

import multiprocessing
import threading
from queue import Empty
import traceback
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from . import Task, Trainer, decode_samples

#: A message of the queue: ``("task", key, records)`` or ``("end",)``.
#: An item from a worker: ``("batch", key, start, stop, last, payload)``,
#: ``("failed", key, start, reason)`` or ``("idle",)``.
Item = Tuple[Any, ...]

#: How often a worker with no task says so (seconds).
IDLE_EVERY = 0.02
IDLE: Item = ("idle",)

Decode = Callable[[List[bytes]], Any]


def worker_items(
    queue: Any, decode: Optional[Decode], batch_size: int, idle_every: float = IDLE_EVERY
) -> Iterator[Item]:
    """What one worker yields: the batches of the tasks it takes from ``queue`` until
    an end marker, each ``("batch", key, start, stop, last, decode(records))``.

    A task with no records yields one empty batch (``start == stop``, payload ``None``)
    so that it is acknowledged; ``decode`` raising on a batch yields ``("failed", key,
    start, reason)`` and skips the rest of that task. While no task comes it yields
    ``("idle",)`` every ``idle_every`` seconds: a ``DataLoader`` that returns its workers'
    items in turn must not wait on a worker with nothing to do while another one holds
    the batches whose acknowledgement the master waits for to lease more tasks."""
    if batch_size <= 0:
        raise ValueError(f"batch size must be positive, not {batch_size}")
    decode = decode or decode_samples
    while True:
        try:
            msg = queue.get(timeout=idle_every)
        except Empty:
            yield IDLE
            continue
        if msg[0] != "task":
            return
        _, key, records = msg
        n = len(records)
        if n == 0:
            yield ("batch", key, 0, 0, True, None)
            continue
        for start in range(0, n, batch_size):
            stop = min(start + batch_size, n)
            try:
                payload = decode(records[start:stop])
            except Exception as e:  # the task's data: fail the task, not the loader
                reason = f"decode: {type(e).__name__}: {e}"
                tb = traceback.format_exc(limit=3)
                yield ("failed", key, start, f"{reason}\n{tb}"[:1000])
                break
            yield ("batch", key, start, stop, stop == n, payload)


class Feed:
    """The tasks of ``trainer`` fed to ``workers`` worker processes through ``queue``
    (see the module docs). ``read_ahead``: tasks leased beyond one per worker."""

    def __init__(
        self,
        trainer: Trainer,
        *,
        workers: int,
        read_ahead: int = 1,
        context: Optional[Any] = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, not {workers}")
        if read_ahead < 0:
            raise ValueError(f"read_ahead must be at least 0, not {read_ahead}")
        self.trainer = trainer
        self.workers = workers
        self.limit = workers + read_ahead
        ctx = context or multiprocessing.get_context()
        #: The queue the workers take tasks from.
        self.queue = ctx.Queue()
        self._cond = threading.Condition()
        self._in_flight: Dict[int, Task] = {}
        self._next_key = 0
        self._pass = 0
        self._finished = False

    def passes(self, source: Callable[[], Iterator[Item]]) -> Iterator["FeedPass"]:
        """The job's passes from the current one; ``source()`` starts the workers of a
        pass and returns the iterator of their items (a ``DataLoader``'s)."""
        while not self._finished:
            p = FeedPass(self, self._pass, source)
            yield p
            p._finish()
            if p.ended_by != "pass":
                self._finished = True

    # -- the feeding thread ----------------------------------------------------------

    def _feed(self, p: "FeedPass") -> None:
        try:
            while True:
                with self._cond:
                    while len(self._in_flight) >= self.limit and not p._stopping:
                        self._cond.wait(0.5)
                    if p._stopping:
                        p.ended_by = p.ended_by or "stopped"
                        return
                item = self.trainer._t._next()
                kind = item[0]
                if kind != "task":
                    if kind == "pass":
                        self._pass = item[2]
                    p.ended_by = kind
                    return
                task = Task(self.trainer, item[1])
                with self._cond:
                    key = self._next_key
                    self._next_key += 1
                    self._in_flight[key] = task
                self.queue.put(("task", key, task.records()))
        except BaseException as e:  # said by the training loop, in its thread
            p.error = e
            p.ended_by = p.ended_by or "error"
        finally:
            for _ in range(self.workers):
                self.queue.put(("end",))

    # -- the training loop's side ----------------------------------------------------

    def _task(self, key: int) -> Task:
        with self._cond:
            task = self._in_flight.get(key)
        if task is None:
            raise RuntimeError(f"a worker yielded a batch of task {key}, which is not in flight")
        return task

    def _ended(self, key: int) -> None:
        with self._cond:
            self._in_flight.pop(key, None)
            self._cond.notify_all()

    def _hand_back_all(self) -> None:
        with self._cond:
            tasks = list(self._in_flight.items())
        for key, task in tasks:
            if task.ended is None:
                task.hand_back()
            self._ended(key)


class FeedPass:
    """The batches of one pass as ``(payload, task)``: ``payload`` is what ``decode``
    made of a batch of the task's records. See the module docs for when tasks are
    acknowledged."""

    def __init__(self, feed: Feed, number: int, source: Callable[[], Iterator[Item]]) -> None:
        self.feed = feed
        self.number = number
        self._source = source
        #: ``pass``, ``job``, ``drained``, ``closed`` or ``error`` once the pass is over.
        self.ended_by: Optional[str] = None
        self.error: Optional[BaseException] = None
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._iterated = False

    def __iter__(self) -> Iterator[Tuple[Any, Task]]:
        if self._iterated:
            raise RuntimeError(f"pass {self.number} was iterated already")
        self._iterated = True
        feed = self.feed
        items = iter(self._source())  # the workers start before the feeding thread
        self._thread = threading.Thread(
            target=feed._feed, args=(self,), name=f"edl-feed-{self.number}", daemon=True
        )
        self._thread.start()
        trained: Optional[Tuple[int, int, int, bool]] = None  # key, start, stop, last
        completed = False
        try:
            while True:
                # The loop asked for the next batch: the one before is trained. Said
                # before waiting for the next item, which may come only after the pass
                # ended, which needs this acknowledgement.
                if trained is not None:
                    self._trained(*trained)
                    trained = None
                if feed.trainer.draining:
                    break
                try:
                    item = next(items)
                except StopIteration:
                    completed = True
                    break
                if item[0] == "idle":
                    continue
                if item[0] == "failed":
                    _, key, _start, reason = item
                    feed._task(key).fail(reason)
                    feed._ended(key)
                    continue
                _, key, start, stop, last, payload = item
                task = feed._task(key)
                if start == stop:
                    if last:
                        task.done()
                        feed._ended(key)
                    continue
                yield payload, task
                trained = (key, start, stop, last)
        finally:
            self._stop(completed)

    def _trained(self, key: int, start: int, stop: int, last: bool) -> None:
        task = self.feed._task(key)
        task._t.mark_trained(stop - start)
        if last:
            task.done()
            self.feed._ended(key)

    def _stop(self, completed: bool) -> None:
        """The loop over the pass ended: it completed (the workers ended: the pass or
        the job did), the trainer drains, or the loop left early."""
        self._stopping = True
        with self.feed._cond:
            self.feed._cond.notify_all()
        if not completed and not self.feed.trainer.draining:
            warnings.warn(
                f"the loop left pass {self.number} before it ended: draining the trainer "
                "(its tasks in flight are handed back)",
                RuntimeWarning,
                stacklevel=3,
            )
            self.feed.trainer.stop()
        if self._thread is not None:
            self._thread.join()
        self.feed._hand_back_all()
        if self.error is not None:
            raise self.error

    def _finish(self) -> None:
        if not self._iterated:
            raise RuntimeError(f"pass {self.number} was not iterated")
        if self.ended_by is None:
            self.ended_by = "drained" if self.feed.trainer.draining else "stopped"

    def __repr__(self) -> str:
        return f"<edl.feed.FeedPass {self.number}>"


__all__ = ["Feed", "FeedPass", "worker_items"]


def _items_of(workers: Iterable[Iterator[Item]]) -> Iterator[Item]:
    """Round-robin over workers' item iterators, as a ``DataLoader`` does (for tests and
    single-process use)."""
    its = [iter(w) for w in workers]
    while its:
        for it in list(its):
            try:
                yield next(it)
            except StopIteration:
                its.remove(it)
