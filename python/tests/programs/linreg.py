"""A trainer program in NumPy: linear regression on edl samples, as `[trainer] entry =
["python", "linreg.py"]` runs it. Also the evaluation `edl run` asks for at the end."""

import numpy as np

import edl


def predict(values, dense):
    return dense @ values["w"] + values["b"][0]


def main() -> None:
    with edl.Trainer.from_env() as trainer:
        dims = 2
        params = trainer.params(
            {"w": np.zeros(dims, dtype=np.float32), "b": np.zeros(1, dtype=np.float32)}
        )
        if trainer.mode == "evaluate":
            split, records = trainer.evaluation_records()
            s = edl.decode_samples(records)
            err = predict(params.pull(), s["dense"]) - s["label"]
            mse = float(np.mean(err * err))
            trainer.report_evaluation("cost", mse, mse, split, len(records))
            return
        values = {"w": np.zeros(dims, dtype=np.float32), "b": np.zeros(1, dtype=np.float32)}
        for epoch in trainer.passes():
            for task in epoch:
                with task:
                    for batch in task.batches(trainer.batch_size):
                        s = batch.samples()
                        x, y = s["dense"], s["label"]
                        params.pull(out=values)
                        err = predict(values, x) - y
                        grads = {
                            "w": (2.0 * x.T @ err / len(y)).astype(np.float32),
                            "b": np.array([2.0 * err.mean()], dtype=np.float32),
                        }
                        params.push(grads, task=task, loss=float(np.mean(err * err)))


if __name__ == "__main__":
    main()
