#!/usr/bin/env python
"""The harness's ps_train.py (../shared/peers/paddle, Paddle 2.6.2) for the dense rows of
scripts/bench_peer.py, run through the harness's bench_launch.py (--script): its roles,
loop and events unchanged, with two replacements.

- Its evaluations (before the first step, and after every epoch) compute the loss and
  accuracy of the held-out set that edl's job evaluates ($EDL_PEER_TEST), not of the
  trainer's training shard (scripts/peer/mlp_eval.py).
- With $EDL_PEER_HIDDEN (comma-separated widths, ReLU) the model is 784, those hidden
  layers, then 10 logits; softmax cross-entropy, SGD lr 0.05, as the harness's "mlp".
  The wide rows train 784-3584-3584-10 (15.7M parameters). Paddle 2.6.2 cannot train
  20M: its pserver keeps brpc's 64 MiB message limit (its clients set 300 MB), so one
  push of the 80 MB dense table at 784-4096-4096-10 closes the connection
  ("body_size=80150636 ... is too large") and the trainer aborts ("push dense param
  failed"); setting the brpc flag from Python did not reach the server.
"""
import os
import sys

sys.path.insert(0, os.environ["EDL_PEER_HARNESS"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlp_eval  # noqa: E402
import ps_train  # noqa: E402


def build(model, paddle):
    F = paddle.nn.functional
    x = paddle.static.data(name="x", shape=[-1, 784], dtype="float32")
    y = paddle.static.data(name="y", shape=[-1, 1], dtype="int64")
    h = x
    for w in mlp_eval.HIDDEN:
        h = paddle.static.nn.fc(h, size=w, activation="relu")
    logits = paddle.static.nn.fc(h, size=10)
    loss = paddle.mean(F.cross_entropy(logits, y))
    return x, y, loss, 0.05


if "EDL_PEER_HIDDEN" in os.environ:
    ps_train.build = build  # 784-256-10 keeps the harness's own build
mlp_eval.patch(ps_train)

if __name__ == "__main__":
    ps_train.main()
