#!/usr/bin/env python
"""Skip-gram word2vec with negative sampling on Paddle 2.6.2's parameter server (fleet
PS, "the_one_ps", async), the Paddle side of scripts/bench_peer.py's word2vec rows.

Run by the harness's launcher (../shared/peers/paddle/bench_launch.py --script this
--model w2v), which sets the roles; it speaks the harness's event protocol (ready,
first_step, epoch, done) through the harness's own `emit`.

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

Evaluation: after each epoch every trainer calls fleet.save_persistables (the pservers
write the sparse tables; a barrier of all trainers), reads them back and computes the
mean loss of the held-out pairs ($data_dir/w2v/heldout.npz) in numpy: the same figure
from each trainer.
"""
import glob
import json
import os
import sys

sys.path.insert(0, os.environ["EDL_PEER_HARNESS"])
import numpy as np  # noqa: E402
import ps_train  # noqa: E402
from ps_train import emit  # noqa: E402


def meta(data_dir):
    return json.load(open(os.path.join(data_dir, "w2v", "meta.json")))


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


def read_sparse(save_dir, table_id, vocab, dim):
    """One sparse table the pservers saved (fleet.save_persistables): gzip text under
    `<table id>/`, one row a line, `key` then the accessor's fields, the embedding the
    last `dim` of them. A row never touched was never created: a zero row here. Returns
    the table and the rows found."""
    import gzip

    t = np.zeros((vocab, dim), dtype=np.float32)
    found = 0
    for f in glob.glob(os.path.join(save_dir, "%03d" % table_id, "part-*")):
        opener = gzip.open if f.endswith(".gz") else open
        with opener(f, "rt") as fh:
            for line in fh:
                fs = line.split()
                if len(fs) < dim + 1:
                    continue
                t[int(fs[0])] = np.asarray(fs[-dim:], dtype=np.float32)
                found += 1
    return t, found


def read_tables(save_dir, m):
    """emb_in (table 0) and emb_out (table 1), in the order the pserver logs them (a
    held-out centre that training never saw reads as zeros here, edl's as its uniform
    initial row: rare)."""
    tables, found = {}, {}
    for tid, name in ((0, "emb_in"), (1, "emb_out")):
        tables[name], n = read_sparse(save_dir, tid, m["vocab"], m["dim"])
        if n:
            found[name] = n
    return tables, found


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="w2v")
    ap.add_argument("--mode", default="async")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--local", action="store_true")
    args, _ = ap.parse_known_args()
    m = meta(args.data_dir)

    import time
    import paddle
    import paddle.distributed.fleet as fleet

    t_import = time.time()
    paddle.enable_static()
    paddle.seed(1)
    role = fleet.PaddleCloudRoleMaker(is_collective=False)
    fleet.init(role)
    feeds, loss = build(paddle, m)
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    # Paddle's trainers scale a sparse gradient by the batch size before pushing it
    # (FleetWrapper's scale_sparse_gradient_with_batch_size, on by default): the
    # table's rate is divided by it, so that a row moves as under edl's `sgd`.
    table = {
        "sparse_optimizer": "naive",
        "sparse_learning_rate": m["lr"] / args.batch,
        "sparse_embedx_dim": m["dim"] - 1,
        "sparse_embedx_threshold": 0,
    }
    strategy.fleet_desc_configs = {
        "use_cvm": False,
        "emb_in": dict(table, sparse_initial_range=0.5 / m["dim"]),
        "emb_out": dict(table, sparse_initial_range=0.0),
    }
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(learning_rate=m["lr"]), strategy)
    opt.minimize(loss)
    if fleet.is_server():
        fleet.init_server()
        emit("server_ready", since_t0=time.time() - ps_train.T0)
        fleet.run_server()
        return

    tid, nw = fleet.worker_index(), fleet.worker_num()
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    fleet.init_worker()
    main_prog = paddle.static.default_main_program()
    shard = os.path.join(args.data_dir, "w2v", f"part-{tid}-of-{nw}.txt")
    pairs = sum(1 for _ in open(shard))
    ds = paddle.distributed.InMemoryDataset()
    ds.init(batch_size=args.batch, thread_num=1, use_var=feeds, pipe_command="cat")
    ds.set_filelist([shard])
    tl = time.time()
    ds.load_into_memory()
    load_s = time.time() - tl
    nb = (pairs + args.batch - 1) // args.batch
    emit("ready", import_s=t_import - ps_train.T_PROC, load_s=load_s, since_t0=time.time() - ps_train.T0,
         shard=pairs, batches=nb)
    save_dir = os.path.join(os.environ.get("EDL_PEER_SAVE", args.data_dir), "w2v-saved")

    def evaluate(ep):
        d = f"{save_dir}-{ep}"
        fleet.save_persistables(exe, d, main_prog)  # every trainer calls it (a gloo barrier)
        tables, found = read_tables(d, m)
        if not found:
            raise SystemExit(f"ps_w2v: no sparse rows found under {d}: {sorted(glob.glob(d + '/**', recursive=True))[:20]}")
        return heldout_loss(tables, args.data_dir)

    epoch_times, losses = [], []
    t_train0 = time.time()
    for ep in range(args.epochs):
        te = time.time()
        exe.train_from_dataset(program=main_prog, dataset=ds)
        dt = time.time() - te
        epoch_times.append(dt)
        if ep == 0:
            emit("first_step", since_t0=(te - ps_train.T0) + dt / nb, approx="epoch0/batches")
        ev = evaluate(ep)
        losses.append(ev)
        emit("epoch", epoch=ep, wall_s=dt, eval_loss=ev, samples=pairs)
    emit("done", train_s=time.time() - t_train0, epoch_times=epoch_times,
         epoch_losses=losses, loss0=None,
         samples=pairs * args.epochs, train_only_s=sum(epoch_times))
    fleet.stop_worker()
    emit("stopped")


if __name__ == "__main__":
    main()
