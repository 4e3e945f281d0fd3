"""A psd run learner that trains examples/lightning_mlp.py's LightningModule with Lightning's own Trainer.

rank 0: automatic optimization, one psd optimizer, Lightning's accumulate_grad_batches=2, checkpoints by
Lightning's ModelCheckpoint; then a refit: a new Trainer resumes that checkpoint (optimizer state included)
for one more epoch, making a new psd optimizer in the same process.
rank 1: manual optimization with two psd optimizers (body, head); its first life dies (os._exit) at the
start of batch DIE_AT; psd run restarts it and ResumableSampler skips what the job applied.
Prints "learner R: done ... accuracy A" at the end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from lightning_mlp import Classifier, trainer

from psd.workloads import evaluate, make_classification, shard

N_TRAIN, BATCH, DIE_AT = 1200, 16, 10


class DieOnce(pl.Callback):
    """The first life dies at the start of batch DIE_AT, before any optimizer stepped for it."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if os.environ.get("PSD_RESTARTS") == "0" and trainer.current_epoch == 0 and batch_idx == DIE_AT:
            os._exit(9)


def main() -> int:
    torch.set_num_threads(1)
    ckpt_dir = Path(sys.argv[1])
    rank, world = int(os.environ["PSD_RANK"]), int(os.environ["PSD_WORLD"])
    data = make_classification(0, n_train=N_TRAIN)
    x, y = shard(data, rank, world)
    model = Classifier(data.dim, data.classes, TensorDataset(x, y), BATCH, 2, two_optimizers=rank == 1)
    if rank == 0:
        save = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)
        first = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                           enable_model_summary=False, accumulate_grad_batches=2, callbacks=[save])
        first.fit(model)
        refit = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                           enable_model_summary=False, accumulate_grad_batches=2, enable_checkpointing=False)
        refit.fit(model, ckpt_path=str(ckpt_dir / "last.ckpt"))  # the optimizer's state_dict is loaded back
        assert refit.current_epoch == 3, refit.current_epoch
        opt = refit.optimizers[0]
    else:
        t = trainer(2, callbacks=[DieOnce()])
        t.fit(model)
        opt = t.optimizers[0]
    opt.learner.flush()
    opt.learner.pull()
    print(f"learner {rank}: done, accuracy {evaluate(model, data):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
