"""Workloads that ship with psd: data sets and the models trained on them.

The demo, the convergence tests, the examples and the benchmarks train the same
things, so they live in one place. The generated classification data come from
a seed (no downloads): each of the classes is a mixture of two Gaussian clusters
in ``dim`` dimensions, so a linear model is not enough and a small MLP reaches a
high, stable accuracy. The 8x8 digit images are real (the UCI handwritten
digits, as shipped inside scikit-learn: ``pip install psd[examples]``); a small
ResNet-style CNN with BatchNorm trains on them. Generated utterances (intent
detection, GaDei's own workload) feed the text models.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "INTENTS",
    "Dataset",
    "epoch_batches",
    "evaluate",
    "load_digits",
    "make_classification",
    "make_mlp",
    "make_resnet",
    "make_utterances",
    "shard",
    "train_single",
]


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


def epoch_batches(n: int, batch_size: int, epochs: int, generator: torch.Generator,
                  skip: int = 0) -> Iterator[torch.Tensor]:
    """Index tensors of ``epochs`` shuffled passes over ``n`` samples, ``batch_size`` at a time.

    The first ``skip`` mini-batches are not yielded but their shuffles are still drawn, so a
    restarted learner (``skip=ps.resume_step``) sees the same order as its first life did.
    """
    steps = -(-n // batch_size)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=generator)
        for step in range(max(0, skip - epoch * steps), steps):
            yield order[step * batch_size:(step + 1) * batch_size]


def train_single(data: Dataset, epochs: int, batch_size: int, lr: float, seed: int = 0,
                 momentum: float = 0.0) -> torch.nn.Module:
    """The baseline psd is compared with: one process, SGD (with ``momentum``), same data and model."""
    model = make_mlp(data.dim, data.classes, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for idx in epoch_batches(len(data.x_train), batch_size, epochs, torch.Generator().manual_seed(seed)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
    return model


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """The 1,797 real 8x8 digit images (scikit-learn's copy of the UCI set), scaled to [0, 1], as
    (N, 1, 8, 8), split into train and test by a seeded permutation."""
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError:
        raise ImportError("the digits workload needs scikit-learn: pip install 'psd[examples]' "
                          "(or pip install scikit-learn)") from None
    d = _load()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    te, tr = order[:n_test], order[n_test:]
    return Dataset(x[tr], y[tr], x[te], y[te], 10)


class _Block(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


def make_resnet(channels: int = 16, classes: int = 10, seed: int = 0) -> torch.nn.Module:
    """A small ResNet-style CNN with BatchNorm for 8x8 images: a stem, two residual blocks, pooling."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, channels, 3, padding=1, bias=False), torch.nn.BatchNorm2d(channels), torch.nn.ReLU(),
        _Block(channels), _Block(channels),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(channels, classes),
    )


INTENTS = ["balance", "transfer", "card_lost", "open_account", "loan", "address_change", "complaint", "hours"]


def make_utterances(seed: int, n: int, vocab: int = 500, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """n generated utterances of ``length`` word ids and their intent labels: each intent has six
    keywords (ids 1..48), and every utterance mixes two or three of them into filler words."""
    g = torch.Generator().manual_seed(seed)
    keywords = torch.arange(len(INTENTS) * 6).view(len(INTENTS), 6) + 1
    y = torch.randint(len(INTENTS), (n,), generator=g)
    words = torch.randint(len(INTENTS) * 6 + 1, vocab, (n, length), generator=g)
    k = 2 + torch.randint(2, (n,), generator=g)
    for i in range(n):
        pos = torch.randperm(length, generator=g)[: k[i]]
        words[i, pos] = keywords[y[i], torch.randint(6, (int(k[i]),), generator=g)]
    return words, y
