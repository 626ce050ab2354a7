"""An edl trainer program in PyTorch: a small CNN on MNIST digits.

`edl run job.toml` starts it as each trainer of the job (and once more, with
EDL_MODE=evaluate, for the final held-out accuracy). The trainer reads its tasks through
`edl.torch.ElasticLoader` (DataLoader workers decode the records), trains on
parameters pulled from the job's pservers and pushes the gradients; the pservers' Adam
applies them. Kill it at any point: its tasks go to the other trainers, and its updates
count exactly once.
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
def evaluate(model: Net, records, batch: int = 500):
    """(accuracy, mean loss) on `records`."""
    model.eval()
    correct, loss, n = 0, 0.0, 0
    for i in range(0, len(records), batch):
        x, y = decode(records[i:i + batch])
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
        model = Net()
        params = edl.torch.ModuleParams(trainer, model)
        split, held_out = trainer.evaluation_records()

        if trainer.mode == "evaluate":
            acc, loss = evaluate(model, held_out)
            trainer.report_evaluation("accuracy", acc, loss, split, len(held_out))
            return

        loader = edl.torch.ElasticLoader(trainer, decode, num_workers=args.workers)
        for epoch in loader.passes():
            for (x, y), task in epoch:
                params.pull()
                model.zero_grad(set_to_none=False)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                params.push(task=task, loss=loss.item())
            if epoch.ended_by in ("pass", "job"):
                params.pull()
                acc, loss = evaluate(model, held_out)
                trainer.record_evaluation(epoch.number, "accuracy", acc, loss)
                print(f"{trainer.id}: pass {epoch.number}: held-out accuracy {acc:.4f}",
                      flush=True)


if __name__ == "__main__":
    main()
