"""PyTorch Lightning on psd: a LightningModule whose optimizer is psd.learner.Optimizer.

    pip install -c constraints.txt -e '.[frameworks]'
    psd run --job lit --learners 2 --lr 0.05 -- python examples/lightning_mlp.py

Every learner runs Lightning's own Trainer; the job's optimizer runs on the psd server (its --optimizer,
--lr, --schedule). The psd lines: `configure_optimizers` returns `psd.learner.Optimizer(self)` (with
`--two-optimizers`, one for the body and one for the head, stepped by hand, as GANs do), and
`train_dataloader` wraps its sampler in `psd.learner.ResumableSampler`, so a learner that `psd run`
restarts goes on at the first mini-batch the job has not applied instead of replaying its data.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from psd import learner
from psd.workloads import evaluate, make_classification, shard


class Classifier(pl.LightningModule):
    """An MLP: body then head; one psd optimizer, or one per part (``two_optimizers``)."""

    def __init__(self, dim: int, classes: int, data: TensorDataset, batch_size: int = 16, epochs: int = 2,
                 two_optimizers: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, classes)
        self.data, self.batch_size, self.epochs = data, batch_size, epochs
        self.two = two_optimizers
        self.automatic_optimization = not two_optimizers
        self.seed = seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        if self.two:  # manual optimization: each optimizer steps its own part
            opt_body, opt_head = self.optimizers()
            opt_body.zero_grad()
            opt_head.zero_grad()
            self.manual_backward(loss)
            opt_body.step()
            opt_head.step()
        return loss

    def configure_optimizers(self):
        if self.two:
            return [learner.Optimizer(self, params=self.body.parameters(), batch_size=self.batch_size),
                    learner.Optimizer(self, params=self.head.parameters(), batch_size=self.batch_size)]
        return learner.Optimizer(self, batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        order = RandomSampler(self.data, generator=torch.Generator().manual_seed(self.seed))
        sampler = learner.ResumableSampler(order, self.batch_size, steps_per_batch=2 if self.two else 1)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)


def trainer(epochs: int, callbacks: list | None = None) -> pl.Trainer:
    """Lightning's Trainer for one learner process: CPU, quiet (psd run prints the job's progress)."""
    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks or [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--n-train", type=int, default=6000, help="training samples in all (each learner takes its shard)")
    p.add_argument("--two-optimizers", action="store_true", help="one psd optimizer for the body, one for the head")
    args = p.parse_args(argv)
    rank, world = int(os.environ.get("PSD_RANK", 0)), int(os.environ.get("PSD_WORLD", 1))
    data = make_classification(0, n_train=args.n_train)
    x, y = shard(data, rank, world)
    model = Classifier(data.dim, data.classes, TensorDataset(x, y), args.batch_size, args.epochs,
                       args.two_optimizers)
    trainer(args.epochs).fit(model)
    opt = model.optimizers()
    ps = (opt[0] if isinstance(opt, list) else opt).optimizer.learner
    ps.flush()
    ps.pull()
    print(f"learner {rank}: done, accuracy {evaluate(model, data):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
