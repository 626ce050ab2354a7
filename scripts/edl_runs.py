"""`edl run` jobs for the benchmark scripts: scripts/bench-peer's job spec, and one run
timed as bench-peer times it (steady samples/s from the trainers' reports, from-spawn
samples/s, CPU per 1,000 samples, bytes on the loopback of a network namespace, and
what was evaluated). Standard library only."""

import ctypes
import glob
import json
import os
import resource
import shutil
import subprocess
import time

EPOCHS = 3

def edl_spec(edl_dir, mode, trainers, per_push="adaptive", replicas=1, chunks=0, hidden=(256,),
             passes=EPOCHS, test=None):
    """The harness's mlp job as an edl spec in `edl_dir`; `test`: the glob of a test split
    there (then every trainer evaluates it before its first step and at every pass end,
    and `edl run` once more at the end), or None (no evaluation until `edl run`'s final
    one, on the training split)."""
    wide = "" if list(hidden) == [256] else "-h" + "x".join(map(str, hidden))
    held = "-t" if test else ""
    test_lines = f'test = "{test}"\n' if test else ""
    eval_batch = "eval_batch_size = 1024\n" if test else ""
    path = os.path.join(edl_dir, f"job-{mode}-{trainers}-{per_push}-r{replicas}-c{chunks}{wide}{held}.toml")
    with open(path, "w") as f:
        f.write(f"""# written by scripts/bench_peer.py: the harness's mlp job
name = "peer-mlp-{mode}-{trainers}-{per_push}-r{replicas}{wide}{held}"

[data]
train = "mlp-*.recordio"
{test_lines}chunks_per_task = {chunks}

[model]
kind = "mlp"
inputs = 784
hidden = {json.dumps(list(hidden))}
classes = 10
# Paddle's fc starts every layer from Xavier's bound: the same here.
init = "xavier"

[train]
mode = "{mode}"
passes = {passes}
batch_size = 64
optimizer = "sgd"
learning_rate = 0.05
batches_per_push = {json.dumps(per_push)}
{eval_batch}
[cluster]
masters = 1
pservers = 1
pserver_replicas = {replicas}
trainers = {trainers}
""")
    return path


def children_cpu():
    """User+system CPU seconds of every waited-for descendant so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


_SUBREAPER = False


def become_subreaper():
    """Makes this process the child subreaper of what it runs (Linux prctl): a process of
    a run whose parent exits first (Paddle's gloo store, forked by its pserver and killed
    by the launcher) is reparented here instead of to init, and `reap_orphans` waits for
    it, so that its CPU counts in `children_cpu`. Only for a caller whose children are
    all runs (not scripts/bench_storage.py's long-lived S3 server). Returns whether it
    took effect."""
    global _SUBREAPER
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _SUBREAPER = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        _SUBREAPER = False
    return _SUBREAPER


def reap_orphans(grace_s=2.0):
    """After a run: waits for its orphans (see `become_subreaper`), up to `grace_s` for
    one still exiting. Returns how many it waited for (None: not a subreaper)."""
    if not _SUBREAPER:
        return None
    end, reaped = time.time() + grace_s, 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid:
            reaped += 1
        elif time.time() > end:
            return reaped
        else:
            time.sleep(0.05)


def netns(a, cmd, net_file):
    """`cmd` in a network namespace of its own (when --netns): the loopback device there
    carries only this run's traffic, and its byte count is written to `net_file`."""
    if os.path.exists(net_file):
        os.remove(net_file)
    if not a.netns:
        return cmd
    return ["unshare", "-n", "sh", "-c",
            'ip link set lo up && "$@"; rc=$?; grep "lo:" /proc/net/dev > "$NET_FILE"; exit $rc',
            "sh"] + cmd


def net_bytes(net_file):
    """Bytes the run sent over its loopback (the namespace's own), or None."""
    try:
        fields = open(net_file).read().split(":", 1)[1].split()
        return int(fields[8])
    except (OSError, IndexError, ValueError):
        return None


def run_edl(a, edl_dir, mode, trainers, tag, per_push="adaptive", replicas=1, chunks=0,
            hidden=(256,), passes=EPOCHS, test=None):
    spec = edl_spec(edl_dir, mode, trainers, per_push, replicas, chunks, hidden, passes, test)
    return run_edl_spec(a, spec, tag)


def run_edl_spec(a, spec, tag, per_record=1.0, cpus=None):
    """`edl run SPEC`; samples are records times `per_record` (word2vec: pairs); with
    `cpus` (a taskset list, "0"), the job and every process it starts run on those only.

    The windows (bench-peer's, the same for Paddle's rows): from `edl run`'s spawn (t0),
    the first trainer's first step and the last trainer's last step (the trainers'
    reports). `evals`: per trainer, "I+N": I evaluations of the test split before its
    first step, N at pass ends; `split`: what `edl run`'s final evaluation used."""
    run_dir = os.path.join(a.work, "runs", tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    report = run_dir + ".report.json"
    net_file = run_dir + ".net"
    t0, cpu0 = time.time(), children_cpu()
    cmd = [a.edl, "run", spec, "--quiet", "--report", report, "--run-dir", run_dir]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus] + cmd
    p = subprocess.run(netns(a, cmd, net_file),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=a.timeout, env=dict(os.environ, NET_FILE=net_file))
    wall = time.time() - t0
    orphans = reap_orphans()
    cpu = children_cpu() - cpu0
    try:
        r = json.load(open(report))
    except (OSError, ValueError):
        return {"error": f"no report (exit {p.returncode}): {p.stderr.strip()[-300:]}"}
    if not r.get("succeeded"):
        return {"error": r.get("error", "failed")}
    trs = [json.load(open(f)) for f in glob.glob(os.path.join(run_dir, "trainer-*.json"))]
    firsts = [t["first_step_unix_s"] for t in trs if t.get("first_step_unix_s")]
    lasts = [t["last_step_unix_s"] for t in trs if t.get("last_step_unix_s")]
    if not firsts:
        return {"error": "no trainer report with steps"}
    m = r["final_metric"]
    samples = r["records_trained"] * per_record
    net = net_bytes(net_file)
    return {
        "sps": samples / max(max(lasts) - min(firsts), 1e-9),
        "spawn_sps": samples / max(max(lasts) - t0, 1e-9),
        "cpu_1k": cpu / (samples / 1000),
        "net": net / samples if net is not None else None,
        "wall": wall,
        "first": min(firsts) - t0,
        "loss": m.get("loss"),
        "acc": m["value"] if m["name"] == "accuracy" else None,
        "split": m.get("split"),
        "evals": sorted(f"{1 if t.get('initial_eval') else 0}+{len(t.get('evals') or [])}" for t in trs),
        # Processes of the run that outlived their parent, waited for here (their CPU counts).
        "orphans": orphans,
    }
