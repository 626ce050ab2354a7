#!/usr/bin/env python
"""Skip-gram word2vec with negative sampling on Paddle 2.6.2's parameter server (fleet
PS, "the_one_ps", async), the Paddle side of scripts/bench_peer.py's word2vec rows.

Run by the harness's launcher (../shared/peers/paddle/bench_launch.py --script this
--model w2v) through scripts/peer/ps_sparse.py, which it shares with ps_ctr.py.

The model is edl's `word2vec`: two embedding tables `emb_in` (centre words, uniform in
+-0.5/dim) and `emb_out` (context and negative words, zeros), both sparse tables on the
pserver (`is_sparse=True`: only the rows a batch touches are pulled and pushed); the loss
of a pair is softplus(-u_o.v_c) + sum_k softplus(u_nk.v_c), its batch mean minimised by
plain SGD. The sparse tables are told to use plain SGD too (`SparseNaiveSGDRule`, the
same learning rate): left to its defaults, 2.6.2 gives a table under an SGD program
Adam's rule, and CTR's show/click accessor.

Data ($data_dir/w2v/part-I-of-N.txt, written by scripts/peer/w2v.py): one (centre,
context, negatives) pair a line in MultiSlot text, "1 c 1 o K n1 .. nK", the same pairs
edl's trainers make from the same sentences (window, sampler). A batch is --batch pairs.

Evaluation: before the first step and after each epoch every trainer calls
fleet.save_persistables (the pservers write the sparse tables; a barrier of all
trainers), reads them back and computes the mean loss of the held-out pairs
($data_dir/w2v/heldout.npz) in numpy: the same figure from each trainer. Before the
first step no row exists yet (rows are created when first pulled): the tables read as
zeros, and the loss is 6 ln 2 as edl's (its `emb_out` starts at zero).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from ps_sparse import read_sparse, run  # noqa: E402


def build(paddle, m):
    F = paddle.nn.functional
    V, D, K = m["vocab"], m["dim"], m["negatives"]
    c = paddle.static.data(name="c", shape=[-1, 1], dtype="int64")
    o = paddle.static.data(name="o", shape=[-1, 1], dtype="int64")
    n = paddle.static.data(name="n", shape=[-1, K], dtype="int64")
    a_in = paddle.ParamAttr(name="emb_in", initializer=paddle.nn.initializer.Uniform(-0.5 / D, 0.5 / D))
    a_out = paddle.ParamAttr(name="emb_out", initializer=paddle.nn.initializer.Constant(0.0))
    v = paddle.reshape(paddle.static.nn.embedding(c, size=[V, D], is_sparse=True, param_attr=a_in), [-1, 1, D])
    u = paddle.reshape(paddle.static.nn.embedding(o, size=[V, D], is_sparse=True, param_attr=a_out), [-1, 1, D])
    un = paddle.reshape(paddle.static.nn.embedding(n, size=[V, D], is_sparse=True, param_attr=a_out), [-1, K, D])
    pos = paddle.sum(u * v, axis=-1)  # [B, 1]
    neg = paddle.sum(un * v, axis=-1)  # [B, K]
    loss = paddle.mean(paddle.sum(F.softplus(-pos), axis=-1) + paddle.sum(F.softplus(neg), axis=-1))
    return [c, o, n], loss


def softplus(x):
    return np.logaddexp(0.0, x)


def heldout_loss(tables, data_dir):
    h = np.load(os.path.join(data_dir, "w2v", "heldout.npz"))
    e_in, e_out = tables["emb_in"], tables["emb_out"]
    v = e_in[h["c"]]
    pos = np.sum(v * e_out[h["o"]], axis=1)
    neg = np.einsum("pkd,pd->pk", e_out[h["n"]], v)
    return float(np.mean(softplus(-pos) + softplus(neg).sum(axis=1)))


def tables(m, batch):
    # Paddle's trainers scale a sparse gradient by the batch size before pushing it
    # (FleetWrapper's scale_sparse_gradient_with_batch_size, on by default): the
    # table's rate is divided by it, so that a row moves as under edl's `sgd`.
    table = {
        "sparse_optimizer": "naive",
        "sparse_learning_rate": m["lr"] / batch,
        "sparse_embedx_dim": m["dim"] - 1,
        "sparse_embedx_threshold": 0,
    }
    return {
        "emb_in": dict(table, sparse_initial_range=0.5 / m["dim"]),
        "emb_out": dict(table, sparse_initial_range=0.0),
    }


def evaluate(e):
    """emb_in (table 0) and emb_out (table 1), in the order the pserver logs them (a
    held-out centre that training never saw reads as zeros here, edl's as its uniform
    initial row: rare)."""
    m = e.meta
    emb_in, n_in = read_sparse(e.saved, 0, m["vocab"], m["dim"])
    emb_out, n_out = read_sparse(e.saved, 1, m["vocab"], m["dim"])
    if not (n_in and n_out) and not e.initial:
        raise SystemExit(f"ps_w2v: no sparse rows found under {e.saved}")
    return heldout_loss({"emb_in": emb_in, "emb_out": emb_out}, e.data_dir), {}


if __name__ == "__main__":
    run("w2v", build, tables, evaluate)
