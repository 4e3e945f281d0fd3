"""A text classifier in the spirit of GaDei's NLC workload, trained through psd.

Natural-language classification (intent detection) was the workload GaDei was
built for: small models, small mini-batches, many updates. The data are
generated (no downloads): each intent has its own keywords, and every
utterance mixes two or three of them into filler words. The model is a bag of
embeddings and a linear layer.

    psd run --job nlc --learners 4 --lr 0.5 -- python examples/text_classifier.py

or, with a server already running, one learner per process as with train_mlp.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from psd import learner
from psd.workloads import INTENTS, make_utterances


class BagOfEmbeddings(torch.nn.Module):
    def __init__(self, vocab: int = 500, dim: int = 32, classes: int = len(INTENTS)) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(vocab, dim, mode="mean")
        self.out = torch.nn.Linear(dim, classes)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(words))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("PSD_JOB", "nlc"))
    p.add_argument("--rank", type=int, default=int(os.environ.get("PSD_RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("PSD_WORLD", 1)))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2)
    args = p.parse_args(argv)
    x, y = make_utterances(0, 4000)
    x_test, y_test = make_utterances(1, 1000)
    x, y = x[args.rank::args.world], y[args.rank::args.world]
    torch.manual_seed(0)
    model = BagOfEmbeddings()
    g = torch.Generator().manual_seed(args.rank)
    steps = -(-len(x) // args.batch_size)
    with learner.attach(model, job=args.job, rank=args.rank) as ps:
        for epoch in range(args.epochs):
            order = torch.randperm(len(x), generator=g)
            for step in range(epoch * steps, (epoch + 1) * steps):
                if step < ps.resume_step:  # a restarted learner skips what it already pushed
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
