"""The CPU path's ratios (docs/benchmarks.md, "A trainer alone"), in one sitting: edl async
with 1 trainer against edl's own single-process loop (`cargo bench -p edl-trainer --bench
local_throughput -- mnist_mlp 30 64 sgd`: the same 784-256-10 MLP, plain SGD, batch 64,
one core), and 2 trainers with 1 and with 2 pserver replicas; with --before, another
build's rows beside them. Rows are interleaved, --reps rounds; medians. The job is
scripts/bench-peer's MLP without its held-out split (no evaluation between passes), on its
data in target/peer-paddle/edl: run scripts/bench-peer once first. Standard library only.

    python3 scripts/bench_cpu_path.py --edl "$(scripts/target-dir)/release/edl" [--before OLD_EDL] [--reps 3]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import edl_runs  # noqa: E402


def local_loop():
    """Samples/s of the single-process loop (cargo builds the bench once)."""
    out = subprocess.run(
        ["cargo", "bench", "-q", "-p", "edl-trainer", "--bench", "local_throughput", "--",
         "mnist_mlp", "30", "64", "sgd"],
        capture_output=True, text=True, check=True).stdout
    m = re.search(r"(\d+) samples/s", out)
    if not m:
        sys.exit(f"bench_cpu_path: no samples/s in the local loop's output:\n{out}")
    return {"sps": float(m.group(1))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edl", required=True, help="the edl binary measured")
    p.add_argument("--before", help="another edl binary, measured beside it")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work", default="target/peer-paddle")
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args()
    data = os.path.join(a.work, "edl")
    if not os.path.exists(os.path.join(data, "mlp-00000-of-00001.recordio")):
        sys.exit(f"bench_cpu_path: no data in {data}: run scripts/bench-peer once first")
    a.netns = False
    builds = [("this", a.edl)] + ([("before", a.before)] if a.before else [])
    rows = {}

    def run(tag, edl, trainers, replicas):
        a.edl = edl
        spec = edl_runs.edl_spec(data, "async", trainers, replicas=replicas)
        r = edl_runs.run_edl_spec(a, spec, f"cpu-path-{tag}-{trainers}-r{replicas}")
        if "error" in r:
            sys.exit(f"bench_cpu_path: {tag} build, {trainers} trainers: {r['error']}")
        return r

    for rep in range(a.reps):
        for tag, edl in builds:
            for name, trainers, replicas in [("1 trainer", 1, 1), ("2 trainers", 2, 1),
                                             ("2 trainers, 2 replicas", 2, 2)]:
                key = f"{tag}: {name}"
                rows.setdefault(key, []).append(run(tag, edl, trainers, replicas))
                print(f"round {rep + 1}: {key}: {rows[key][-1]['sps']:,.0f} samples/s",
                      file=sys.stderr)
        rows.setdefault("the single-process loop", []).append(local_loop())
        print(f"round {rep + 1}: the local loop: {rows['the single-process loop'][-1]['sps']:,.0f}"
              " samples/s", file=sys.stderr)

    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0] if isinstance(v[0][f], float)}
           for k, v in rows.items()}
    print("| row | steady samples/s (each round) | median | CPU-s per 1k samples | final loss | accuracy |")
    print("|---|---|---|---|---|---|")
    for k, v in rows.items():
        m = med[k]
        each = " / ".join(f"{r['sps']:,.0f}" for r in v)
        cpu = f"{m['cpu_1k']:.4f}" if "cpu_1k" in m else ""
        loss = f"{m['loss']:.4f}" if "loss" in m else ""
        acc = f"{m['acc']:.4f}" if "acc" in m else ""
        print(f"| {k} | {each} | {m['sps']:,.0f} | {cpu} | {loss} | {acc} |")
    local = med["the single-process loop"]["sps"]
    print()
    print("| ratio (medians) | value |")
    print("|---|---|")
    for tag, _ in builds:
        one = med[f"{tag}: 1 trainer"]["sps"]
        r1 = med[f"{tag}: 2 trainers"]["sps"]
        r2 = med[f"{tag}: 2 trainers, 2 replicas"]["sps"]
        print(f"| {tag}: 1 trainer / the single-process loop | {one / local:.3f} |")
        print(f"| {tag}: 2 replicas / 1 replica (2 trainers) | {r2 / r1:.3f} |")
    print(json.dumps(med), file=sys.stderr)


if __name__ == "__main__":
    main()
