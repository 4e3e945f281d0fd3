"""Workloads that ship with psd: a generated classification data set and a model for it.

The demo, the convergence tests and the benchmarks train the same thing, so it
lives in one place. The data are generated from a seed (no downloads): each of
the classes is a mixture of two Gaussian clusters in ``dim`` dimensions, so a
linear model is not enough and a small MLP reaches a high, stable accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Dataset", "evaluate", "make_classification", "make_mlp", "shard", "train_single"]


@dataclass
class Dataset:
    """Train and test split of a generated classification problem."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int

    @property
    def dim(self) -> int:
        return self.x_train.shape[1]


def make_classification(seed: int = 0, n_train: int = 6000, n_test: int = 2000, dim: int = 20,
                        classes: int = 10, spread: float = 1.4) -> Dataset:
    """Generate the data set; the same seed always gives the same tensors."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, 2, dim, generator=g) * spread

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(classes, (n,), generator=g)
        mode = torch.randint(2, (n,), generator=g)
        x = centres[y, mode] + torch.randn(n, dim, generator=g)
        return x, y

    x_tr, y_tr = draw(n_train)
    x_te, y_te = draw(n_test)
    return Dataset(x_tr, y_tr, x_te, y_te, classes)


def make_mlp(dim: int = 20, classes: int = 10, hidden: int = 64, seed: int = 0) -> torch.nn.Module:
    """The model trained on that data: dim -> hidden -> hidden -> classes."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(dim, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    )


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset) -> float:
    """Test accuracy, in [0, 1]."""
    return (model(data.x_test).argmax(1) == data.y_test).float().mean().item()


def shard(data: Dataset, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training samples of learner ``rank`` out of ``world``."""
    return data.x_train[rank::world], data.y_train[rank::world]


def train_single(data: Dataset, epochs: int, batch_size: int, lr: float, seed: int = 0,
                 momentum: float = 0.0) -> torch.nn.Module:
    """The baseline psd is compared with: one process, SGD (with ``momentum``), same data and model."""
    model = make_mlp(data.dim, data.classes, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(data.x_train), generator=g)
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
    return model
