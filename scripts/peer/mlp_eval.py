"""The dense rows' held-out evaluation, for the harness's trainers (ps_train.py for
Paddle 2.6.2, ps_train_fluid18.py for 1.8.5; scripts/peer/ps_mlp.py and
ps_mlp_fluid18.py patch them with it).

The harness evaluates before the first step (`loss0`) and after every epoch by calling
its module's `np_loss(model, P, xs, ys)` on the trainer's own training shard. `patch`
replaces that function: the same evaluations (the same parameters, pulled from the
pservers as the harness pulls them, at the same points) compute the loss and the
accuracy of the held-out samples in $EDL_PEER_TEST instead (the 10,000 samples that
edl's job evaluates as its test split; scripts/bench_peer.py writes both), and each one
emits a `heldout_eval` event. `epoch` events gain `eval_accuracy`, `eval_set` and, where
the harness gives none (`--local`), `eval_s`.

Python 3.8 and numpy 1.19 compatible (Paddle 1.8.5's venv): numpy only.
"""
import os
import time

import numpy as np

# The hidden widths (comma-separated): the wide rows set them, the harness's MLP is 256.
HIDDEN = [int(w) for w in os.environ.get("EDL_PEER_HIDDEN", "256").split(",")]
_test = None
_last = {}


def _forward(P, x):
    n = len(HIDDEN) + 1
    for k in range(n):
        x = x @ P["fc_%d.w_0" % k] + P["fc_%d.b_0" % k]
        if k + 1 < n:
            x = np.maximum(x, 0)
    return x


def held_out(P):
    """Mean softmax cross-entropy and accuracy of the parameters `P` on the held-out set."""
    global _test
    if _test is None:  # loaded by the first evaluation, before the first step
        t = np.load(os.environ["EDL_PEER_TEST"])
        _test = (t["x"], t["y"][:, 0])
    xs, ys = _test
    loss, correct = 0.0, 0
    for i in range(0, xs.shape[0], 4096):
        z = _forward(P, xs[i:i + 4096])
        y = ys[i:i + 4096]
        z = z - z.max(axis=1, keepdims=True)
        loss += float(np.sum(np.log(np.exp(z).sum(axis=1)) - z[np.arange(z.shape[0]), y]))
        correct += int(np.sum(np.argmax(z, axis=1) == y))
    return loss / xs.shape[0], correct / xs.shape[0]


def patch(mod):
    """Makes the harness module `mod` evaluate the held-out set (see the module's doc)."""
    emit = mod.emit
    eval_set = os.environ["EDL_PEER_TEST"]

    def np_loss(model, P, xs, ys):  # the trainer's shard (xs, ys) is not used
        t = time.time()
        loss, acc = held_out(P)
        s = time.time() - t
        _last.update(acc=acc, s=s)
        emit("heldout_eval", eval_loss=loss, eval_accuracy=acc, eval_s=s, eval_set=eval_set,
             samples=int(_test[0].shape[0]))
        return loss

    def emit_(ev, **kw):
        if ev == "epoch":
            kw["eval_accuracy"] = _last.get("acc")
            kw["eval_set"] = eval_set
            # ps_train's distributed worker and 1.8.5 time the evaluation themselves (the
            # pull included); its --local loop does not.
            kw.setdefault("eval_s", _last.get("s"))
        return emit(ev, **kw)

    mod.np_loss = np_loss
    mod.emit = emit_
