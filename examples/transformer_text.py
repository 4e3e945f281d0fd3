"""A small Transformer with a sparse embedding, trained through psd on GaDei-style intent detection.

The word embedding is `nn.Embedding(sparse=True)`: each step's gradient touches
only the rows of the words in the mini-batch, and psd pushes only those rows
(row indices and values) into the ring, not the whole table. Sparse gradients
need an optimizer with sparse semantics, as in torch.optim: `sgd` or `adagrad`.

    psd run --job intents --learners 4 --optimizer adagrad --lr 0.05 -- python examples/transformer_text.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from psd import learner
from psd.workloads import INTENTS, make_utterances


class IntentTransformer(torch.nn.Module):
    def __init__(self, vocab: int = 500, dim: int = 32, length: int = 12, classes: int = len(INTENTS)) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, sparse=True)
        self.position = torch.nn.Parameter(torch.zeros(length, dim))
        self.encoder = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=64, dropout=0.0,
                                                        batch_first=True)
        self.out = torch.nn.Linear(dim, classes)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(words) + self.position)
        return self.out(h.mean(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("PSD_JOB", "intents"))
    p.add_argument("--rank", type=int, default=int(os.environ.get("PSD_RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("PSD_WORLD", 1)))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x, y = make_utterances(0, 3000)
    x_test, y_test = make_utterances(1, 1000)
    x, y = x[args.rank::args.world], y[args.rank::args.world]
    torch.manual_seed(0)
    model = IntentTransformer()
    g = torch.Generator().manual_seed(args.rank)
    steps = -(-len(x) // args.batch_size)
    with learner.attach(model, job=args.job, rank=args.rank) as ps:
        for epoch in range(args.epochs):
            order = torch.randperm(len(x), generator=g)
            for step in range(epoch * steps, (epoch + 1) * steps):
                if step < ps.resume_step:
                    continue
                idx = order[(step - epoch * steps) * args.batch_size:][: args.batch_size]
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                ps.step(loss, batch_size=len(idx))
        ps.flush()
        ps.pull()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"learner {args.rank}: intent accuracy {acc:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
