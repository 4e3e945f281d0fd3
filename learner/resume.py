"""Restarts without replay: a restarted learner goes on at the first mini-batch the job has not applied.

``psd run`` restarts a learner that died with the same rank (``PSD_RANK``); the job counts how many of
each rank's gradients its server applied. A learner that starts its data again would apply its first
life's mini-batches twice. Scripts skip them with ``Learner.resume_step``; frameworks, which own the
training loop, use ``ResumableSampler``: it wraps the sampler of the training ``DataLoader`` and leaves
out, over the epochs, the mini-batches this rank already had applied::

    sampler = psd.learner.ResumableSampler(torch.utils.data.RandomSampler(ds, generator=g), batch_size=32)
    DataLoader(ds, batch_size=32, sampler=sampler)          # Lightning: in train_dataloader()

and ``psd.learner.hf.ResumeCallback`` does the same for the Hugging Face Trainer's own sampler.

What a life resumed from is noted for ``psd run`` (``PSD_RESUME_FILE``): its crash-loop rule counts a
life as progress when it got further through the rank's data than any life before it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from psd import _native
from psd.arena import default_job, open_job
from psd.errors import Error, StateError, Timeout

__all__ = ["ResumableSampler", "applied_before"]

# (job, rank) -> (the rank's applied gradients, push_every) when this process first asked: the start of
# this life. Later asks (a reconnect, a second sampler, a refit) get the same answer, not what this life
# added since.
_LIFE_START: dict[tuple[str, int], tuple[int, int]] = {}


def _env_rank() -> int:
    raw = os.environ.get("PSD_RANK")
    try:
        return int(raw) if raw is not None else -1
    except ValueError:
        raise Error(f"PSD_RANK={raw!r} is not a whole number") from None


def note_resumed() -> None:
    """Tell ``psd run`` (through ``PSD_RESUME_FILE``) that this life skips what its rank had applied."""
    path = os.environ.get("PSD_RESUME_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(f"{os.getpid()}\n")
    except OSError:
        pass  # psd run's directory is gone (it is stopping): nothing to tell


def life_start(job: str, rank: int, progress: Any) -> tuple[int, int]:
    """(the rank's applied gradients, push_every) when this process first asked; ``progress()`` reads
    them now, if this is the first time."""
    key = (job, rank)
    if key not in _LIFE_START:
        _LIFE_START[key] = progress()
    return _LIFE_START[key]


def _read_progress(job: str, rank: int, timeout: float) -> tuple[int, int]:
    """(applied gradients of ``rank``, push_every) read from the job's arena without claiming a slot,
    once no earlier life of the rank holds a slot (its gradients still being applied)."""
    arena = open_job(job, role="reader")  # read-only: only reads below (no wait_state: it writes)
    try:
        deadline = time.monotonic() + timeout
        while arena.state != _native.ARENA_READY:
            if time.monotonic() > deadline:
                raise StateError(f"job {job!r} has no weights yet after {timeout:g} s: start its server "
                                 f"(`psd serve --job {job}`) or run the script under `psd run`")
            time.sleep(0.02)  # nothing a reader can wait on announces READY
        arena.remap()
        me = os.getpid()
        while True:
            busy = [i for i in range(arena.header()["n_slots"])
                    if (s := arena.slot_info(i))["rank"] == rank and s["state"] != _native.SLOT_FREE
                    and s["pid"] != me]
            if not busy:
                break
            if time.monotonic() > deadline:
                raise Timeout(f"job {job!r}: another learner with rank {rank} is still attached; give each "
                              f"learner its own rank (PSD_RANK)")
            time.sleep(0.02)  # a slot frees without a signal of its own
        ranks = arena.ranks()
        return (ranks[rank] if rank < len(ranks) else 0), arena.header()["push_every"]
    finally:
        arena.close()


def applied_before(job: str | None = None, rank: int | None = None, *, timeout: float = 60.0) -> int:
    """How many mini-batches of ``rank`` (default ``$PSD_RANK``) the job ``job`` had applied before
    this process started: where this life goes on. 0 without a rank (not under ``psd run``).

    It can be asked before attaching (a framework builds its data loader first) and gives the same
    answer all through the process's life. Counted in mini-batches: with ``psd serve --push-every W``
    each applied gradient was W of them.
    """
    job = job or default_job()
    rank = _env_rank() if rank is None else int(rank)
    if rank < 0:
        return 0
    applied, every = life_start(job, rank, lambda: _read_progress(job, rank, timeout))
    if applied:
        note_resumed()  # whoever asks is taken to skip them (psd run's crash-loop rule counts on it)
    return applied * every


# (job, rank) whose skip a ResumableSampler of this process already took: a later sampler (a refit, a
# second fit() or train() in the same life) starts its data from the beginning.
_SKIP_TAKEN: set[tuple[str, int]] = set()


class ResumableSampler(torch.utils.data.Sampler):
    """A sampler that leaves out the mini-batches this learner's rank already had applied.

    Wrap the training sampler (``RandomSampler`` with a seeded ``generator``, or any whose order a
    restarted process draws again the same way) and give the loader's ``batch_size``; a new life
    then yields, over its epochs, exactly the samples its earlier lives had not trained on, and the
    job's applied total equals a clean run's. ``batches_per_step``: the loader's mini-batches per
    ``optimizer.step()`` (1; a framework that accumulates G mini-batches per step takes G);
    ``steps_per_batch``: the optimizers that step for each of them (1; a GAN's two take 2). The
    first sampler of a life takes the skip; a later one (a refit, a second ``fit()`` or ``train()``)
    starts its data from the beginning.
    ``skip`` overrides what to leave out (in mini-batches; default ``applied_before(job, rank)``).

    Each ``__iter__`` is one epoch; ``set_epoch`` is passed on to the wrapped sampler. Without
    ``epochs``, an epoch whose every mini-batch was applied yields nothing (the framework's loop
    runs through it at once). With ``epochs`` (the run's total), the new life's first epoch is the
    first data epoch not finished (``set_epoch`` is shifted to match) and epochs past the total
    yield nothing: ``done`` says so (``psd.learner.hf.ResumeCallback`` then stops the Trainer,
    which would otherwise stop at the first empty epoch with a warning). Within an epoch, leaving
    a mini-batch out still draws its samples from the wrapped sampler, so the order is the first
    life's wherever the wrapped sampler draws it the same way (a seeded generator, ``set_epoch``).
    """

    def __init__(self, sampler: torch.utils.data.Sampler, batch_size: int, *, drop_last: bool = False,
                 batches_per_step: int = 1, steps_per_batch: int = 1, epochs: int | None = None,
                 job: str | None = None,
                 rank: int | None = None, skip: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"ResumableSampler: batch_size must be at least 1, not {batch_size}")
        if batches_per_step < 1 or steps_per_batch < 1:
            raise ValueError(f"ResumableSampler: batches_per_step and steps_per_batch must be at least 1, not "
                             f"{batches_per_step} and {steps_per_batch}")
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self.batches_per_step = int(batches_per_step)
        self.steps_per_batch = int(steps_per_batch)
        self.epochs = epochs
        self._job, self._rank = job, rank
        self._left: int | None = None if skip is None else int(skip)
        self._shift: int | None = None  # epochs finished by earlier lives (with ``epochs``)
        self._served = 0  # epochs begun in this life
        self.skipped = 0  # mini-batches left out so far

    def _batches(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _batches_applied(self) -> int:
        """What the job applied for this rank before this life, in this loader's mini-batches (0 for a
        later sampler of the same life: it starts a new run over the data)."""
        key = (self._job or default_job(), _env_rank() if self._rank is None else int(self._rank))
        if key in _SKIP_TAKEN:
            return 0
        _SKIP_TAKEN.add(key)
        steps = applied_before(self._job, self._rank)  # optimizer steps (learner steps)
        if self.steps_per_batch > 1:
            return steps // self.steps_per_batch
        g, nb = self.batches_per_step, self._batches()
        if g == 1 or not nb:
            return steps * g
        # A framework accumulating G mini-batches steps ceil(nb / G) times an epoch: the last step of an
        # epoch takes its remainder.
        per_epoch = -(-nb // g)
        return (steps // per_epoch) * nb + min((steps % per_epoch) * g, nb)

    def _to_skip(self) -> int:
        if self._left is None:
            self._left = self._batches_applied()
        if self._shift is None:
            self._shift = 0
            if self.epochs is not None and self._batches():
                self._shift = min(self._left // self._batches(), self.epochs)
                self._left -= self._shift * self._batches()
                self.skipped += self._shift * self._batches()
                if not hasattr(self.sampler, "set_epoch"):
                    for _ in range(self._shift):  # draw the finished epochs' orders, so this one's is right
                        for _ in self.sampler:
                            pass
        if self._left or self._shift:
            note_resumed()
        return self._left

    @property
    def done(self) -> bool:
        """With ``epochs``: every data epoch of the run has been served (by this life or earlier ones)."""
        return self.epochs is not None and self._shift is not None and self._shift + self._served >= self.epochs

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to the wrapped sampler (DistributedSampler-style reshuffling), shifted by
        the epochs earlier lives finished."""
        self._to_skip()
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch + (self._shift or 0))

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        left = self._to_skip()
        if self.done:
            return
        self._served += 1
        it = iter(self.sampler)
        skip = min(left, self._batches())
        self._left = left - skip
        self.skipped += skip
        for _ in range(skip * self.batch_size):
            if next(it, None) is None:
                return
        yield from it

    def __repr__(self) -> str:
        return f"<psd.learner.ResumableSampler of {self.sampler!r} batch_size={self.batch_size}>"
