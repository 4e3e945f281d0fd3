"""Intent detection in the spirit of GaDei's NLC workload, trained through psd.

Natural-language classification (intent detection) was the workload GaDei was
built for: small models, small mini-batches, many updates. The data are
generated (no downloads): each intent has its own keywords, and every
utterance mixes two or three of them into filler words. Two models:

- ``--model bag`` (default): a bag of embeddings and a linear layer.
- ``--model transformer``: a small Transformer whose word embedding is
  ``nn.Embedding(sparse=True)``: each step's gradient touches only the rows of
  the words in the mini-batch, and psd pushes only those rows (row indices and
  values) into the ring, not the whole table. Sparse gradients need an
  optimizer with sparse semantics, as in torch.optim: ``sgd`` or ``adagrad``.

    psd run --job nlc --learners 4 --lr 0.5 -- python examples/text_classifier.py
    psd run --job intents --learners 4 --optimizer adagrad --lr 0.05 -- \\
        python examples/text_classifier.py --model transformer

or, with a server already running, one learner per process as with train_mlp.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from psd import learner
from psd.workloads import INTENTS, epoch_batches, make_utterances


class BagOfEmbeddings(torch.nn.Module):
    def __init__(self, vocab: int = 500, dim: int = 32, classes: int = len(INTENTS)) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(vocab, dim, mode="mean")
        self.out = torch.nn.Linear(dim, classes)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(words))


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


# model: (class, training utterances, epochs, mini-batch)
MODELS = {"bag": (BagOfEmbeddings, 4000, 3, 2), "transformer": (IntentTransformer, 3000, 2, 8)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("PSD_JOB", "nlc"))
    p.add_argument("--rank", type=int, default=int(os.environ.get("PSD_RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("PSD_WORLD", 1)))
    p.add_argument("--model", choices=sorted(MODELS), default="bag")
    p.add_argument("--epochs", type=int, help="default: 3 (bag), 2 (transformer)")
    p.add_argument("--batch-size", type=int, help="default: 2 (bag), 8 (transformer)")
    args = p.parse_args(argv)
    make_model, n_train, epochs, batch_size = MODELS[args.model]
    torch.set_num_threads(1)
    x, y = make_utterances(0, n_train)
    x_test, y_test = make_utterances(1, 1000)
    x, y = x[args.rank::args.world], y[args.rank::args.world]
    torch.manual_seed(0)
    model = make_model()
    g = torch.Generator().manual_seed(args.rank)
    with learner.attach(model, job=args.job, rank=args.rank) as ps:
        # A restarted learner skips the mini-batches it already pushed.
        for idx in epoch_batches(len(x), args.batch_size or batch_size, args.epochs or epochs, g,
                                 skip=ps.resume_step):
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
