"""A trainer program for the tests: trains `TRAIN_TASKS` tasks (recording their records'
labels and features), then holds the next task without acknowledging it and says so
on stdout, and waits: for a SIGKILL, or for SIGTERM (a drain: the task goes back)."""

import json
import os
import sys
import time

import numpy as np

import edl


def main() -> None:
    out = open(os.environ["READER_OUT"], "a")
    trained = int(os.environ.get("TRAIN_TASKS", "2"))
    trainer = edl.Trainer.from_env()
    trainer.params({"w": np.zeros(1, dtype=np.float32)})
    for task in trainer.tasks():
        with task:
            if trained > 0:
                rows = task.samples()
                out.write(json.dumps({"done": task.id, "rows": rows["dense"].tolist(),
                                      "labels": rows["label"].tolist()}) + "\n")
                out.flush()
                trained -= 1
                continue
            out.write(json.dumps({"holding": task.id, "index": task.index}) + "\n")
            out.flush()
            # Hold it until a drain (leaving the block then hands it back).
            deadline = time.monotonic() + 60
            while not trainer.draining:
                time.sleep(0.05)
                if time.monotonic() > deadline:
                    sys.exit("never drained")
    report = trainer.close()
    out.write(json.dumps({"report": report}) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
