"""The GPU check, run on the GPU machine from the folder `scripts/gpu-check` made
(docs/gpu.md): needs Python with PyTorch and NumPy, no network, no Rust.

Runs, on the GPU and against a plain single-process PyTorch loop of the same CNN on the
same GPU (the ceiling):
  - edl's MNIST CNN (examples/mnist/cnn.toml: two trainers, one pserver, async Adam) at
    batch 32 and 256, on the GPU, and at batch 32 on the CPU;
  - the same on the GPU with one trainer SIGKILLed mid-job (lost records, recovery);
  - the PyTorch example (examples/pytorch_mnist) with its trainers on the GPU;
  - the plain PyTorch loop at batch 32 and 256;
  - edl's own single-process loop of the CNN (`edl bench local`) at batch 32 and 256.
Prints one table (also results.md) and writes results.json. Exit status 1 when a job
failed or lost records; the speed goals are reported, not enforced.

  ./run [--passes N] [--cpu-passes N] [--quick]    (./run sets PATH, PYTHONPATH, ...)
  EDL_GPU_CHECK_DEVICE=cpu ./run --quick           the same steps on the CPU (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def spec(template: Path, out: Path, **train: object) -> Path:
    """`template` with `[train]` keys replaced (passes, batch_size) and `[cluster]`'s."""
    text = template.read_text()
    for key, value in train.items():
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        if n != 1:
            raise SystemExit(f"{template}: no single `{key} =` line to set")
    out.write_text(text)
    return out


JOB_TIMEOUT = "10m"


def edl_run(name: str, job: Path, device: str, extra=()) -> dict:
    """`edl run job --device device`, its report, and the trainers' figures."""
    run_dir = HERE / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    report = HERE / "runs" / f"{name}.json"
    cmd = ["edl", "run", str(job), "--device", device, "--quiet", "--run-dir", str(run_dir),
           "--report", str(report), "--timeout", JOB_TIMEOUT, *extra]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if p.returncode != 0 or not report.exists():
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        return {"name": name, "ok": False, "wall_s": wall, "error": f"exit {p.returncode}"}
    r = json.loads(report.read_text())
    trainers = [json.loads(t.read_text()) for t in sorted(run_dir.glob("trainer-*.json"))]
    first = [t["first_step_unix_s"] for t in trainers if t.get("first_step_unix_s")]
    last = [t["last_step_unix_s"] for t in trainers if t.get("last_step_unix_s")]
    records = r["records_trained"]
    steps_s = (max(last) - min(first)) if first and last else float("nan")
    metric = r.get("final_metric") or {}
    return {
        "name": name,
        "ok": bool(r["succeeded"]),
        "device": sorted({t["device"] for t in trainers}),
        "records": records,
        "lost": r["lost_records"],
        "recomputed": r["recomputed_records"],
        "steps_per_s": records / steps_s if steps_s > 0 else float("nan"),
        "records_per_wall_s": records / r["wall_s"],
        "wall_s": r["wall_s"],
        "accuracy": metric.get("value"),
        "recoveries": [x["seconds"] for x in r.get("recoveries", [])],
    }


def plain(batch: int, passes: int, device: str) -> dict:
    """The plain PyTorch loop (plain_cnn.py) in a process of its own."""
    cmd = [sys.executable, str(HERE / "plain_cnn.py"), "--data", str(DATA), "--batch",
           str(batch), "--passes", str(passes), "--device", device]
    print(f"== plain PyTorch, batch {batch}: {' '.join(cmd[1:])}", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        return {"name": f"plain PyTorch, batch {batch}", "ok": False, "error": "see above"}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r.update(name=f"plain PyTorch, batch {batch}", ok=True, lost=0)
    return r


def local(batch: int, passes: int, device: str, cnn: Path) -> dict:
    """edl's own single-process loop of the CNN (`edl bench local`): no etcd, master or
    pserver, the parameters uploaded and the gradients downloaded each step as a
    trainer does; it splits the model's step on the device from the job's machinery."""
    name = f"edl single-process loop, batch {batch}"
    out = HERE / "runs" / f"local-{batch}-{device.replace(':', '')}.json"
    cmd = ["edl", "bench", "local", str(cnn), "--batch", str(batch), "--passes", str(passes),
           "--device", device, "--json", str(out)]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 or not out.exists():
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        return {"name": name, "ok": False, "error": f"exit {p.returncode}"}
    r = json.loads(out.read_text())[0]
    print(f"   per step: prepare {r['prepare_us']:.0f} us, forward+backward "
          f"{r['forward_backward_us']:.0f} us, update {r['update_us']:.0f} us; apart: "
          f"forward {r['forward_only_us']:.0f} us, forward+backward "
          f"{r['forward_backward_only_us']:.0f} us", flush=True)
    return {"name": name, "ok": True, "device": r["device"], "lost": 0,
            "steps_per_s": r["samples_per_s"], "accuracy": r["metric"], **r}


def cell(x: object, fmt: str = "{:,.0f}") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return fmt.format(x) if isinstance(x, (int, float)) else str(x)


def table(rows: list) -> str:
    out = ["| run | device | samples/s (steps) | records / wall s | wall s | accuracy | lost "
           "| recovery s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            out.append(f"| {r['name']} | FAILED ({r.get('error', '')}) | | | | | | |")
            continue
        dev = ",".join(r["device"]) if isinstance(r.get("device"), list) else r.get("device")
        rec = ", ".join(f"{s:.1f}" for s in r.get("recoveries", [])) or "-"
        out.append(f"| {r['name']} | {dev} | {cell(r.get('steps_per_s'))} | "
                   f"{cell(r.get('records_per_wall_s'))} | {cell(r.get('wall_s'), '{:.1f}')} | "
                   f"{cell(r.get('accuracy'), '{:.4f}')} | {cell(r.get('lost'))} | {rec} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=60, help="passes of the GPU jobs")
    ap.add_argument("--cpu-passes", type=int, default=10, help="passes of the CPU job")
    ap.add_argument("--quick", action="store_true", help="3 passes each (a smoke test)")
    ap.add_argument("--job-timeout", default="10m",
                    help="each edl job's --timeout (a hung job fails its row, not the check)")
    args = ap.parse_args()
    global JOB_TIMEOUT
    JOB_TIMEOUT = args.job_timeout
    if args.quick:
        args.passes = args.cpu_passes = 3
    gpu = os.environ.get("EDL_GPU_CHECK_DEVICE", "cuda:0")

    import torch

    if gpu.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: PyTorch sees no GPU here (torch.cuda.is_available() is False); "
              "EDL_GPU_CHECK_DEVICE=cpu runs the same steps on the CPU", file=sys.stderr)
        return 1
    if gpu.startswith("cuda"):
        print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}", flush=True)
    (HERE / "runs").mkdir(exist_ok=True)
    ex = HERE / "examples"
    cnn = ex / "mnist" / "cnn.toml"
    jobs = ex / "mnist"
    steps = [
        lambda: plain(32, args.passes, gpu),
        lambda: plain(256, args.passes, gpu),
        lambda: local(32, max(args.passes // 10, 1), gpu, cnn),
        lambda: local(256, max(args.passes // 10, 1), gpu, cnn),
        lambda: edl_run("edl CNN, 2 trainers, batch 32",
                        spec(cnn, jobs / "b32.toml", passes=args.passes, batch_size=32), gpu),
        lambda: edl_run("edl CNN, 2 trainers, batch 256",
                        spec(cnn, jobs / "b256.toml", passes=args.passes, batch_size=256), gpu),
        lambda: edl_run("edl CNN, 2 trainers, batch 32, CPU",
                        spec(cnn, jobs / "cpu.toml", passes=args.cpu_passes, batch_size=32),
                        "cpu"),
        lambda: edl_run("edl CNN, batch 32, a trainer SIGKILLed",
                        spec(cnn, jobs / "kill.toml", passes=max(args.passes // 3, 10),
                             batch_size=32),
                        gpu, ["--chaos", "kill-trainer=4s,until=5s,seed=1"]),
        lambda: edl_run("PyTorch example (edl.torch), 2 trainers, batch 32",
                        ex / "pytorch_mnist" / "job.toml", gpu),
    ]
    rows = []
    for step in steps:
        rows.append(step())
        # What is done so far, in case the machine's time runs out before the rest.
        (HERE / "results.json").write_text(json.dumps(rows, indent=1))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    kill = next(r for r in rows if "SIGKILLed" in r["name"])
    if kill.get("ok") and not kill.get("recoveries"):
        kill.update(ok=False, error="no trainer was killed and recovered (the job ended first?)")
    by = {r["name"]: r for r in rows}
    ratios = []
    for b, goal in ((32, 1.0), (256, 0.5)):
        e, p = by[f"edl CNN, 2 trainers, batch {b}"], by[f"plain PyTorch, batch {b}"]
        if e.get("ok") and p.get("ok"):
            x = e["steps_per_s"] / p["steps_per_s"]
            ratios.append(f"edl's two trainers / plain PyTorch at batch {b}: {x:.2f}x "
                          f"(goal >= {goal}x: {'met' if x >= goal else 'not met'})")
    text = table(rows) + "\n\n" + "\n".join(ratios) + "\n"
    print("\n" + text)
    (HERE / "results.md").write_text(text)
    (HERE / "results.json").write_text(json.dumps(rows, indent=1))
    bad = [r["name"] for r in rows if not r.get("ok") or r.get("lost")]
    if bad:
        print(f"gpu-check: failed or lost records: {bad}", file=sys.stderr)
        return 1
    return 0


DATA = HERE / "examples" / "data" / "mnist_5k.csv.gz"

if __name__ == "__main__":
    sys.exit(main())
