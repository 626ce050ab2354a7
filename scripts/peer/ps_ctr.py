#!/usr/bin/env python
"""CTR-DNN on Paddle 2.6.2's parameter server (fleet PS, "the_one_ps", async), the Paddle
side of scripts/bench_peer.py's CTR rows (scripts/peer/ctr.py writes the data and says
what it is).

Run by the harness's launcher (bench_launch.py --script this --model ctr); it speaks the
harness's event protocol. The model is PaddleRec's CTR-DNN as edl's `ctr` builds it: 13
dense features and 26 one-id slots, each id's row of one sparse table `emb` (9 wide,
`is_sparse=True`: pulled and pushed by row), concatenated, three ReLU layers of 400, 2
logits, mean softmax cross-entropy, plain SGD. As in ps_w2v.py the sparse table is told
to use plain SGD at the rate divided by the batch size (Paddle's trainers scale sparse
gradients by it), its rows starting uniform in +-0.01 as edl's.

Evaluation after each epoch: the dense parameters are pulled from the pservers, the
sparse table saved by them (fleet.save_persistables) and read back, and the held-out
loss and accuracy computed in numpy.
"""
import json
import os
import sys

sys.path.insert(0, os.environ["EDL_PEER_HARNESS"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import ps_train  # noqa: E402
from ps_train import emit  # noqa: E402
from ps_w2v import read_sparse  # noqa: E402


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


def main():
    import argparse
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ctr")
    ap.add_argument("--mode", default="async")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--data-dir", required=True)
    args, _ = ap.parse_known_args()
    m = json.load(open(os.path.join(args.data_dir, "ctr", "meta.json")))

    import paddle
    import paddle.distributed.fleet as fleet

    t_import = time.time()
    paddle.enable_static()
    paddle.seed(1)
    fleet.init(fleet.PaddleCloudRoleMaker(is_collective=False))
    feeds, loss = build(paddle, m)
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    strategy.fleet_desc_configs = {
        "use_cvm": False,
        "emb": {
            "sparse_optimizer": "naive",
            "sparse_learning_rate": m["lr"] / args.batch,
            "sparse_initial_range": 0.01,
            "sparse_embedx_dim": m["dim"] - 1,
            "sparse_embedx_threshold": 0,
        },
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
    shard = os.path.join(args.data_dir, "ctr", f"part-{tid}-of-{nw}.txt")
    n = sum(1 for _ in open(shard))
    ds = paddle.distributed.InMemoryDataset()
    ds.init(batch_size=args.batch, thread_num=1, use_var=feeds, pipe_command="cat")
    ds.set_filelist([shard])
    tl = time.time()
    ds.load_into_memory()
    load_s = time.time() - tl
    nb = (n + args.batch - 1) // args.batch
    emit("ready", import_s=t_import - ps_train.T_PROC, load_s=load_s, since_t0=time.time() - ps_train.T0,
         shard=n, batches=nb)
    scope = paddle.static.global_scope()
    dense_names = [p.name for p in main_prog.all_parameters() if p.name.startswith("fc_")]
    save_dir = os.path.join(args.data_dir, "ctr-saved")

    def evaluate(ep):
        rt = fleet.fleet._runtime_handle
        from paddle.distributed.ps.utils.public import get_the_one_recv_context
        rt._pull_all_dense(rt.scopes, rt._send_ctx,
                           get_the_one_recv_context(rt.context, split_dense_table=rt.is_heter_ps_mode))
        P = {k: np.array(scope.find_var(k).get_tensor()) for k in dense_names}
        d = f"{save_dir}-{ep}"
        fleet.save_persistables(exe, d, main_prog)  # every trainer calls it (a barrier)
        emb, found = read_sparse(d, 0, m["vocab"], m["dim"])
        if not found:
            raise SystemExit(f"ps_ctr: no sparse rows found under {d}")
        return heldout(P, emb, args.data_dir, len(m["hidden"]) + 1)

    epoch_times, losses = [], []
    t_train0 = time.time()
    for ep in range(args.epochs):
        te = time.time()
        exe.train_from_dataset(program=main_prog, dataset=ds)
        dt = time.time() - te
        epoch_times.append(dt)
        if ep == 0:
            emit("first_step", since_t0=(te - ps_train.T0) + dt / nb, approx="epoch0/batches")
        ev, acc = evaluate(ep)
        losses.append(ev)
        emit("epoch", epoch=ep, wall_s=dt, eval_loss=ev, eval_accuracy=acc, samples=n)
    emit("done", train_s=time.time() - t_train0, epoch_times=epoch_times, epoch_losses=losses, loss0=None,
         samples=n * args.epochs, train_only_s=sum(epoch_times))
    fleet.stop_worker()
    emit("stopped")


if __name__ == "__main__":
    main()
