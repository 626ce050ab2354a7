"""An edl trainer program in PyTorch: a small CNN on MNIST digits.

`edl run job.toml` starts it as each trainer of the job (and once more, with
EDL_MODE=evaluate, for the final held-out accuracy). The trainer reads its tasks through
`edl.torch.ElasticLoader` (DataLoader workers decode the records), trains on
parameters pulled from the job's pservers and pushes the gradients; the pservers' Adam
applies them. Kill it at any point: its tasks go to the other trainers, and its updates
count exactly once.

It computes on `trainer.device`: `edl run --device cuda:0` (EDL_DEVICE) puts it on that
GPU; `auto`, the default, is a GPU when PyTorch sees one. On a GPU the batches are
decoded into pinned memory and uploaded without blocking, and `edl.torch.ModuleParams`
moves parameters and gradients through pinned buffers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import edl
import edl.torch


class Net(nn.Module):
    """Two 5x5 convolutions with max-pooling, then two linear layers (215k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def decode(records):
    """A batch of records (edl samples: 784 pixels in [0, 1], the digit) as tensors; runs
    in the DataLoader workers."""
    s = edl.decode_samples(records)
    return torch.from_numpy(s["dense"]).view(-1, 1, 28, 28), torch.from_numpy(s["label"])


@torch.no_grad()
def evaluate(model: Net, records, device: torch.device, batch: int = 500):
    """(accuracy, mean loss) on `records`."""
    model.eval()
    correct, loss, n = 0, 0.0, 0
    for i in range(0, len(records), batch):
        x, y = decode(records[i:i + batch])
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        n += len(y)
    model.train()
    return correct / max(n, 1), loss / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with edl.Trainer.from_env() as trainer:
        torch.manual_seed(trainer.seed)  # the same initial values in every trainer
        device = torch.device(trainer.device)
        model = Net().to(device)
        params = edl.torch.ModuleParams(trainer, model)
        split, held_out = trainer.evaluation_records()
        print(f"{trainer.id}: computing on {device}", flush=True)

        if trainer.mode == "evaluate":
            acc, loss = evaluate(model, held_out, device)
            trainer.report_evaluation("accuracy", acc, loss, split, len(held_out))
            return

        gpu = device.type == "cuda"
        loader = edl.torch.ElasticLoader(trainer, decode, num_workers=args.workers,
                                         pin_memory=gpu)
        for epoch in loader.passes():
            for (x, y), task in epoch:
                x, y = x.to(device, non_blocking=gpu), y.to(device, non_blocking=gpu)
                params.pull()
                model.zero_grad(set_to_none=False)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                params.push(task=task, loss=loss.item())
            if epoch.ended_by in ("pass", "job"):
                params.pull()
                acc, loss = evaluate(model, held_out, device)
                trainer.record_evaluation(epoch.number, "accuracy", acc, loss)
                print(f"{trainer.id}: pass {epoch.number}: held-out accuracy {acc:.4f}",
                      flush=True)


if __name__ == "__main__":
    main()
