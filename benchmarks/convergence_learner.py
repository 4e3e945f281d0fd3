"""A learner (and the one-process baseline) for benchmarks/convergence.py and benchmarks/matrix.py.

    python benchmarks/convergence_learner.py --job J --rank R --world N --workload mlp --batch-size 2 --epochs 3
    python benchmarks/convergence_learner.py --single --optimizer momentum --lr 0.005 --workload cnn ...

Workloads, each with its metric (``METRIC``: test accuracy, higher is better, or test loss, lower is better):

- ``mlp``: the generated classification problem that ships with psd (psd.workloads), a 2-layer MLP;
- ``cnn``: a small convolutional network with BatchNorm on scikit-learn's 8x8 digits
  (``sklearn.datasets.load_digits``: 1797 images, no download; needs ``pip install scikit-learn``);
- ``cnn_edge``: the same, for the matrix's runs at a learning rate near one process's stability edge;
- ``cnn_cos``: the same CNN with its learning rate annealed to 0 over the run (``SCHEDULE``: torch's
  ``CosineAnnealingLR`` over one process's steps; psd's ``--schedule cosine --t-max`` over the job's updates);
- ``logistic``: a linear (multinomial logistic) model on the generated problem;
- ``lm``: a character-level LSTM language model on real English text, the Python reference manual as the
  standard library ships it (``pydoc_data.topics``): test loss in nats a character;
- ``embed``: a bag of embeddings with sparse gradients (``nn.Embedding(sparse=True)``) and a linear head,
  classifying generated utterances (psd.workloads.make_utterances).

A learner evaluates its model after its last pull (the job's weights and BatchNorm statistics at that
moment, while other learners may still train), in eval mode; the last line it prints is JSON:
{"rank": R, "accuracy": A} (the workload's metric, whatever its kind, under "metric" too).
The matrix scores the job's final model, exported as `psd export` does, separately.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

from psd.workloads import Dataset, epoch_batches, make_classification, make_mlp, make_utterances, shard

# Each workload's metric: "accuracy" (higher is better) or "loss" (lower is better).
METRIC = {"mlp": "accuracy", "cnn": "accuracy", "cnn_edge": "accuracy", "cnn_cos": "accuracy",
          "logistic": "accuracy", "lm": "loss", "embed": "accuracy"}
# Workloads whose learning rate follows a schedule over the run (else constant): "cosine", annealed to 0.
SCHEDULE = {"cnn_cos": "cosine"}


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


class CharLM(torch.nn.Module):
    """Embedding, one LSTM layer, a linear head over the characters."""

    def __init__(self, vocab: int, dim: int = 24, hidden: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.rnn = torch.nn.LSTM(dim, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


def make_text(seed: int = 0, seq: int = 32, n_train: int = 3000, n_test: int = 400) -> Dataset:
    """Character windows of the Python reference manual (``pydoc_data.topics``, in the standard library):
    x a window of ``seq`` characters, y the same shifted by one. Train and test windows come from disjoint
    stretches of the text; ``seed`` shuffles which windows train."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text[: (n_train + n_test) * (seq + 1)]], dtype=torch.long)
    windows = ids.view(-1, seq + 1)
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed))
    tr, te = windows[:n_train][order], windows[n_train:]
    return Dataset(tr[:, :-1], tr[:, 1:], te[:, :-1], te[:, 1:], len(chars))


class Bag(torch.nn.Module):
    """Mean of the words' embeddings (sparse gradients: only the rows a batch uses), a linear head."""

    def __init__(self, vocab: int = 500, dim: int = 16, classes: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, sparse=True)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x).mean(1))


def workload(name: str, seed: int = 0) -> tuple[Dataset, torch.nn.Module]:
    if name == "mlp":
        data = make_classification(seed)
        return data, make_mlp(data.dim, data.classes, seed=seed)
    if name in ("cnn", "cnn_edge", "cnn_cos"):
        return make_digits(seed), make_cnn(seed=seed)
    if name == "logistic":
        data = make_classification(seed)
        torch.manual_seed(seed)
        return data, torch.nn.Linear(data.dim, data.classes)
    if name == "lm":
        data = make_text(seed)
        torch.manual_seed(seed)
        return data, CharLM(data.classes)
    if name == "embed":
        x, y = make_utterances(seed, 2500)
        torch.manual_seed(seed)
        return Dataset(x[:2000], y[:2000], x[2000:], y[2000:], 8), Bag()
    raise SystemExit(f"unknown workload {name!r}: {', '.join(METRIC)}")


def loss_of(name: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if name == "lm":
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return torch.nn.functional.cross_entropy(out, y)


@torch.no_grad()
def score(name: str, model: torch.nn.Module, data: Dataset) -> float:
    """The workload's metric on its test set, in eval mode."""
    if METRIC[name] == "accuracy":
        return accuracy(model, data)
    was = model.training
    model.eval()
    value = loss_of(name, model, data.x_test, data.y_test).item()
    model.train(was)
    return value


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
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    raise SystemExit(f"no baseline for optimizer {name!r}")


def learner_batches(n_train: int, rank: int, world: int, batch: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """The mini-batches learner ``rank`` of ``world`` (every node's learners counted) trains on, as indices
    into its shard (``psd.workloads.shard``: samples ``rank``, ``rank + world``, ...), epoch after epoch."""
    g = torch.Generator().manual_seed(1000 + seed + 7919 * rank)
    return list(epoch_batches(len(range(rank, n_train, world)), batch, epochs, g))


def learners_order(n_train: int, world: int, batch: int, epochs: int, seed: int) -> list[list[torch.Tensor]]:
    """Every mini-batch ``world`` learners train on, as indices into the whole training set, taken in turn
    (learner 0's first, learner 1's first, ..., learner 0's second, ...) and cut into ``epochs`` parts of
    equal length (the last shorter; only the curve's points between epochs depend on the cut): one process
    on the learners' own batches, without their staleness."""
    per = [[rank + world * b for b in learner_batches(n_train, rank, world, batch, epochs, seed)]
           for rank in range(world)]
    flat = [bs[step] for step in range(max(map(len, per))) for bs in per if step < len(bs)]
    cut = -(-len(flat) // epochs)
    return [flat[i:i + cut] for i in range(0, len(flat), cut)]


def train_single_curve(name: str, optimizer: str, lr: float, batch: int, epochs: int, seed: int = 0,
                       order: int = 0, world: int = 0) -> list[float]:
    """One process with torch.optim on all the data: the workload's metric after each epoch. ``order`` other
    than 0 draws the mini-batches in another order (same data split and initial weights: the matrix's
    noise floor, one process against itself). ``world`` > 0 trains on the batches ``world`` learners draw
    (``learners_order``) instead: the matrix's reference for what their data order alone does."""
    data, model = workload(name, seed)
    opt = torch_optimizer(optimizer, model.parameters(), lr)
    x, y = data.x_train, data.y_train
    g = torch.Generator().manual_seed(1000 + seed + 104729 * order)
    epochs_of = (learners_order(len(x), world, batch, epochs, seed) if world > 0
                 else [[*epoch_batches(len(x), batch, 1, g)] for _ in range(epochs)])
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, sum(map(len, epochs_of)))
             if SCHEDULE.get(name) == "cosine" else None)
    curve = []
    for batches in epochs_of:
        for idx in batches:
            opt.zero_grad()
            loss_of(name, model, x[idx], y[idx]).backward()
            opt.step()
            if sched is not None:
                sched.step()
        curve.append(score(name, model, data))
    return curve


def train_single(name: str, optimizer: str, lr: float, batch: int, epochs: int, seed: int = 0) -> float:
    """One process with torch.optim on all the data: the baseline's test accuracy."""
    return train_single_curve(name, optimizer, lr, batch, epochs, seed)[-1]


def _backward(name: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A closure's body: this mini-batch's loss and its gradients."""
    loss = loss_of(name, model, x, y)
    loss.backward()
    return loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("PSD_JOB", "default"))
    p.add_argument("--rank", type=int, default=int(os.environ.get("PSD_RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("PSD_WORLD", 1)))
    p.add_argument("--workload", default="mlp", choices=tuple(METRIC))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="data and initial weights (same for every learner)")
    p.add_argument("--single", action="store_true", help="train one process with torch.optim instead")
    p.add_argument("--optimizer", default="momentum", help="--single: the optimizer")
    p.add_argument("--lr", type=float, default=0.01, help="--single: the learning rate")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.single:
        curve = train_single_curve(args.workload, args.optimizer, args.lr, args.batch_size, args.epochs, args.seed)
        print(json.dumps({"rank": -1, "accuracy": curve[-1], "metric": curve[-1], "curve": curve}), flush=True)
        return 0

    from psd import learner

    # Several nodes (psd run --nnodes): the data is sharded over every node's learners.
    node, nnodes = int(os.environ.get("PSD_NODE_RANK", 0)), int(os.environ.get("PSD_NNODES", 1))
    data, model = workload(args.workload, args.seed)
    rank, world = node * args.world + args.rank, nnodes * args.world
    x, y = shard(data, rank, world)
    with learner.attach(model, job=args.job, rank=args.rank) as ps:
        for idx in learner_batches(len(data.x_train), rank, world, args.batch_size, args.epochs, args.seed):
            loss = loss_of(args.workload, model, x[idx], y[idx])
            loss.backward()
            # torch.optim's closure: psd measures the loss's sharpness with it now and then (psd/gain.py)
            ps.step(loss, batch_size=len(idx), closure=functools.partial(_backward, args.workload, model, x[idx],
                                                                         y[idx]))
        ps.flush()
        ps.pull()
        value = score(args.workload, model, data)
    # One write per line: a node's learners share psd run's stdout, and print() may write the text and its
    # newline separately, so two learners' lines could run together (benchmarks/matrix.py reads them).
    sys.stdout.flush()
    os.write(1, (json.dumps({"rank": args.rank, "node": node, "accuracy": value, "metric": value}) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
