"""A trainer program for the tests: reads its tasks through `edl.feed.Feed` with
`FEED_WORKERS` worker processes (forked, as a DataLoader's are), which decode the records;
writes each batch it trains (task id, rows, the worker's pid) and, at the end, how each
task ended, how often a worker said it was idle, and the report. `STOP_AFTER=n`: drains itself after n batches."""

import json
import multiprocessing
import os

import numpy as np

import edl
from edl.feed import Feed, worker_items

CTX = multiprocessing.get_context("fork")


def decode(records):
    s = edl.decode_samples(records)
    return os.getpid(), s["dense"].tolist(), s["label"].tolist()


def run_worker(tasks, out, batch_size):
    for item in worker_items(tasks, decode, batch_size):
        out.put(item)
    out.put(None)


IDLE = [0]


def source(feed, batch_size):
    """Starts the workers of a pass; returns their items strictly in turn, as a
    DataLoader with `in_order=True` does (so an idle worker's turn must come back)."""

    def start():
        outs = [CTX.Queue() for _ in range(feed.workers)]
        procs = [CTX.Process(target=run_worker, args=(feed.queue, out, batch_size))
                 for out in outs]
        for p in procs:
            p.start()
        try:
            live = list(outs)
            while live:
                for out in list(live):
                    item = out.get(timeout=60)
                    if item is None:
                        live.remove(out)
                        continue
                    if item[0] == "idle":
                        IDLE[0] += 1
                    yield item
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()

    return start


def main() -> None:
    out = open(os.environ["READER_OUT"], "a")
    stop_after = int(os.environ.get("STOP_AFTER", "0"))
    with edl.Trainer.from_env() as trainer:
        trainer.params({"w": np.zeros(1, dtype=np.float32)})
        feed = Feed(trainer, workers=int(os.environ.get("FEED_WORKERS", "2")), context=CTX)
        seen = {}
        batches = 0
        for epoch in feed.passes(source(feed, 7)):
            for (pid, rows, labels), task in epoch:
                key = f"{task.pass_}/{task.id}"  # a task's id is the same in every pass
                seen[key] = task
                out.write(json.dumps({"task": key, "worker": pid, "rows": rows,
                                      "labels": labels}) + "\n")
                out.flush()
                batches += 1
                if stop_after and batches == stop_after:
                    trainer.stop()
        ends = {k: t.ended for k, t in seen.items()}
        out.write(json.dumps({"ends": ends, "idle": IDLE[0]}) + "\n")
        report = trainer.close()
        out.write(json.dumps({"report": report}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
