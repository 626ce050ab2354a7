#!/usr/bin/env python3
"""Object storage against local files, in one sitting (run by scripts/bench-storage).

An S3 server on loopback (edl-s3-server: s3s-fs, the one the tests run) with its data
directory on the same disk as the local files. Measured, each row --reps times,
interleaved (a round of every row, then the next), medians shown:

- read: a ~1 GiB RecordIO dataset (copies of the job's shards) read whole and checked
  by `edl data verify`, from local files and from `s3://` (ranged reads of 8 MiB):
  MB/s = bytes / wall seconds. Both sides read from the page cache after the first
  round (the machine has the memory): this compares the read paths, not disks.
- write: `edl data put` of that dataset (MB/s), once.
- job: scripts/bench-peer's job (784-256-10 MLP, 60,000 samples, SGD lr 0.05, batch 64,
  3 epochs, async, one pserver, two trainers) with its data local, on `s3://`, and with
  data and checkpoints on `s3://`: steady samples/s (samples / first step to last step),
  as bench-peer measures it.
- job, the store elsewhere: the same job with its data local and on `s3://`, the job's
  processes on CPU 0 only and the S3 server on CPU 1 only, so that the store's work is
  not taken from the job's CPU (as with a store on other machines); both on one CPU.
- checkpoints: the 15.7M-parameter MLP of bench-peer (784-3584-3584-10) for one epoch
  of a quarter of the data with a checkpoint every 2 s, to local disk and to `s3://`:
  the median time to write one checkpoint file (the pserver's log, `checkpoint file
  written ... took`: encoding, then fsync and rename, or the PUT), its size, and the
  job's steady samples/s.

The S3 server runs on this machine, so in the rows that share the CPUs its work is taken
from the job's: a remote store's would not be (the server's share is printed). The rows
with the store elsewhere pin them apart. edl-s3-server reads GET bodies in 1 MiB blocks
to keep its share small.
"""

import argparse
import glob
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from edl_runs import edl_spec, run_edl_spec  # noqa: E402

SAMPLES = 60_000
FEATURES = 784
ACCESS, SECRET = "edl-bench", "edl-bench-secret"


def log(msg):
    print(f"bench-storage: {msg}", file=sys.stderr, flush=True)


def make_data(a):
    """bench-peer's job shape: 60,000 samples of 784 features, 10 classes (each class
    shifts its own tenth of the features), as RecordIO shards in WORK/mlp."""
    out = os.path.join(a.work, "mlp")
    done = os.path.join(out, "DONE-v1")
    if os.path.exists(done):
        return out
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    log("writing the samples (once)")
    rng = random.Random(2024)
    csv = os.path.join(a.work, "mlp.csv")
    with open(csv, "w") as f:
        for _ in range(SAMPLES):
            c = rng.randrange(10)
            lo = c * FEATURES // 10
            hi = lo + FEATURES // 10
            row = [rng.random() + (1.0 if lo <= j < hi else 0.0) for j in range(FEATURES)]
            f.write(",".join("%.4f" % v for v in row) + ",%d\n" % c)
    subprocess.run([a.edl, "data", "convert", "--format", "csv", "--label", "class",
                    "--prefix", "mlp", "--shards", "4", "--out", out, csv], check=True,
                   stdout=subprocess.DEVNULL)
    os.remove(csv)
    open(done, "w").write("ok\n")
    return out


def make_big(a, mlp):
    """~1 GiB: copies of the job's shards."""
    big = os.path.join(a.work, "big")
    shards = sorted(glob.glob(os.path.join(mlp, "*.recordio")))
    size = sum(os.path.getsize(s) for s in shards)
    copies = max(1, -(-int(a.gib * 2**30) // size))
    shutil.rmtree(big, ignore_errors=True)
    os.makedirs(big)
    n = 0
    for c in range(copies):
        for s in shards:
            shutil.copyfile(s, os.path.join(big, f"part-{n:04d}.recordio"))
            n += 1
    return big, sum(os.path.getsize(p) for p in glob.glob(os.path.join(big, "*.recordio")))


def start_s3(a):
    root = os.path.join(a.work, "s3")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(root, "bench"))
    p = subprocess.Popen([a.s3_server, "--root", root, "--access-key", ACCESS,
                          "--secret-key", SECRET], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if not line.startswith("listening on "):
        p.kill()
        sys.exit(f"bench-storage: edl-s3-server did not start: {line!r}")
    endpoint = "http://" + line.split()[-1]
    os.environ.update({"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET,
                       "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
                       "AWS_ALLOW_HTTP": "true"})
    return p


def cpu_seconds(pid):
    """User+system CPU seconds process `pid` has used so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid, cpus):
    """Runs every thread of process `pid` on `cpus` (a taskset list) from now on."""
    subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True,
                   stdout=subprocess.DEVNULL)


def timed(cmd):
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.time() - t0


def spec_variant(path, tag, data=None, checkpoints=None, every=None, passes=None):
    """A copy of a bench-peer spec with its data, checkpoint place and period changed."""
    text = open(path).read()
    text = re.sub(r'^name = "([^"]*)"', lambda m: f'name = "{m.group(1)}-{tag}"', text, flags=re.M)
    if data:
        text = text.replace('train = "mlp-*.recordio"', f'train = "{data}"')
    if passes:
        text = re.sub(r"^passes = \d+", f"passes = {passes}", text, flags=re.M)
    extra = ""
    if every:
        extra += f'checkpoint_every = "{every}"\n'
    if checkpoints:
        extra += f'checkpoint_dir = "{checkpoints}"\n'
    text = text.replace("[cluster]\n", "[cluster]\n" + extra)
    out = path.replace(".toml", f"-{tag}.toml")
    open(out, "w").write(text)
    return out


def checkpoint_times(a, tag):
    """(seconds, bytes) of each checkpoint file the run's pserver wrote."""
    out = []
    for f in glob.glob(os.path.join(a.work, "runs", tag, "logs", "pserver-*.log")):
        for line in open(f, errors="replace"):
            if "checkpoint file written" not in line:
                continue
            took = re.search(r"took=([0-9.]+)(ms|s|µs|us)", line)
            size = re.search(r"bytes=(\d+)", line)
            if took and size:
                v, unit = float(took.group(1)), took.group(2)
                out.append((v / {"s": 1, "ms": 1e3}.get(unit, 1e6), int(size.group(1))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--edl", required=True)
    ap.add_argument("--s3-server", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the read dataset")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per job")
    a = ap.parse_args()
    a.netns = False
    os.makedirs(a.work, exist_ok=True)
    mlp = make_data(a)
    big, big_bytes = make_big(a, mlp)
    server = start_s3(a)
    try:
        put = timed([a.edl, "data", "put", big, "s3://bench/big/"])
        subprocess.run([a.edl, "data", "put", mlp, "s3://bench/mlp/"], check=True,
                       stdout=subprocess.DEVNULL)
        edl_dir = os.path.join(a.work, "edl")
        os.makedirs(edl_dir, exist_ok=True)
        for f in glob.glob(os.path.join(mlp, "*.recordio")):
            dst = os.path.join(edl_dir, os.path.basename(f))
            if not os.path.exists(dst):
                os.link(f, dst)
        base = edl_spec(edl_dir, "async", 2)
        wide = edl_spec(edl_dir, "async", 2, hidden=(3584, 3584), passes=1)
        s3_data = "s3://bench/mlp/mlp-*.recordio"
        one_shard = os.path.join(edl_dir, "mlp-00000-of-00004.recordio")
        s3_spec = spec_variant(base, "s3d", data=s3_data)
        # name: (spec, the job's CPUs (None: all, shared with the S3 server))
        jobs = {
            "job-local": (base, None),
            "job-s3-data": (s3_spec, None),
            "job-s3-all": (spec_variant(base, "s3a", data=s3_data, checkpoints="s3://bench/ckpt"), None),
            "apart-local": (base, "0"),
            "apart-s3-data": (s3_spec, "0"),
            # One shard of the data (15,000 samples): a checkpoint every 2 s for ~30 s.
            "ckpt-local": (spec_variant(wide, "ckl", data=one_shard, every="2s"), None),
            "ckpt-s3": (spec_variant(wide, "cks", data=one_shard, every="2s",
                                     checkpoints="s3://bench/ckpt"), None),
        }
        reads = {"read-local": os.path.join(big, "*.recordio"), "read-s3": "s3://bench/big/*.recordio"}
        results = {k: [] for k in list(reads) + list(jobs)}
        ckpts = {"ckpt-local": [], "ckpt-s3": []}
        server_share = {}
        for rep in range(a.reps):
            for name, glob_ in reads.items():
                secs = timed([a.edl, "data", "verify", glob_])
                results[name].append(big_bytes / secs / 1e6)
                log(f"round {rep + 1}: {name} {results[name][-1]:,.0f} MB/s")
            for name, (spec, cpus) in jobs.items():
                tag = f"{name}-{rep}"
                pin(server.pid, "1" if cpus else f"0-{os.cpu_count() - 1}")
                cpu0 = cpu_seconds(server.pid)
                r = run_edl_spec(a, spec, tag, cpus=cpus)
                if "error" in r:
                    sys.exit(f"bench-storage: {name}: {r['error']}")
                results[name].append(r["sps"])
                # The S3 server's share of this machine's CPU during the run.
                share = (cpu_seconds(server.pid) - cpu0) / (r["wall"] * os.cpu_count())
                server_share.setdefault(name, []).append(share)
                if name in ckpts:
                    ckpts[name].extend(checkpoint_times(a, tag))
                log(f"round {rep + 1}: {name} {r['sps']:,.0f} samples/s")
    finally:
        server.kill()
        server.wait()

    med = {k: statistics.median(v) for k, v in results.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"# bench-storage: commit {commit}, {time.strftime('%Y-%m-%d')}, {a.reps} rounds, "
          f"medians; {big_bytes / 2**30:.2f} GiB read dataset\n")
    print("| measure | local | s3:// (loopback S3 server) | s3 / local |")
    print("|---|---|---|---|")
    print(f"| read, `edl data verify` (MB/s) | {med['read-local']:,.0f} | {med['read-s3']:,.0f} | "
          f"{med['read-s3'] / med['read-local']:.2f} |")
    print(f"| write, `edl data put` (MB/s) | - | {big_bytes / put / 1e6:,.0f} | - |")
    print(f"| bench-peer job, data (steady samples/s) | {med['job-local']:,.0f} | "
          f"{med['job-s3-data']:,.0f} | {med['job-s3-data'] / med['job-local']:.2f} |")
    print(f"| bench-peer job, data and checkpoints (steady samples/s) | {med['job-local']:,.0f} | "
          f"{med['job-s3-all']:,.0f} | {med['job-s3-all'] / med['job-local']:.2f} |")
    print(f"| bench-peer job, data, the store elsewhere: job on CPU 0, S3 server on CPU 1 (steady samples/s) | "
          f"{med['apart-local']:,.0f} | {med['apart-s3-data']:,.0f} | "
          f"{med['apart-s3-data'] / med['apart-local']:.2f} |")
    for name in ckpts:
        if not ckpts[name]:
            sys.exit(f"bench-storage: no checkpoint written in the {name} runs")
    cl = statistics.median(t for t, _ in ckpts["ckpt-local"])
    cs = statistics.median(t for t, _ in ckpts["ckpt-s3"])
    size = statistics.median(b for _, b in ckpts["ckpt-s3"])
    print(f"| one checkpoint file, {size / 1e6:.1f} MB (seconds to write) | {cl:.3f} | {cs:.3f} | "
          f"{cs / cl:.2f} |")
    print(f"| 15.7M-parameter job, checkpoint every 2 s (steady samples/s) | {med['ckpt-local']:,.0f} | "
          f"{med['ckpt-s3']:,.0f} | {med['ckpt-s3'] / med['ckpt-local']:.2f} |")
    print(f"\ncheckpoint files timed: local {len(ckpts['ckpt-local'])}, s3 {len(ckpts['ckpt-s3'])}; "
          f"{os.cpu_count()} CPUs")
    print("the S3 server's share of the machine's CPU during each job (median): " + ", ".join(
        f"{k} {100 * statistics.median(v):.1f}%" for k, v in server_share.items()))
    json.dump({"results": results, "checkpoints": ckpts, "server_share": server_share}, open(os.path.join(a.work, "last.json"), "w"))


if __name__ == "__main__":
    main()
