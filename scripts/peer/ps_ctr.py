#!/usr/bin/env python
"""CTR-DNN on Paddle 2.6.2's parameter server (fleet PS, "the_one_ps", async), the Paddle
side of scripts/bench_peer.py's CTR rows (scripts/peer/ctr.py writes the data and says
what it is).

Run by the harness's launcher (bench_launch.py --script this --model ctr) through
scripts/peer/ps_sparse.py, which it shares with ps_w2v.py. The model is PaddleRec's CTR-DNN as edl's `ctr` builds it: 13
dense features and 26 one-id slots, each id's row of one sparse table `emb` (9 wide,
`is_sparse=True`: pulled and pushed by row), concatenated, three ReLU layers of 400, 2
logits, mean softmax cross-entropy, plain SGD. As in ps_w2v.py the sparse table is told
to use plain SGD at the rate divided by the batch size (Paddle's trainers scale sparse
gradients by it), its rows starting uniform in +-0.01 as edl's.

Evaluation before the first step and after each epoch: the dense parameters are pulled
from the pservers, the sparse table saved by them (fleet.save_persistables) and read
back, and the held-out loss and accuracy computed in numpy. Before the first step the
table has no rows (a row is created when first pulled): it reads as zeros, where edl's
rows start uniform in +-0.01, so the initial figures differ slightly for the same work.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from ps_sparse import pull_dense, read_sparse, run  # noqa: E402


def build(paddle, m):
    F = paddle.nn.functional
    dense = paddle.static.data(name="dense", shape=[-1, m["dense"]], dtype="float32")
    slots = [paddle.static.data(name=f"s{i}", shape=[-1, 1], dtype="int64") for i in range(m["slots"])]
    label = paddle.static.data(name="label", shape=[-1, 1], dtype="int64")
    attr = paddle.ParamAttr(name="emb", initializer=paddle.nn.initializer.Uniform(-0.01, 0.01))
    embs = [paddle.reshape(paddle.static.nn.embedding(s, size=[m["vocab"], m["dim"]], is_sparse=True,
                                                      param_attr=attr), [-1, m["dim"]]) for s in slots]
    h = paddle.concat([dense] + embs, axis=1)
    for w in m["hidden"]:
        h = paddle.static.nn.fc(h, size=w, activation="relu")
    logits = paddle.static.nn.fc(h, size=2)
    loss = paddle.mean(F.cross_entropy(logits, label))
    return [dense] + slots + [label], loss


def heldout(P, emb, data_dir, layers):
    h = np.load(os.path.join(data_dir, "ctr", "heldout.npz"))
    x = np.concatenate([h["x"], emb[h["ids"]].reshape(h["ids"].shape[0], -1)], axis=1)
    for k in range(layers):
        x = x @ P[f"fc_{k}.w_0"] + P[f"fc_{k}.b_0"]
        if k + 1 < layers:
            x = np.maximum(x, 0)
    z = x - x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=1))
    y = h["y"]
    loss = float(np.mean(lse - z[np.arange(y.shape[0]), y]))
    acc = float(np.mean(np.argmax(x, axis=1) == y))
    return loss, acc


def tables(m, batch):
    return {
        "emb": {
            "sparse_optimizer": "naive",
            "sparse_learning_rate": m["lr"] / batch,
            "sparse_initial_range": 0.01,
            "sparse_embedx_dim": m["dim"] - 1,
            "sparse_embedx_threshold": 0,
        },
    }


def evaluate(e):
    m = e.meta
    pull_dense(e.fleet)
    dense = [p.name for p in e.program.all_parameters() if p.name.startswith("fc_")]
    P = {k: np.array(e.scope.find_var(k).get_tensor()) for k in dense}
    emb, found = read_sparse(e.saved, 0, m["vocab"], m["dim"])
    if not found and not e.initial:
        raise SystemExit(f"ps_ctr: no sparse rows found under {e.saved}")
    loss, acc = heldout(P, emb, e.data_dir, len(m["hidden"]) + 1)
    return loss, {"eval_accuracy": acc}


if __name__ == "__main__":
    run("ctr", build, tables, evaluate)
