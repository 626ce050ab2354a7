#!/usr/bin/env python3
"""The side-by-side of edl and PaddlePaddle on one job, in one sitting (run by
scripts/bench-peer, which installs what it needs; see docs/benchmarks.md).

The job (the harness's "mlp"): 784-256-10 MLP, softmax cross-entropy, 60,000 synthetic
training samples (gen_data.py, seed 2024) and 10,000 held out (the same teacher, new
inputs, seed 2025; `prepare_data`), plain SGD lr 0.05, batch 64, 3 epochs, one pserver
on loopback; weights start from Xavier's bound in both (Paddle's fc default; edl's
`init = "xavier"`). The wide rows (`-16m`) train 784-3584-3584-10 (15.7M parameters,
the most Paddle's pserver takes in one push) for one epoch. Paddle runs under the
harness's launcher (bench_launch.py) with our wrapper of its trainer
(scripts/peer/ps_mlp.py, ps_mlp_fluid18.py); edl runs `edl run` on a private etcd, with
the same samples converted to RecordIO and the held-out ones as its test split. The
async edl rows run with the default (`batches_per_push = "adaptive"`: as many batches
per push as were computed during the previous push's round trip, up to 16), and with
`batches_per_push = 1`, 4 and 13 (the summed gradients of N batches per push). Paddle
2.6.2's async mode (its `a_sync` DownpourLite communicator) merges up to 13 queued
gradients per send (`FLAGS_pserver_push_dense_merge_limit = 12`, polled every 10 ms);
`communicator_max_merge_var_num` is used only in its GEO and heter modes.

Both sides make the same evaluations of the same held-out set: every trainer once
before its first step and once after every epoch (edl: at every pass end, its trainers
with a test split; Paddle: the harness's own evaluations, made to evaluate the held-out
set instead of the trainer's training shard). The sparse rows likewise (their own
held-out sets; scripts/peer/). The table says how many each trainer made, and the
script checks that every row evaluated the held-out set and that paired rows made the
same evaluations.

Figures per run, every window from timestamps, the same way for both sides (edl: the
trainers' reports; Paddle: the trainers' events, on the launcher's clock):
- spawn: edl, just before `edl run` starts; Paddle, the launcher's T0, just before it
  spawns the pserver and the trainers (after its gen_data.py check);
- first step: the first trainer's first gradient step (Paddle 2.6.2: its epoch's start
  plus one mean step, train_from_dataset having no per-batch hook);
- last step: the last trainer's last step (Paddle: the end of its last epoch's
  training, the `epoch` event less the evaluation after it);
- steady samples/s: samples trained / (first step -> last step): training, the
  evaluations between epochs (passes), the waits between them;
- from-spawn samples/s: samples trained / (spawn -> last step): also startup, data
  loading and the evaluations before the first step;
- end-to-end wall: spawn -> the last trainer's exit (Paddle's pserver never exits;
  edl's wall also holds `edl run`'s final evaluation, params.json and the shutdown);
- spawn -> first step;
- CPU-s per 1,000 samples: the user+system CPU of every process of the run (the
  launcher or `edl run` and every process it or this script waited for: trainers,
  pservers, master, etcd, Paddle's gloo store), less, for Paddle, the launcher's
  gen_data.py check (measured alone), over the samples trained;
- held-out loss and accuracy: of the final parameters on the held-out set (edl: `edl
  run`'s evaluation after every trainer finished; Paddle: the evaluation that ran last,
  the last trainer's after its last epoch).

Rows are repeated --reps times, interleaved (a round of every row, then the next), and
the table shows medians. Only ratios within one sitting mean anything on a shared box.
"""

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer"))
import ctr  # noqa: E402  (scripts/peer/ctr.py)
import w2v  # noqa: E402  (scripts/peer/w2v.py)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from edl_runs import (become_subreaper, children_cpu, edl_spec, net_bytes, netns,  # noqa: E402,F401
                      reap_orphans, run_edl, run_edl_spec)

EPOCHS = 3
SAMPLES = 60_000
# The held-out samples of the mlp job: the harness's teacher, new inputs (`mlp_test_set`).
TEST = 10_000
TEST_SEED = 2025
TEST_GLOB = "test-*.recordio"  # edl's test split (the training files are mlp-*.recordio)
# The hidden widths of the wide dense rows: 15.7M parameters, the most Paddle 2.6.2's
# pserver takes in one push (62.8 MB; brpc's 64 MiB limit, scripts/peer/ps_mlp.py).
WIDE = (3584, 3584)
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer")
# Each Paddle row and the edl rows compared with it: the same evaluations per trainer.
PAIRS = [
    ("p26-async", ["edl-async-2", "edl-async-2-g1", "edl-async-2-g1-c1", "edl-async-2-g4",
                   "edl-async-2-g13", "edl-async-2-r2"]),
    ("p26-local", ["edl-async-1", "edl-async-1-g1", "edl-async-1-whole", "edl-async-1-g4"]),
    ("p26-async-16m", ["edl-async-2-16m"]),
    ("p26-local-16m", ["edl-async-1-16m"]),
    ("p26-w2v", ["edl-w2v", "edl-w2v-g1", "edl-w2v-g4"]),
    ("p26-ctr", ["edl-ctr", "edl-ctr-g4"]),
    ("p18-sync", ["edl-sync-2", "edl-sync-2-r2"]),
    ("p18-async", ["edl-async-2"]),
]


def log(msg):
    print(f"bench-peer: {msg}", file=sys.stderr, flush=True)


def mlp_test_set(data, edl_dir, edl):
    """The held-out set, the same for both: data/mlp/test.npz (Paddle's evaluation,
    scripts/peer/mlp_eval.py) and edl_dir/test-00000-of-00001.recordio (edl's test
    split). TEST new inputs from the harness's distribution (uniform in [-0.5, 0.5)),
    labelled by the harness's teacher (gen_data.make("mlp") draws the 60,000 inputs and
    then the teacher from default_rng(2024): reproduced, and checked against its labels),
    then rounded to 4 decimals as the harness writes its samples."""
    import numpy as np  # the venv's (2.6.2 has numpy), as gen_data.py's

    rng = np.random.default_rng(2024)
    x_tr = rng.random((SAMPLES, 784), dtype=np.float32) - np.float32(0.5)
    wt = rng.standard_normal((784, 10), dtype=np.float32)
    y_tr = np.load(os.path.join(data, "mlp", "part-0-of-1.npz"))["y"][:, 0]
    agree = float(np.mean(np.argmax(x_tr @ wt, axis=1) == y_tr))
    if agree < 0.999:
        sys.exit(f"bench-peer: the harness's teacher was not reproduced (labels agree on {agree:.4f})")
    x = np.random.default_rng(TEST_SEED).random((TEST, 784), dtype=np.float32) - np.float32(0.5)
    y = np.argmax(x @ wt, axis=1).astype(np.int64)  # from the unrounded inputs, as gen_data.py
    text = [["%.4f" % v for v in row] for row in x.tolist()]
    csv = os.path.join(edl_dir, "test.csv")
    with open(csv, "w") as f:
        f.write("".join(",".join(r) + ",%d\n" % c for r, c in zip(text, y.tolist())))
    for old in glob.glob(os.path.join(edl_dir, "test-*.recordio")):
        os.remove(old)
    subprocess.run([edl, "data", "convert", "--format", "csv", "--label", "class",
                    "--prefix", "test", "--out", edl_dir, csv], check=True, stdout=subprocess.DEVNULL)
    os.remove(csv)
    # The numbers of the text, as both systems read them.
    xs = np.asarray(text, dtype=np.float64).astype(np.float32)
    np.savez(os.path.join(data, "mlp", "test.npz"), x=xs, y=y.reshape(-1, 1))


def prepare_data(a):
    """The harness's data (npz + Paddle text), the same samples as edl RecordIO, and the
    held-out set for both (`mlp_test_set`)."""
    data = os.path.join(a.work, "data")
    for t in (2, 1):
        subprocess.run([a.paddle26, os.path.join(a.harness, "gen_data.py"), "--data-dir", data,
                        "--trainers", str(t), "--models", "mlp"], check=True)
    edl_dir = os.path.join(a.work, "edl")
    os.makedirs(edl_dir, exist_ok=True)
    done = os.path.join(edl_dir, "DONE-v1")
    if not os.path.exists(done):
        import numpy as np  # the venv's (2.6.2 has numpy)

        log("converting the samples to RecordIO (once)")
        for old in glob.glob(os.path.join(edl_dir, "mlp-*.recordio")):
            os.remove(old)
        npz = np.load(os.path.join(data, "mlp", "part-0-of-1.npz"))
        x, y = npz["x"], npz["y"]
        csv = os.path.join(edl_dir, "mlp.csv")
        with open(csv, "w") as f:
            for i in range(0, x.shape[0], 2000):
                rows = zip(x[i:i + 2000].tolist(), y[i:i + 2000, 0].tolist())
                f.write("".join(",".join("%.4f" % v for v in r) + ",%d\n" % c for r, c in rows))
        subprocess.run([a.edl, "data", "convert", "--format", "csv", "--label", "class",
                        "--prefix", "mlp", "--out", edl_dir, csv], check=True,
                       stdout=subprocess.DEVNULL)
        os.remove(csv)
        open(done, "w").write("ok\n")
    done_test = os.path.join(edl_dir, "DONE-test-v1")
    if not (os.path.exists(done_test) and os.path.exists(os.path.join(data, "mlp", "test.npz"))):
        log(f"writing the {TEST:,} held-out samples for both (once)")
        mlp_test_set(data, edl_dir, a.edl)
        open(done_test, "w").write("ok\n")
    return data, edl_dir


_GEN_CPU = {}


def gen_data_cpu(a, py, data, trainers, model):
    """The CPU-s of the launcher's gen_data.py check (bench_launch.py runs it on every
    run, before its T0: a Python and numpy start that finds the data there), measured
    alone with the same arguments: median of 3, once a sitting."""
    key = (py, trainers, model)
    if key not in _GEN_CPU:
        xs = []
        for _ in range(3):
            c0 = children_cpu()
            subprocess.run([py, os.path.join(a.harness, "gen_data.py"), "--data-dir", data,
                            "--trainers", str(trainers), "--models", model], check=True,
                           stdout=subprocess.DEVNULL)
            xs.append(children_cpu() - c0)
        _GEN_CPU[key] = statistics.median(xs)
    return _GEN_CPU[key]


def paddle_windows(r, samples):
    """bench-peer's figures from the trainers' events (see the module's doc), or an error."""
    tr = {w: evs for w, evs in r.get("events", {}).items() if w.startswith("trainer")}
    if not tr:
        return {"error": "no trainer events"}
    firsts, lasts, evals, held, complete, secs = [], [], [], [], True, {}
    for w, evs in sorted(tr.items()):
        fi = next((i for i, e in enumerate(evs) if e["ev"] == "first_step"), None)
        epochs = [e for e in evs if e["ev"] == "epoch"]
        if fi is None or not epochs or any(e.get("eval_s") is None for e in epochs):
            return {"error": f"{w}: no first_step, or epoch events without eval_s"}
        firsts.append(evs[fi]["since_t0"])
        # Its last step: the end of its last epoch's training (the evaluation after it,
        # timed by eval_s, ends at the `epoch` event).
        last = max(epochs, key=lambda e: e["epoch"])
        lasts.append(last["rel"] - last["eval_s"])
        hs = [(i, e) for i, e in enumerate(evs) if e["ev"] == "heldout_eval"]
        before = sum(i < fi for i, _ in hs)
        evals.append(f"{before}+{len(hs) - before}")
        held += [e for _, e in hs]
        # Each evaluation's seconds (the sparse rows: and of its save), for the raw JSON.
        secs[w] = [[round(e.get("eval_s") or 0, 3), round(e.get("save_s") or 0, 3)] for _, e in hs]
        # Every evaluation the trainer made was of the held-out set: one per epoch event
        # (each carries eval_set) and one before the first step.
        complete &= all(e.get("eval_set") for e in epochs) and len(hs) == len(epochs) + before
    final = max(held, key=lambda e: e["t"]) if held else {}
    return {
        "sps": samples / max(max(lasts) - min(firsts), 1e-9),
        "spawn_sps": samples / max(max(lasts), 1e-9),
        "first": min(firsts),
        "loss": final.get("eval_loss"),
        "acc": final.get("eval_accuracy"),
        "split": "test" if held and complete else "train",
        "evals": sorted(evals),
        "eval_save_s": secs,
    }


def run_paddle(a, py, data, mode, tag, fluid18=False, hidden=None, epochs=EPOCHS, model="mlp",
               script=None, batch=64):
    logdir = os.path.join(a.work, "runs", tag)
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir, exist_ok=True)
    out = os.path.join(logdir, "result.json")
    net_file = logdir + ".net"
    env = dict(os.environ, NET_FILE=net_file, EDL_PEER_HARNESS=a.harness)
    env.pop("EDL_PEER_HIDDEN", None)
    if model == "mlp":
        # The harness's trainer, evaluating the held-out set (scripts/peer/mlp_eval.py).
        script = "ps_mlp_fluid18.py" if fluid18 else "ps_mlp.py"
        env["EDL_PEER_TEST"] = os.path.join(data, "mlp", "test.npz")
        if hidden:
            env["EDL_PEER_HIDDEN"] = ",".join(map(str, hidden))
    else:
        # The sparse trainers save their tables here to evaluate: none from an earlier run.
        for old in glob.glob(os.path.join(data, f"{model}-saved-*")):
            shutil.rmtree(old, ignore_errors=True)
    cmd = [py, os.path.join(a.harness, "bench_launch.py"), "--python", py, "--model", model,
           "--epochs", str(epochs), "--data-dir", data, "--logdir", logdir, "--out", out,
           "--timeout", str(a.timeout), "--batch", str(batch), "--script", os.path.join(PEER, script)]
    if fluid18:
        cmd += ["--with-gloo", "0"]
    cmd += ["--local"] if mode == "local" else ["--mode", mode]
    gen_cpu = gen_data_cpu(a, py, data, 1 if mode == "local" else 2, model)
    cpu0 = children_cpu()
    subprocess.run(netns(a, cmd, net_file), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=a.timeout + 120, env=env)
    orphans = reap_orphans()
    cpu = children_cpu() - cpu0 - gen_cpu
    try:
        r = json.load(open(out))
    except (OSError, ValueError):
        return {"error": "no result"}
    if r.get("outcome") != "ok" or "samples_per_s" not in r:
        return {"error": r.get("outcome", "failed")}
    exits = [t for t, who, what in r["log"] if who.startswith("trainer") and what.startswith("exited")]
    samples = r.get("samples_total") or SAMPLES * epochs
    w = paddle_windows(r, samples)
    if "error" in w:
        return w
    net = net_bytes(net_file)
    return dict(w, **{
        "cpu_1k": cpu / (samples / 1000),
        "net": net / samples if net is not None else None,
        "wall": max(exits) if exits else r["wall_s"],
        # The launcher's own figures, in the raw JSON only: its samples/s (the sum of
        # the slower trainer's epochs) and its spawn -> first step (the slower trainer's
        # ready plus one mean step, without the evaluation before it).
        "sps_harness": r["samples_per_s"],
        "first_harness": r.get("startup_to_first_step_s"),
        "gen_data_cpu": gen_cpu,
        # Processes of the run that outlived their parent (Paddle's gloo store), waited
        # for here so that their CPU counts.
        "orphans": orphans,
    })


def median(runs, key):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--harness", required=True)
    ap.add_argument("--edl", required=True)
    ap.add_argument("--paddle26", required=True)
    ap.add_argument("--paddle18", default="")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--rows", default="", help="only these rows, comma-separated (e.g. p26-async,edl-async-2)")
    ap.add_argument("--no-netns", dest="netns", action="store_false",
                    help="run without a network namespace per run (no bytes-per-sample figures)")
    a = ap.parse_args()
    if a.netns and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        log("no network namespaces here (unshare -n failed): no bytes-per-sample figures")
        a.netns = False

    become_subreaper()
    data, edl_dir = prepare_data(a)

    def edl_mlp(mode, trainers, tag, **kw):
        """An edl row of the mlp job, with the held-out set as its test split."""
        return run_edl(a, edl_dir, mode, trainers, tag, test=TEST_GLOB, **kw)

    w2v_dir, w2v_meta = w2v.prepare(a, data)
    per_sentence = w2v_meta["pairs_per_sentence"]
    ctr_dir, ctr_meta = ctr.prepare(a, data)
    # (name, system, mode, trainers, runner)
    rows = [
        ("p26-async", "Paddle 2.6.2", "async", 2, lambda t: run_paddle(a, a.paddle26, data, "async", t)),
        ("edl-async-2", "edl, adaptive (default)", "async", 2, lambda t: edl_mlp("async", 2, t)),
        ("edl-async-2-g1", "edl, 1 batch per push", "async", 2,
         lambda t: edl_mlp("async", 2, t, per_push=1)),
        # Tasks of one chunk (331 samples) instead of sized by samples (the default).
        ("edl-async-2-g1-c1", "edl, 1 batch per push, tasks of a chunk", "async", 2,
         lambda t: edl_mlp("async", 2, t, per_push=1, chunks=1)),
        ("edl-async-2-g4", "edl, 4 batches per push", "async", 2,
         lambda t: edl_mlp("async", 2, t, per_push=4)),
        ("edl-async-2-g13", "edl, 13 batches per push", "async", 2,
         lambda t: edl_mlp("async", 2, t, per_push=13)),
        ("p26-local", "Paddle 2.6.2", "local", 1, lambda t: run_paddle(a, a.paddle26, data, "local", t)),
        ("edl-async-1", "edl, adaptive (default)", "async", 1, lambda t: edl_mlp("async", 1, t)),
        ("edl-async-1-g1", "edl, 1 batch per push", "async", 1,
         lambda t: edl_mlp("async", 1, t, per_push=1)),
        # Tasks of a whole file (a few per pass: the per-task costs vanish), against the
        # default sizing: what tasks cost.
        ("edl-async-1-whole", "edl, tasks of a whole file", "async", 1,
         lambda t: edl_mlp("async", 1, t, chunks=100000)),
        ("edl-async-1-g4", "edl, 4 batches per push", "async", 1,
         lambda t: edl_mlp("async", 1, t, per_push=4)),
        ("edl-sync-2", "edl", "sync", 2, lambda t: edl_mlp("sync", 2, t)),
        # 15.7M dense parameters (784-3584-3584-10), one epoch: the parameter traffic
        # dominates (63 MB a push and a pull).
        ("p26-async-16m", "Paddle 2.6.2, 15.7M parameters", "async", 2,
         lambda t: run_paddle(a, a.paddle26, data, "async", t, hidden=WIDE, epochs=1)),
        ("edl-async-2-16m", "edl, 15.7M parameters", "async", 2,
         lambda t: edl_mlp("async", 2, t, hidden=WIDE, passes=1)),
        ("p26-local-16m", "Paddle 2.6.2, 15.7M parameters", "local", 1,
         lambda t: run_paddle(a, a.paddle26, data, "local", t, hidden=WIDE, epochs=1)),
        ("edl-async-1-16m", "edl, 15.7M parameters", "async", 1,
         lambda t: edl_mlp("async", 1, t, hidden=WIDE, passes=1)),
        # Sparse: skip-gram word2vec on PTB (scripts/peer/w2v.py); samples are pairs.
        ("p26-w2v", "Paddle 2.6.2, word2vec", "async", 2,
         lambda t: run_paddle(a, a.paddle26, data, "async", t, model="w2v", script="ps_w2v.py",
                              epochs=w2v.EPOCHS, batch=w2v_meta["batch_pairs"])),
        ("edl-w2v", "edl, word2vec", "async", 2,
         lambda t: run_edl_spec(a, w2v.edl_spec(w2v_dir, w2v_meta, 2, "adaptive"), t, per_sentence)),
        ("edl-w2v-g1", "edl, word2vec, 1 batch per push", "async", 2,
         lambda t: run_edl_spec(a, w2v.edl_spec(w2v_dir, w2v_meta, 2, 1), t, per_sentence)),
        ("edl-w2v-g4", "edl, word2vec, 4 batches per push", "async", 2,
         lambda t: run_edl_spec(a, w2v.edl_spec(w2v_dir, w2v_meta, 2, 4), t, per_sentence)),
        # Sparse and dense: CTR-DNN on synthetic clicks (scripts/peer/ctr.py).
        ("p26-ctr", "Paddle 2.6.2, CTR-DNN", "async", 2,
         lambda t: run_paddle(a, a.paddle26, data, "async", t, model="ctr", script="ps_ctr.py",
                              epochs=ctr.EPOCHS, batch=ctr.BATCH)),
        ("edl-ctr", "edl, CTR-DNN", "async", 2,
         lambda t: run_edl_spec(a, ctr.edl_spec(ctr_dir, ctr_meta, 2, "adaptive"), t)),
        ("edl-ctr-g4", "edl, CTR-DNN, 4 batches per push", "async", 2,
         lambda t: run_edl_spec(a, ctr.edl_spec(ctr_dir, ctr_meta, 2, 4), t)),
        # Two replicas of the shard (docs/replication.md): what they cost a job.
        ("edl-async-2-r2", "edl, 2 replicas", "async", 2,
         lambda t: edl_mlp("async", 2, t, replicas=2)),
        ("edl-sync-2-r2", "edl, 2 replicas", "sync", 2,
         lambda t: edl_mlp("sync", 2, t, replicas=2)),
    ]
    if a.paddle18:
        rows += [
            ("p18-sync", "Paddle 1.8.5", "sync", 2,
             lambda t: run_paddle(a, a.paddle18, data, "sync", t, fluid18=True)),
            ("p18-async", "Paddle 1.8.5", "async", 2,
             lambda t: run_paddle(a, a.paddle18, data, "async", t, fluid18=True)),
        ]
    if a.rows:
        keep = a.rows.split(",")
        unknown = [k for k in keep if k not in [r[0] for r in rows]]
        if unknown:
            sys.exit(f"bench-peer: unknown rows {unknown}; rows: {', '.join(r[0] for r in rows)}")
        rows = [r for r in rows if r[0] in keep]
    results = {name: [] for name, *_ in rows}
    for rep in range(a.reps):
        for name, system, mode, trainers, runner in rows:
            log(f"round {rep + 1}/{a.reps}: {name}")
            r = runner(f"{name}-{rep}")
            if "error" in r:
                log(f"{name} failed: {r['error']}")
            else:
                log(f"{name}: {r['sps']:,.0f} samples/s, wall {r['wall']:.1f} s")
            results[name].append(r)

    med = {n: {k: median(rs, k) for k in ("sps", "spawn_sps", "cpu_1k", "net", "wall", "first", "loss", "acc")}
           for n, rs in results.items()}
    for n, rs in results.items():
        ok = [r for r in rs if "error" not in r]
        med[n]["splits"] = sorted({r.get("split") or "none" for r in ok})
        med[n]["evals"] = sorted({e for r in ok for e in r.get("evals", [])})
    # What is held to be equal: every row evaluated the held-out set; a Paddle row and
    # the edl rows compared with it made the same evaluations per trainer.
    problems = [f"{n}: evaluated the {'/'.join(m['splits'])} split, not the held-out (test) set"
                for n, m in med.items() if m["splits"] and m["splits"] != ["test"]]
    for p_row, e_rows in PAIRS:
        for e_row in e_rows:
            pe, ee = med.get(p_row, {}).get("evals"), med.get(e_row, {}).get("evals")
            if pe and ee and pe != ee:
                problems.append(f"{p_row} made {'/'.join(pe)} evaluations per trainer, {e_row} {'/'.join(ee)}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    out = []
    out.append(f"edl {commit}{' (with local changes)' if dirty else ''}, "
               f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores ({cpu}); "
               f"medians of {a.reps}; `scripts/bench-peer --reps {a.reps}`")
    out.append("")
    out.append("| system | mode | trainers | steady samples/s | from-spawn samples/s | CPU-s per 1k samples "
               "| bytes sent per sample | end-to-end wall s | spawn -> 1st step s | held-out loss "
               "| held-out accuracy | held-out evaluations per trainer (before 1st step + after) | runs ok |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, system, mode, trainers, _ in rows:
        m = med[name]
        ok = sum("error" not in r for r in results[name])
        out.append(f"| {system} | {mode} | {trainers} | {fmt(m['sps'], ',.0f')} | {fmt(m['spawn_sps'], ',.0f')} "
                   f"| {fmt(m['cpu_1k'], '.3f')} | {fmt(m['net'], ',.0f')} | {fmt(m['wall'], '.1f')} "
                   f"| {fmt(m['first'], '.2f')} | {fmt(m['loss'], '.4f')} | {fmt(m['acc'], '.4f')} "
                   f"| {' / '.join(m['evals']) or '—'} | {ok}/{len(results[name])} |")

    def ratio(a_, b_, key):
        x, y = med.get(a_, {}).get(key), med.get(b_, {}).get(key)
        return x / y if x and y else None

    def diff(a_, b_, key):
        x, y = med.get(a_, {}).get(key), med.get(b_, {}).get(key)
        return x - y if x is not None and y is not None else None

    targets = [
        # At equal held-out loss and accuracy (the same samples, the same evaluations).
        ("edl async 2 / Paddle 2.6.2 async, held-out loss", ratio("edl-async-2", "p26-async", "loss"), "<=", 1.0, ".3f"),
        ("edl async 2 - Paddle 2.6.2 async, held-out accuracy", diff("edl-async-2", "p26-async", "acc"), ">=", 0.0, "+.4f"),
        ("edl async 1 / Paddle 2.6.2 local, held-out loss", ratio("edl-async-1", "p26-local", "loss"), "<=", 1.0, ".3f"),
        ("edl async 1 - Paddle 2.6.2 local, held-out accuracy", diff("edl-async-1", "p26-local", "acc"), ">=", 0.0, "+.4f"),
        ("edl async 2 / Paddle 2.6.2 async, 15.7M parameters, held-out loss", ratio("edl-async-2-16m", "p26-async-16m", "loss"), "<=", 1.0, ".3f"),
        ("edl async 2 - Paddle 2.6.2 async, 15.7M parameters, held-out accuracy", diff("edl-async-2-16m", "p26-async-16m", "acc"), ">=", 0.0, "+.4f"),
        ("edl async 1 / Paddle 2.6.2 local, 15.7M parameters, held-out loss", ratio("edl-async-1-16m", "p26-local-16m", "loss"), "<=", 1.0, ".3f"),
        ("edl async 1 - Paddle 2.6.2 local, 15.7M parameters, held-out accuracy", diff("edl-async-1-16m", "p26-local-16m", "acc"), ">=", 0.0, "+.4f"),
        ("edl / Paddle 2.6.2 async, word2vec, held-out loss", ratio("edl-w2v", "p26-w2v", "loss"), "<=", 1.0, ".3f"),
        ("edl / Paddle 2.6.2 async, CTR-DNN, held-out loss", ratio("edl-ctr", "p26-ctr", "loss"), "<=", 1.0, ".3f"),
        ("edl - Paddle 2.6.2 async, CTR-DNN, held-out accuracy", diff("edl-ctr", "p26-ctr", "acc"), ">=", 0.0, "+.4f"),
        ("edl sync 2 / Paddle 1.8.5 sync, held-out loss", ratio("edl-sync-2", "p18-sync", "loss"), None, None, ".3f"),
        ("edl async 2 / Paddle 1.8.5 async, held-out loss", ratio("edl-async-2", "p18-async", "loss"), None, None, ".3f"),
        ("edl async 2 / Paddle 2.6.2 async, steady samples/s", ratio("edl-async-2", "p26-async", "sps"), ">=", 1.5),
        ("edl async 2, 1 per push / Paddle 2.6.2 async, steady samples/s", ratio("edl-async-2-g1", "p26-async", "sps"), None, None),
        ("edl async 2, 4 per push / Paddle 2.6.2 async, steady samples/s", ratio("edl-async-2-g4", "p26-async", "sps"), ">=", 1.5),
        ("edl async 2, 13 per push / Paddle 2.6.2 async (13 per send), steady samples/s", ratio("edl-async-2-g13", "p26-async", "sps"), ">=", 1.5),
        ("edl async 2 / Paddle 2.6.2 async, from-spawn samples/s", ratio("edl-async-2", "p26-async", "spawn_sps"), None, None),
        ("edl async 2 / Paddle 2.6.2 async, CPU-s per 1k samples", ratio("edl-async-2", "p26-async", "cpu_1k"), "<=", 0.7),
        ("edl async 2, 4 per push / Paddle 2.6.2 async, CPU-s per 1k samples", ratio("edl-async-2-g4", "p26-async", "cpu_1k"), "<=", 0.7),
        ("edl async 1 / Paddle 2.6.2 local, CPU-s per 1k samples", ratio("edl-async-1", "p26-local", "cpu_1k"), "<=", 0.7),
        ("edl async 1 / Paddle 2.6.2 local, steady samples/s", ratio("edl-async-1", "p26-local", "sps"), ">=", 1.2),
        ("edl async 1, 1 per push / Paddle 2.6.2 local, steady samples/s", ratio("edl-async-1-g1", "p26-local", "sps"), None, None),
        ("edl async 1 / the same with tasks of a whole file, steady samples/s", ratio("edl-async-1", "edl-async-1-whole", "sps"), ">=", 0.99),
        ("edl async 1, 4 per push / Paddle 2.6.2 local, steady samples/s", ratio("edl-async-1-g4", "p26-local", "sps"), ">=", 1.2),
        ("edl async 2 / Paddle 2.6.2 async, 15.7M parameters, steady samples/s", ratio("edl-async-2-16m", "p26-async-16m", "sps"), ">=", 1.5),
        ("edl async 2 / Paddle 2.6.2 async, 15.7M parameters, CPU-s per 1k samples", ratio("edl-async-2-16m", "p26-async-16m", "cpu_1k"), "<=", 0.7),
        ("edl async 1 / Paddle 2.6.2 local, 15.7M parameters, steady samples/s", ratio("edl-async-1-16m", "p26-local-16m", "sps"), ">=", 1.2),
        ("edl / Paddle 2.6.2 async, word2vec, steady pairs/s", ratio("edl-w2v", "p26-w2v", "sps"), ">=", 1.0),
        ("edl, 1 per push / Paddle 2.6.2 async, word2vec, steady pairs/s", ratio("edl-w2v-g1", "p26-w2v", "sps"), ">=", 1.0),
        ("edl, 4 per push / Paddle 2.6.2 async, word2vec, steady pairs/s", ratio("edl-w2v-g4", "p26-w2v", "sps"), ">=", 1.0),
        ("edl, 4 per push / Paddle 2.6.2 async, word2vec, bytes sent per pair", ratio("edl-w2v-g4", "p26-w2v", "net"), None, None),
        ("edl / Paddle 2.6.2 async, word2vec, CPU-s per 1k pairs", ratio("edl-w2v", "p26-w2v", "cpu_1k"), "<=", 0.7),
        ("edl / Paddle 2.6.2 async, word2vec, bytes sent per pair", ratio("edl-w2v", "p26-w2v", "net"), None, None),
        ("edl / Paddle 2.6.2 async, CTR-DNN, steady samples/s", ratio("edl-ctr", "p26-ctr", "sps"), ">=", 1.0),
        ("edl, 4 per push / Paddle 2.6.2 async, CTR-DNN, steady samples/s", ratio("edl-ctr-g4", "p26-ctr", "sps"), ">=", 1.0),
        ("edl / Paddle 2.6.2 async, CTR-DNN, CPU-s per 1k samples", ratio("edl-ctr", "p26-ctr", "cpu_1k"), "<=", 0.7),
        ("edl / Paddle 2.6.2 async, CTR-DNN, bytes sent per sample", ratio("edl-ctr", "p26-ctr", "net"), None, None),
        ("edl sync 2 / Paddle 1.8.5 sync, steady samples/s", ratio("edl-sync-2", "p18-sync", "sps"), ">=", 3.0),
        ("edl async 2 / Paddle 1.8.5 async, steady samples/s", ratio("edl-async-2", "p18-async", "sps"), None, None),
        ("edl async 2 / Paddle 2.6.2 async, end-to-end wall", ratio("edl-async-2", "p26-async", "wall"), "<=", 0.5),
        ("edl async 2, 4 per push / Paddle 2.6.2 async, end-to-end wall", ratio("edl-async-2-g4", "p26-async", "wall"), "<=", 0.5),
        ("edl async 2, 2 replicas / 1 replica, steady samples/s", ratio("edl-async-2-r2", "edl-async-2", "sps"), ">=", 0.85),
        ("edl sync 2, 2 replicas / 1 replica, steady samples/s", ratio("edl-sync-2-r2", "edl-sync-2", "sps"), ">=", 0.85),
    ]
    out.append("")
    out.append("| same-run ratio | value | target | met |")
    out.append("|---|---|---|---|")
    # Only the ratios whose rows ran (--rows).
    targets = [t for t in targets if t[1] is not None]
    for label, v, op, goal, *spec in targets:
        met = "" if v is None or goal is None else ("yes" if (v >= goal if op == ">=" else v <= goal) else "no")
        out.append(f"| {label} | {fmt(v, spec[0] if spec else '.2f')} | {'' if goal is None else f'{op} {goal}'} | {met} |")
    if problems:
        out.append("")
        out.append("**Not comparable** (the windows or the figures do not hold the same work):")
        out += [f"- {p}" for p in problems]
    text = "\n".join(out)
    print(text)
    path = os.path.join(a.work, "results.md")
    with open(path, "w") as f:
        f.write(text + "\n\n" + json.dumps(results, indent=1) + "\n")
    log(f"raw figures: {path}")
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
