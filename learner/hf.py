"""The Hugging Face Trainer on psd: ``ResumeCallback``, restarts without replaying data.

    from psd import learner
    from psd.learner.hf import ResumeCallback

    opt = learner.Optimizer(model)                       # the job's optimizer runs on its server
    args = TrainingArguments(..., lr_scheduler_type="constant")  # the schedule is the server's too
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None),
                      callbacks=[ResumeCallback()])
    trainer.train()

Under ``psd run`` a learner that died is started again; its Trainer starts at step 0. The callback wraps
the Trainer's training sampler in ``psd.learner.ResumableSampler`` when training begins, so the new life
skips the mini-batches (``gradient_accumulation_steps`` of them per optimizer step, fewer for an epoch's
last step) that the job had already applied for its rank, and stops the Trainer once the run's steps
(``max_steps``, or what ``num_train_epochs`` makes of them) are done, this life's and the earlier ones'.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import TrainerCallback

from psd.errors import Error
from psd.learner.resume import ResumableSampler, applied_before

__all__ = ["ResumeCallback"]


def _batch_sampler(loader: Any) -> Any:
    """The BatchSampler that holds the loader's sampler (accelerate wraps it in a BatchSamplerShard)."""
    bs = getattr(loader, "batch_sampler", None)
    inner = getattr(bs, "batch_sampler", None)
    return inner if inner is not None else bs


class ResumeCallback(TrainerCallback):
    """Skip what the job already applied for this learner's rank, and stop when the run's epochs are done."""

    def __init__(self) -> None:
        self.sampler: ResumableSampler | None = None

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        """Wrap the training loader's sampler (once per Trainer) in a ResumableSampler."""
        bs = _batch_sampler(train_dataloader)
        if bs is None or not hasattr(bs, "sampler") or not hasattr(bs, "batch_size"):
            raise Error("psd.learner.hf.ResumeCallback: the Trainer's training loader has no batch sampler to "
                        "resume (an IterableDataset?); skip psd.learner.applied_before() batches of it yourself")
        g = args.gradient_accumulation_steps
        # The run's length in optimizer steps is the Trainer's max_steps (from max_steps, or from a
        # fractional num_train_epochs); this life already had `before` of them applied.
        self.before = applied_before()
        self.max_steps = state.max_steps
        per_epoch = -(-len(train_dataloader) // g) if len(train_dataloader) else 1
        epochs = math.ceil(state.max_steps / per_epoch) if state.max_steps and state.max_steps > 0 else None
        if isinstance(bs.sampler, ResumableSampler):
            self.sampler = bs.sampler
        else:
            self.sampler = bs.sampler = ResumableSampler(bs.sampler, bs.batch_size, drop_last=bs.drop_last,
                                                         batches_per_step=g, epochs=epochs)
        if self.max_steps and self.before >= self.max_steps:
            control.should_training_stop = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        """Stop the Trainer once this life and the earlier ones made the run's steps."""
        if self.max_steps and self.before + state.global_step >= self.max_steps:
            control.should_training_stop = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        """Stop the Trainer once every epoch of the run was served, by this life or earlier ones."""
        if self.sampler is not None and self.sampler.done:
            control.should_training_stop = True
        return control
