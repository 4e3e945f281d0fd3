"""A learner (and the one-process baseline) for benchmarks/convergence.py's optimizer table.

    python benchmarks/convergence_learner.py --job J --rank R --world N --workload mlp --batch-size 2 --epochs 3
    python benchmarks/convergence_learner.py --single --optimizer momentum --lr 0.005 --workload cnn ...

Two workloads: ``mlp``, the generated problem that ships with psd (psd.workloads), and ``cnn``, a small
convolutional network with BatchNorm on scikit-learn's 8x8 digits (``sklearn.datasets.load_digits``: 1797
images, no download; needs ``pip install scikit-learn``). A learner evaluates its model after its last pull
(the job's weights and BatchNorm statistics at that moment, while other learners may still train), in eval
mode; the last line it prints is JSON: {"rank": R, "accuracy": A}. convergence.py scores the job's final
model, exported as `psd export` does, separately.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from psd.workloads import Dataset, epoch_batches, make_classification, make_mlp, shard


def make_digits(seed: int = 0) -> Dataset:
    """sklearn's digits as 1x8x8 images scaled to [0, 1]; a seeded 80/20 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(x))
    tr, te = order[:n_train], order[n_train:]
    return Dataset(x[tr], y[tr], x[te], y[te], 10)


def make_cnn(classes: int = 10, seed: int = 0) -> torch.nn.Module:
    """conv-BN-ReLU-pool twice, then a linear layer: 8x8 -> 4x4 -> 2x2."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, classes),
    )


def workload(name: str, seed: int = 0) -> tuple[Dataset, torch.nn.Module]:
    if name == "mlp":
        data = make_classification(seed)
        return data, make_mlp(data.dim, data.classes, seed=seed)
    if name == "cnn":
        return make_digits(seed), make_cnn(seed=seed)
    raise SystemExit(f"unknown workload {name!r}: mlp or cnn")


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: Dataset) -> float:
    was = model.training
    model.eval()
    acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
    model.train(was)
    return acc


def torch_optimizer(name: str, params, lr: float, momentum: float = 0.9) -> torch.optim.Optimizer:
    """torch.optim's counterpart of psd's --optimizer, at PyTorch's defaults (as psd's)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=name == "nesterov")
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise SystemExit(f"no baseline for optimizer {name!r}")


def train_single(name: str, optimizer: str, lr: float, batch: int, epochs: int, seed: int = 0) -> float:
    """One process with torch.optim on all the data: the baseline's test accuracy."""
    data, model = workload(name, seed)
    opt = torch_optimizer(optimizer, model.parameters(), lr)
    for idx in epoch_batches(len(data.x_train), batch, epochs, torch.Generator().manual_seed(1000 + seed)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
    return accuracy(model, data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("PSD_JOB", "default"))
    p.add_argument("--rank", type=int, default=int(os.environ.get("PSD_RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("PSD_WORLD", 1)))
    p.add_argument("--workload", default="mlp", choices=("mlp", "cnn"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="data and initial weights (same for every learner)")
    p.add_argument("--single", action="store_true", help="train one process with torch.optim instead")
    p.add_argument("--optimizer", default="momentum", help="--single: the optimizer")
    p.add_argument("--lr", type=float, default=0.01, help="--single: the learning rate")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.single:
        acc = train_single(args.workload, args.optimizer, args.lr, args.batch_size, args.epochs, args.seed)
        print(json.dumps({"rank": -1, "accuracy": acc}), flush=True)
        return 0

    from psd import learner

    data, model = workload(args.workload, args.seed)
    x, y = shard(data, args.rank, args.world)
    g = torch.Generator().manual_seed(1000 + args.seed + 7919 * args.rank)
    with learner.attach(model, job=args.job, rank=args.rank) as ps:
        for idx in epoch_batches(len(x), args.batch_size, args.epochs, g):
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            ps.step(loss, batch_size=len(idx))
        ps.flush()
        ps.pull()
        acc = accuracy(model, data)
    print(json.dumps({"rank": args.rank, "accuracy": acc}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
