#!/usr/bin/env python
"""The harness's ps_train.py (../shared/peers/paddle) with a wider MLP: 784, then the
hidden widths of $EDL_PEER_HIDDEN (comma-separated, ReLU), then 10 logits; softmax
cross-entropy, SGD lr 0.05, as the harness's "mlp". scripts/bench_peer.py runs it through
the harness's bench_launch.py (--script) for its wide dense rows (784-3584-3584-10,
15.7M parameters), on the harness's "mlp" data. Paddle 2.6.2 cannot train 20M: its
pserver keeps brpc's 64 MiB message limit (its clients set 300 MB), so one push of the
80 MB dense table at 784-4096-4096-10 closes the connection ("body_size=80150636 ... is
too large") and the trainer aborts ("push dense param failed"); setting the brpc flag
from Python did not reach the server. Everything else (roles, the loop, the
events) is the harness's own: this file only replaces its model and its numpy loss."""
import os
import sys

sys.path.insert(0, os.environ["EDL_PEER_HARNESS"])
import numpy as np  # noqa: E402
import ps_train  # noqa: E402

HIDDEN = [int(w) for w in os.environ.get("EDL_PEER_HIDDEN", "256").split(",")]


def build(model, paddle):
    F = paddle.nn.functional
    x = paddle.static.data(name="x", shape=[-1, 784], dtype="float32")
    y = paddle.static.data(name="y", shape=[-1, 1], dtype="int64")
    h = x
    for w in HIDDEN:
        h = paddle.static.nn.fc(h, size=w, activation="relu")
    logits = paddle.static.nn.fc(h, size=10)
    loss = paddle.mean(F.cross_entropy(logits, y))
    return x, y, loss, 0.05


def np_loss(model, P, xs, ys):
    layers = len(HIDDEN) + 1
    tot = 0.0
    for i in range(0, xs.shape[0], 4096):
        h = xs[i:i + 4096]
        for k in range(layers):
            h = h @ P[f"fc_{k}.w_0"] + P[f"fc_{k}.b_0"]
            if k + 1 < layers:
                h = np.maximum(h, 0)
        z = h - h.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        tot += float(np.sum(lse - z[np.arange(z.shape[0]), ys[i:i + 4096, 0]]))
    return tot / xs.shape[0]


ps_train.build = build
ps_train.np_loss = np_loss

if __name__ == "__main__":
    ps_train.main()
