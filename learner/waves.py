"""Waves and prediction: ``--push-every W`` sums W mini-batches' gradients in the learner's own buffer and
pushes their mean; ``--predict`` extrapolates the pulled weights by the learner's measured staleness
(PipeOptim), a partial learner by its own share of the job's updates.

``Waves`` is the part of :class:`psd.learner.Learner` that does it.
"""

from __future__ import annotations

import collections
import logging

import torch

from psd import _native
from psd.state import pieces_view

__all__ = ["STALENESS_WINDOW", "Waves"]

log = logging.getLogger("psd.learner")

# Weight prediction extrapolates by the median staleness of this many recent gradients.
STALENESS_WINDOW = 64


class Waves:
    """A learner's waves (``--push-every``) and weight prediction (``--predict``). A part of
    :class:`psd.learner.Learner` (one of its base classes); what it reads and writes lives on the learner."""

    def _accumulate(self, mask: tuple[int, ...] | None) -> None:
        """--push-every: add this mini-batch's gradients into the wave's sums, in psd's own buffer, so
        that whatever the caller does to ``p.grad`` before the next step (``zero_grad()``, a framework's
        ``model.zero_grad()``) the wave pushes every mini-batch of it."""
        if self._acc is None:
            self._acc = torch.empty(sum(self._numels), dtype=torch.float32 if self._lowp is not None else self.dtype)
            self._acc_views = [v.view(p.shape) for v, p in zip(self._acc.split(self._numels), self._train,
                                                                 strict=True)]
            self._acc_has = [False] * len(self._train)
            self._acc_count = [0] * len(self._train)
        for k in range(len(self._train)) if mask is None else mask:
            self._acc_count[k] += 1  # a step of this tensor's optimizer, with a gradient for it or not
        for k, g in enumerate(self._grads_of(mask)):
            if g is None:
                continue
            if g.layout == torch.sparse_coo:
                s = self._acc_sparse.get(k)
                self._acc_sparse[k] = g.detach().clone() if s is None else s + g.detach()
                continue
            if g.layout != torch.strided:
                g = g.to_dense()
            v = self._acc_views[k]
            if self._acc_has[k]:
                v.add_(g.detach())
            else:
                v.copy_(g.detach())
                self._acc_has[k] = True

    def _wave_grads(self) -> list[torch.Tensor | None]:
        """The wave's mean gradients, and a new wave begins. Each tensor's sum is divided by the steps
        of its optimizer within the wave: W, unless several optimizers of some of the parameters each
        (``Optimizer(params=...)``) stepped within it (then each tensor by its own optimizer's steps)."""
        out: list[torch.Tensor | None] = [None] * len(self._train)
        for k in range(len(self._train)):
            s = self._acc_sparse.pop(k, None)
            n, self._acc_count[k] = self._acc_count[k], 0
            if self._acc_has[k]:
                g = self._acc_views[k]
                if s is not None:
                    g.add_(s.to_dense())
                out[k] = g.div_(n) if n > 1 else g
                self._acc_has[k] = False
            elif s is not None:
                out[k] = s / n if n > 1 else s
        return out

    def _end_of_wave(self, loss, batch_size: int):
        """Count one mini-batch of the wave (``--push-every``): None while the wave goes on, else
        (mean loss, summed batch size, mini-batches in the wave), and a new wave starts."""
        if self.push_every == 1:
            return loss, int(batch_size), 1
        self._wave += 1
        self._wave_loss = self._wave_loss + loss
        self._wave_batch += int(batch_size)
        if self._wave < self.push_every:
            return None
        out = (self._wave_loss / self._wave, self._wave_batch, self._wave)
        self._wave, self._wave_loss, self._wave_batch = 0, 0.0, 0
        return out

    def _push_open_wave(self) -> None:
        """--push-every: push the mean of an unfinished wave's mini-batches (at close: nothing is lost)."""
        if self.push_every > 1 and self._wave and self._acc is not None and self._plain():
            lv, batch, n = self._wave_loss / self._wave, self._wave_batch, self._wave
            self._wave, self._wave_loss, self._wave_batch = 0, 0.0, 0
            log.info("job %r: pushing the unfinished wave of %d mini-batch(es) at close", self.job, n)
            # own=False: a close need not wait for the server (flush() does, where asked)
            self._push(lv, batch, self._wave_grads(), own=False)

    def _sample_staleness(self, seq: int) -> None:
        """Note the exact staleness of gradient ``seq`` (its ring entry is about to be reused)."""
        meta = self._arena.entry_meta(self.slot, seq)
        if meta is not None and meta["outcome"] == _native.OUTCOME_APPLIED:
            self._staleness.append(meta["applied_clock"] - meta["clock"])

    def _predict(self) -> None:
        """Extrapolate the fresh front weights by this learner's staleness (PipeOptim).

        The staleness used is the median over this learner's last gradients, not their mean: on a
        busy machine staleness is bursty (mostly small, sometimes large), and a mean then moves
        the weights further than most gradients travel; the median minimises the expected distance,
        so prediction is never worse than none.
        """
        if self._staleness:
            self.predicted_staleness = float(sorted(self._staleness)[len(self._staleness) // 2])
            if self.predicted_staleness > 0 and self._present is None:
                self._arena.predict_into(self._front_array, self.predicted_staleness)
            elif self.predicted_staleness > 0:  # a partial learner: its own tensors, by their own staleness
                self.predicted_staleness *= self._own_share()
                for off, length, frozen in self._own:
                    if not frozen:
                        self._arena.predict_into(self._front_array, self.predicted_staleness, off, off + length)

    def _own_share(self) -> float:
        """A partial learner: the share of the job's updates that moved its own tensors lately (PipeOptim
        extrapolates a stage by its own in-flight depth; the clock's staleness counts every stage's
        updates). Measured on its first trainable tensor's step count over the last STALENESS_WINDOW pulls,
        each count paired with the clock read around it (the update loop may apply more while this runs)."""
        k = next((i for i in range(self.n_pieces) if self._present[i]), None)
        if k is None:
            return 1.0
        if getattr(self, "_steps_view", None) is None or self._steps_arena is not self._arena:
            self._steps_view, self._steps_arena = pieces_view(self._arena, self._arena.header()), self._arena
            self._shares = collections.deque(maxlen=STALENESS_WINDOW)
        for _ in range(8):  # a pair from one moment: the clock the same before and after the count
            clock = self._arena.clock()
            steps = int(self._steps_view[k, 0])
            if self._arena.clock() == clock:
                break
        else:
            return 1.0  # the job moves too fast to pair them: no correction this time
        # The loop counts a tensor's step before it stores the clock: an update in flight may be counted
        # already, and no tensor moved more often than the clock.
        self._shares.append((clock, min(steps, clock)))
        (c0, s0), (c1, s1) = self._shares[0], self._shares[-1]
        return min(1.0, max(0.0, (s1 - s0) / (c1 - c0))) if c1 > c0 else 1.0
