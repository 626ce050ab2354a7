"""What scripts/peer/ps_w2v.py and ps_ctr.py share: a model with sparse tables trained
on Paddle 2.6.2's parameter server (fleet PS, "the_one_ps", async) under the harness's
launcher (bench_launch.py --script ... --model NAME), speaking the harness's event
protocol (ready, first_step, epoch, done; and heldout_eval) through its own `emit`.

`run(name, build, tables, evaluate)`:
- `build(paddle, meta)` -> (feed variables, loss);
- `tables(meta, batch)` -> `fleet_desc_configs` for the sparse tables;
- `evaluate(Eval)` -> (held-out loss, extra fields of the `epoch` event), after the
  pservers saved the sparse tables into `Eval.saved`.

Every trainer evaluates the held-out set once before its first step (as edl's trainers
evaluate their test split; `Eval.initial`: no sparse row exists yet, the tables read as
zeros) and once after each epoch. Each evaluation is the save (fleet.save_persistables:
two barriers of all trainers, the first trainer asking the pservers to write), the read
back and the numpy forward pass, timed together (`eval_s`) and reported by a
`heldout_eval` event.

The data is `$data_dir/NAME/part-I-of-N.txt` (MultiSlot text) and its `meta.json`, as
scripts/peer/w2v.py and ctr.py write them.
"""
import argparse
import glob
import gzip
import json
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.environ["EDL_PEER_HARNESS"])
import numpy as np  # noqa: E402
import ps_train  # noqa: E402
from ps_train import emit  # noqa: E402


def read_sparse(save_dir, table_id, vocab, dim):
    """One sparse table the pservers saved (fleet.save_persistables): gzip text under
    `<table id>/`, one row a line, `key` then the accessor's fields, the embedding the
    last `dim` of them. A row never touched was never created: a zero row here. Returns
    the table and the rows found."""
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


@dataclass
class Eval:
    """What an evaluation gets: the job's meta, its data folder, the folder the
    pservers saved the sparse tables into, and the trainer's scope, program and fleet."""
    meta: dict
    data_dir: str
    saved: str
    scope: object
    program: object
    fleet: object
    initial: bool = False  # before the first step: the sparse tables have no rows yet


def pull_dense(fleet):
    """The pservers' dense parameters into the trainer's scope."""
    rt = fleet.fleet._runtime_handle
    from paddle.distributed.ps.utils.public import get_the_one_recv_context
    rt._pull_all_dense(rt.scopes, rt._send_ctx,
                       get_the_one_recv_context(rt.context, split_dense_table=rt.is_heter_ps_mode))


def run(name, build, tables, evaluate):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=name)
    ap.add_argument("--mode", default="async")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--data-dir", required=True)
    args, _ = ap.parse_known_args()
    m = json.load(open(os.path.join(args.data_dir, name, "meta.json")))

    import paddle
    import paddle.distributed.fleet as fleet

    t_import = time.time()
    paddle.enable_static()
    paddle.seed(1)
    fleet.init(fleet.PaddleCloudRoleMaker(is_collective=False))
    feeds, loss = build(paddle, m)
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    strategy.fleet_desc_configs = dict(tables(m, args.batch), use_cvm=False)
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
    shard = os.path.join(args.data_dir, name, f"part-{tid}-of-{nw}.txt")
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

    eval_set = os.path.join(args.data_dir, name, "heldout.npz")

    def held_out(tag, initial=False):
        """The save, the read back and the evaluation: (loss, extra fields, seconds)."""
        t = time.time()
        saved = os.path.join(args.data_dir, f"{name}-saved-{tag}")
        fleet.save_persistables(exe, saved, main_prog)  # every trainer calls it (a barrier)
        save_s = time.time() - t
        ev, extra = evaluate(Eval(m, args.data_dir, saved, paddle.static.global_scope(), main_prog, fleet,
                                  initial=initial))
        s = time.time() - t
        emit("heldout_eval", eval_loss=ev, eval_s=s, save_s=save_s, eval_set=eval_set, **extra)
        return ev, extra, s

    loss0, _, _ = held_out("init", initial=True)
    epoch_times, losses = [], []
    t_train0 = time.time()
    for ep in range(args.epochs):
        te = time.time()
        exe.train_from_dataset(program=main_prog, dataset=ds)
        dt = time.time() - te
        epoch_times.append(dt)
        if ep == 0:
            emit("first_step", since_t0=(te - ps_train.T0) + dt / nb, approx="epoch0/batches")
        ev, extra, s = held_out(ep)
        losses.append(ev)
        emit("epoch", epoch=ep, wall_s=dt, eval_loss=ev, eval_s=s, eval_set=eval_set, samples=n, **extra)
    emit("done", train_s=time.time() - t_train0, epoch_times=epoch_times, epoch_losses=losses, loss0=loss0,
         samples=n * args.epochs, train_only_s=sum(epoch_times))
    fleet.stop_worker()
    emit("stopped")
