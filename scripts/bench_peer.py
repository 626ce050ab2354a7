#!/usr/bin/env python3
"""The side-by-side of edl and PaddlePaddle on one job, in one sitting (run by
scripts/bench-peer, which installs what it needs; see docs/benchmarks.md).

The job (the harness's "mlp"): 784-256-10 MLP, softmax cross-entropy, 60,000 synthetic
samples (gen_data.py, seed 2024), plain SGD lr 0.05, batch 64, 3 epochs, one pserver on
loopback; weights start from Xavier's bound in both (Paddle's fc default; edl's
`init = "xavier"`). The wide rows (`-16m`) train 784-3584-3584-10 (15.7M parameters,
the most Paddle's pserver takes in one push) for one epoch. Paddle runs under the harness's launcher (bench_launch.py); edl runs `edl run`
on a private etcd, with the same samples converted to RecordIO. The async edl rows run
with the default (`batches_per_push = "adaptive"`: as many batches per push as were
computed during the previous push's round trip, up to 16), and with
`batches_per_push = 1`, 4 and 13 (the summed gradients of N batches per push). Paddle 2.6.2's async mode (its `a_sync` DownpourLite
communicator) merges up to 13 queued gradients per send
(`FLAGS_pserver_push_dense_merge_limit = 12`, polled every 10 ms);
`communicator_max_merge_var_num` is used only in its GEO and heter modes.

Figures per run:
- steady samples/s: samples trained / the training time, startup excluded. Paddle: the
  harness's (the sum of the epochs' walls of the slower trainer). edl: from the first
  trainer's first step to the last trainer's last step (the trainers' reports), so it
  also counts the waits between passes;
- end-to-end wall: from spawning the job to its last trainer's exit (Paddle's pserver
  never exits; edl's wall also includes starting etcd and the final evaluation);
- from-spawn samples/s: samples trained / (spawn -> the last trainer's last step), so
  startup and data loading count (Paddle: its last trainer's `done` event; it also
  evaluates each epoch, as edl evaluates at pass ends);
- CPU-s per 1,000 samples: the user+system CPU of every process of the run (the
  launcher or `edl run` and every process it waited for: trainers, pservers, master,
  etcd), over the samples trained; startup included for both;
- spawn -> first step: from spawning to the first gradient step;
- final loss: mean cross-entropy of the final parameters on all 60,000 samples (Paddle:
  the harness's numpy loss on each trainer's shard, averaged); accuracy likewise (edl
  only: the harness does not compute Paddle's).

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
from edl_runs import children_cpu, edl_spec, net_bytes, netns, run_edl, run_edl_spec  # noqa: E402,F401

EPOCHS = 3
SAMPLES = 60_000
# The hidden widths of the wide dense rows: 15.7M parameters, the most Paddle 2.6.2's
# pserver takes in one push (62.8 MB; brpc's 64 MiB limit, scripts/peer/ps_wide.py).
WIDE = (3584, 3584)


def log(msg):
    print(f"bench-peer: {msg}", file=sys.stderr, flush=True)


def prepare_data(a):
    """The harness's data (npz + Paddle text) and the same samples as edl RecordIO."""
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
    return data, edl_dir


def run_paddle(a, py, data, mode, tag, fluid18=False, hidden=None, epochs=EPOCHS, model="mlp",
               script=None, batch=64):
    logdir = os.path.join(a.work, "runs", tag)
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir, exist_ok=True)
    out = os.path.join(logdir, "result.json")
    net_file = logdir + ".net"
    cmd = [py, os.path.join(a.harness, "bench_launch.py"), "--python", py, "--model", model,
           "--epochs", str(epochs), "--data-dir", data, "--logdir", logdir, "--out", out,
           "--timeout", str(a.timeout), "--batch", str(batch)]
    env = dict(os.environ, NET_FILE=net_file)
    if script:
        cmd += ["--script", os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer", script)]
        env.update(EDL_PEER_HARNESS=a.harness)
    if fluid18:
        cmd += ["--script", "ps_train_fluid18.py", "--with-gloo", "0"]
    if hidden:
        # The harness's trainer with a wider model (scripts/peer/ps_wide.py).
        cmd += ["--script", os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer", "ps_wide.py")]
        env.update(EDL_PEER_HARNESS=a.harness, EDL_PEER_HIDDEN=",".join(map(str, hidden)))
    cmd += ["--local"] if mode == "local" else ["--mode", mode]
    cpu0 = children_cpu()
    subprocess.run(netns(a, cmd, net_file), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=a.timeout + 120, env=env)
    cpu = children_cpu() - cpu0
    try:
        r = json.load(open(out))
    except (OSError, ValueError):
        return {"error": "no result"}
    if r.get("outcome") != "ok" or "samples_per_s" not in r:
        return {"error": r.get("outcome", "failed")}
    exits = [t for t, who, what in r["log"] if who.startswith("trainer") and what.startswith("exited")]
    dones = [e["rel"] for who, evs in r.get("events", {}).items() if who.startswith("trainer")
             for e in evs if e.get("ev") == "done"]
    samples = r.get("samples_total") or SAMPLES * epochs
    net = net_bytes(net_file)
    # The held-out accuracy, where the trainer script computes one (ps_ctr.py).
    accs = [e.get("eval_accuracy") for who, evs in r.get("events", {}).items() if who.startswith("trainer")
            for e in evs if e.get("ev") == "epoch" and e.get("eval_accuracy") is not None]
    return {
        "sps": r["samples_per_s"],
        "spawn_sps": samples / max(dones) if dones else None,
        "cpu_1k": cpu / (samples / 1000),
        "net": net / samples if net is not None else None,
        "wall": max(exits) if exits else r["wall_s"],
        "first": r.get("startup_to_first_step_s"),
        "loss": r.get("final_loss"),
        "acc": accs[-1] if accs else None,
    }


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

    data, edl_dir = prepare_data(a)
    w2v_dir, w2v_meta = w2v.prepare(a, data)
    per_sentence = w2v_meta["pairs_per_sentence"]
    ctr_dir, ctr_meta = ctr.prepare(a, data)
    # (name, system, mode, trainers, runner)
    rows = [
        ("p26-async", "Paddle 2.6.2", "async", 2, lambda t: run_paddle(a, a.paddle26, data, "async", t)),
        ("edl-async-2", "edl, adaptive (default)", "async", 2, lambda t: run_edl(a, edl_dir, "async", 2, t)),
        ("edl-async-2-g1", "edl, 1 batch per push", "async", 2,
         lambda t: run_edl(a, edl_dir, "async", 2, t, per_push=1)),
        # Tasks of one chunk (331 samples) instead of sized by samples (the default).
        ("edl-async-2-g1-c1", "edl, 1 batch per push, tasks of a chunk", "async", 2,
         lambda t: run_edl(a, edl_dir, "async", 2, t, per_push=1, chunks=1)),
        ("edl-async-2-g4", "edl, 4 batches per push", "async", 2,
         lambda t: run_edl(a, edl_dir, "async", 2, t, per_push=4)),
        ("edl-async-2-g13", "edl, 13 batches per push", "async", 2,
         lambda t: run_edl(a, edl_dir, "async", 2, t, per_push=13)),
        ("p26-local", "Paddle 2.6.2", "local", 1, lambda t: run_paddle(a, a.paddle26, data, "local", t)),
        ("edl-async-1", "edl, adaptive (default)", "async", 1, lambda t: run_edl(a, edl_dir, "async", 1, t)),
        ("edl-async-1-g1", "edl, 1 batch per push", "async", 1,
         lambda t: run_edl(a, edl_dir, "async", 1, t, per_push=1)),
        # Tasks of a whole file (a few per pass: the per-task costs vanish), against the
        # default sizing: what tasks cost.
        ("edl-async-1-whole", "edl, tasks of a whole file", "async", 1,
         lambda t: run_edl(a, edl_dir, "async", 1, t, chunks=100000)),
        ("edl-async-1-g4", "edl, 4 batches per push", "async", 1,
         lambda t: run_edl(a, edl_dir, "async", 1, t, per_push=4)),
        ("edl-sync-2", "edl", "sync", 2, lambda t: run_edl(a, edl_dir, "sync", 2, t)),
        # 15.7M dense parameters (784-3584-3584-10), one epoch: the parameter traffic
        # dominates (63 MB a push and a pull).
        ("p26-async-16m", "Paddle 2.6.2, 15.7M parameters", "async", 2,
         lambda t: run_paddle(a, a.paddle26, data, "async", t, hidden=WIDE, epochs=1)),
        ("edl-async-2-16m", "edl, 15.7M parameters", "async", 2,
         lambda t: run_edl(a, edl_dir, "async", 2, t, hidden=WIDE, passes=1)),
        ("p26-local-16m", "Paddle 2.6.2, 15.7M parameters", "local", 1,
         lambda t: run_paddle(a, a.paddle26, data, "local", t, hidden=WIDE, epochs=1)),
        ("edl-async-1-16m", "edl, 15.7M parameters", "async", 1,
         lambda t: run_edl(a, edl_dir, "async", 1, t, hidden=WIDE, passes=1)),
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
         lambda t: run_edl(a, edl_dir, "async", 2, t, replicas=2)),
        ("edl-sync-2-r2", "edl, 2 replicas", "sync", 2,
         lambda t: run_edl(a, edl_dir, "sync", 2, t, replicas=2)),
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
               "| bytes sent per sample | end-to-end wall s | spawn -> 1st step s | final loss | accuracy | runs ok |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, system, mode, trainers, _ in rows:
        m = med[name]
        ok = sum("error" not in r for r in results[name])
        out.append(f"| {system} | {mode} | {trainers} | {fmt(m['sps'], ',.0f')} | {fmt(m['spawn_sps'], ',.0f')} "
                   f"| {fmt(m['cpu_1k'], '.3f')} | {fmt(m['net'], ',.0f')} | {fmt(m['wall'], '.1f')} "
                   f"| {fmt(m['first'], '.2f')} | {fmt(m['loss'], '.4f')} | {fmt(m['acc'], '.4f')} "
                   f"| {ok}/{len(results[name])} |")

    def ratio(a_, b_, key):
        x, y = med.get(a_, {}).get(key), med.get(b_, {}).get(key)
        return x / y if x and y else None

    targets = [
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
    for label, v, op, goal in targets:
        met = "" if v is None or goal is None else ("yes" if (v >= goal if op == ">=" else v <= goal) else "no")
        out.append(f"| {label} | {fmt(v, '.2f')} | {'' if goal is None else f'{op} {goal}'} | {met} |")
    text = "\n".join(out)
    print(text)
    path = os.path.join(a.work, "results.md")
    with open(path, "w") as f:
        f.write(text + "\n\n" + json.dumps(results, indent=1) + "\n")
    log(f"raw figures: {path}")


if __name__ == "__main__":
    main()
