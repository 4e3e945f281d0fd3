"""The Hugging Face Trainer on psd: a tiny BERT classifier trained by the Trainer, its optimizer psd's.

    pip install -c constraints.txt -e '.[frameworks]'
    psd run --job hf --learners 2 --optimizer adamw --lr 0.002 --schedule cosine -- python examples/hf_trainer.py

Each learner runs the Trainer as usual; the psd lines are the optimizer (`psd.learner.Optimizer(model)`,
passed as `optimizers=(opt, None)` with `lr_scheduler_type="constant"`: the server owns the optimizer,
its learning rate and schedule) and `psd.learner.hf.ResumeCallback()`, which lets a learner that `psd run`
restarts go on at the first mini-batch the job has not applied. Gradient accumulation works as in the
Trainer (`--accumulate`); so does psd's own (`psd run --push-every W`).

The task: does token 3 occur in a sequence of 12 random tokens? One attention layer learns it.
Start every learner from one saved model with `--save-init F` then `psd run --init F ...`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from psd import learner
from psd.learner.hf import ResumeCallback

VOCAB, LENGTH, TOKEN = 20, 12, 3
EXTRA_CALLBACKS: list = []  # more TrainerCallbacks (the tests add a fault)


class Sequences(torch.utils.data.Dataset):
    """``n`` sequences of random tokens, labelled 1 where ``TOKEN`` occurs (about half of them)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, VOCAB, (n, LENGTH), generator=g)
        hit = torch.rand(n, generator=g) < 0.5
        where = torch.randint(LENGTH, (n,), generator=g)
        self.ids[hit, where[hit]] = TOKEN
        self.labels = hit.long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def make_model(seed: int = 0) -> BertForSequenceClassification:
    """A BERT of one layer, 32 wide: small enough for a CPU test, a real transformers model."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=LENGTH, num_labels=2)
    return BertForSequenceClassification(cfg)


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: Sequences) -> float:
    model.eval()
    out = model(input_ids=data.ids).logits.argmax(-1)
    return (out == data.labels).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1, help="the Trainer's gradient_accumulation_steps")
    p.add_argument("--n-train", type=int, default=2048, help="training sequences per learner")
    p.add_argument("--out", default=None, help="the Trainer's output_dir (default: a temporary directory)")
    p.add_argument("--save-init", default=None, help="save the initial model (safetensors) and exit")
    args = p.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = make_model()
    if args.save_init:
        from safetensors.torch import save_file

        save_file(model.state_dict(), args.save_init)  # saved the usual way: psd matches tensors by name
        return 0
    rank = int(os.environ.get("PSD_RANK", 0))
    train, test = Sequences(args.n_train, seed=100 + rank), Sequences(512, seed=1)
    opt = learner.Optimizer(model, batch_size=args.batch_size)
    out = args.out or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"psd-hf-{os.getpid()}")
    targs = TrainingArguments(output_dir=out, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
                              gradient_accumulation_steps=args.accumulate, lr_scheduler_type="constant",
                              save_strategy="no", report_to="none", logging_strategy="no", disable_tqdm=True,
                              use_cpu=True, seed=rank, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=train, optimizers=(opt, None),
                      callbacks=[ResumeCallback(), *EXTRA_CALLBACKS])
    trainer.train()
    opt.learner.flush()
    opt.learner.pull()
    print(f"learner {rank}: done, {opt.learner.pushed} steps pushed, accuracy {accuracy(model, test):.4f}",
          flush=True)
    opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
