"""The ceiling of the GPU check: edl's MNIST CNN (trainer/src/dense.rs, `mnist_cnn`: 5x5
convolutions of 20 and 50 channels, each with ReLU and 2x2 max-pooling, then one linear
layer to 10 logits) trained by a plain single-process PyTorch loop with Adam (lr 0.001),
on the same data as edl's job (mnist_5k.csv.gz, every fifth row held out, pixels / 255).
The batches are made on the device up front, so the figure is the model's and the
device's, not a data loader's. Prints one JSON line: samples/s over the steps, wall
seconds, held-out accuracy.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def load(path: str):
    rows = np.loadtxt(gzip.open(path, "rt"), delimiter=",", dtype=np.float32)
    held = np.arange(len(rows)) % 5 == 4
    x = torch.from_numpy(rows[:, :784] / 255.0).view(-1, 1, 28, 28)
    y = torch.from_numpy(rows[:, 784].astype(np.int64))
    return (x[~held], y[~held]), (x[held], y[held])


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(1, 20, 5)
        self.conv1 = nn.Conv2d(20, 50, 5)
        self.fc0 = nn.Linear(800, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv0(x)), 2)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return self.fc0(x.flatten(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--passes", type=int, default=60)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(7)
    (x, y), (tx, ty) = load(args.data)
    x, y, tx, ty = x.to(device), y.to(device), tx.to(device), ty.to(device)
    model = Cnn().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.001)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = len(y)
    start = time.monotonic()
    sync()
    steps_start = time.monotonic()
    for p in range(args.passes):
        order = torch.randperm(n, device=device)
        for i in range(0, n, args.batch):
            idx = order[i:i + args.batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    sync()
    steps = time.monotonic() - steps_start
    with torch.no_grad():
        accuracy = (model(tx).argmax(1) == ty).float().mean().item()
    print(json.dumps({
        "device": str(device),
        "records": n * args.passes,
        "steps_per_s": n * args.passes / steps,
        "records_per_wall_s": n * args.passes / (time.monotonic() - start),
        "wall_s": time.monotonic() - start,
        "accuracy": accuracy,
    }))


if __name__ == "__main__":
    main()
