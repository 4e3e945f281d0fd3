"""How a CPU learner takes the job's weights: one class per pull mode.

A :class:`psd.learner.Learner` holds one of these from the moment it maps a job (``Learner._map_buffers``)
to the moment it unmaps it, chosen by its pull mode:

- :class:`ViewPull` (``pull="view"``): the parameters are views of the job's weights in shared memory; a pull
  copies nothing and only records the clock the next gradient is computed from;
- :class:`InlinePull` (``pull="copy"``, small or partial models, sparse rows): the learner copies the weights
  (a partial attach: its own tensors; sparse models: the rows the updates changed) into its front buffer,
  between steps, in its own thread;
- :class:`ThreadPull` (``pull="copy"`` for a large model, where a core is free for it): the native pull thread
  fills the back buffer while the learner computes, and a step takes it (bsp: the round's result, inline).

The state (the two weight buffers, the clock, the rows-log position, the figures) stays on the learner,
which every part of a step reads; a Pull only decides how it is filled. :class:`Weights`, one of the
learner's base classes, is the learner's side: which buffer is the front, the parameters over it, the
copies of its own ranges, taking newer weights after a push, and ``Learner.pull()``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from psd import _native
from psd.errors import Error
from psd.state import split

# The learner (psd.learner.client.Learner) imports this module; it is typed Any here so that no import
# goes back to it (tests/test_imports.py).
Learner = Any

__all__ = ["InlinePull", "Pull", "ThreadPull", "ViewPull", "Weights"]


class Pull:
    """The pull mode of one mapping of a learner."""

    def __init__(self, learner: Learner) -> None:
        # A proxy: the learner holds its Pull, and no cycle keeps a dropped learner (its pull thread, its
        # mapping, its slot) alive until the cyclic collector runs.
        self.learner = weakref.proxy(learner)

    def map(self, a: _native.Arena) -> None:
        """Put the job's weights (as of the clock now) under the model's parameters."""
        raise NotImplementedError

    def take_newer(self, a: _native.Arena) -> int:
        """After a push: take newer weights if the job has them. Returns the bytes copied in (also when the
        clock stayed: weights a partial attach wrote outside an update)."""
        raise NotImplementedError

    def now(self) -> int:
        """Take the job's weights now, frozen ones too (``Learner.pull``); returns their clock."""
        raise NotImplementedError

    def unmap(self) -> None:
        """The mapping goes: leave the model on private memory."""


class ViewPull(Pull):
    """The parameters are views of the shared weights: nothing to copy."""

    def map(self, a: _native.Arena) -> None:
        ln = self.learner
        ln.clock = a.seen_clock(ln.slot)
        ln._set_params(split(ln._weights, ln._wspec))  # read-only pages: writing one is a SIGSEGV

    def take_newer(self, a: _native.Arena) -> int:
        ln = self.learner
        ln.clock = a.seen_clock(ln.slot)
        return 0

    def now(self) -> int:
        ln = self.learner
        ln.clock = ln._arena.seen_clock(ln.slot)
        ln._sync_model()
        return ln.clock

    def unmap(self) -> None:
        ln = self.learner
        if getattr(ln, "_weights", None) is not None:
            # The parameters are views of the mapping: keep the model usable on a private copy.
            ln._copy_own(ln._bufs[0], frozen=True)
            ln._point(0)


class InlinePull(Pull):
    """Copies into the front buffer, in the learner's thread."""

    def map(self, a: _native.Arena) -> None:
        ln = self.learner
        ln._log_pos, ln._epoch = a.rowlog_mark()  # before the copy: later changes are pulled again
        ln.clock = a.clock()
        ln._copy_own(ln._bufs[ln._front], frozen=True)
        # Pulls copy the trainable weights alone (nothing moves the frozen ones while the job runs):
        # both buffers get the frozen ones here, once per mapping.
        ln._copy_own(ln._bufs[1 - ln._front], trainable=False, frozen=True)
        if ln._lowp is not None:  # the parameters stay views of the model-dtype copy
            ln._set_params(split(ln._lowp, ln._wspec))
        ln._point(ln._front)

    def take_newer(self, a: _native.Arena) -> int:
        ln = self.learner
        copied = 0
        if ln.partial:
            clock = a.clock()
            if clock != ln.clock:
                copied = ln._copy_own(ln._bufs[ln._front])
                ln.pulled_bytes += copied
            a.note_pull(ln.slot, clock, clock == ln.clock)
            ln.clock = clock
        elif ln._rows_pull:
            ln.clock, ln._log_pos, ln._epoch, copied = a.pull_changed(
                ln.slot, ln._front_array, ln.clock, ln._log_pos, ln._epoch, ln._piece_table)
            ln.pulled_bytes += copied
        else:
            known = ln.clock
            ln.clock = a.pull_into(ln.slot, ln._front_array, ln.clock)
            ln.pulled_bytes += 4 * ln.n_train if ln.clock != known else 0
        return copied

    def now(self) -> int:
        ln = self.learner
        a = ln._arena
        ln._log_pos, ln._epoch = a.rowlog_mark()
        clock = a.clock()
        ln.pulled_bytes += ln._copy_own(ln._bufs[ln._front], frozen=True)
        if ln._front != 0:  # the frozen parameters are views of buffer 0 (Learner._point)
            ln._copy_own(ln._bufs[0], trainable=False, frozen=True)
        ln.clock = clock
        ln._sync_model()
        a.note_pull(ln.slot, clock, False)
        return clock


class ThreadPull(InlinePull):
    """The native pull thread fills the back buffer; a step swaps it in."""

    def __init__(self, learner: Learner) -> None:
        super().__init__(learner)
        self.puller = None

    def map(self, a: _native.Arena) -> None:
        super().map(a)
        ln = self.learner
        self.puller = a.start_puller(ln.slot, ln._bufs[ln._front].numpy(), ln._bufs[1 - ln._front].numpy(),
                                     ln.clock)

    def _take_filled(self) -> tuple[int, int] | None:
        """The buffer the pull thread filled, made the front (so that it is not writing ours), if any."""
        taken = self.puller.take()
        if taken is not None:
            self.learner._point(taken[0])
        return taken

    def take_newer(self, a: _native.Arena) -> int:
        ln = self.learner
        if ln.sync == "bsp":  # bsp trains on the round's result: pull it now, in this thread
            self._take_filled()
            copied = super().take_newer(a)
            self.puller.set_front_clock(ln.clock)
            return copied
        taken = self._take_filled()
        if taken is not None:
            ln.clock = taken[1]
            ln.pulled_bytes += 4 * ln.n_train
        self.puller.request()
        return 0

    def now(self) -> int:
        self._take_filled()
        clock = super().now()
        self.puller.set_front_clock(clock)
        return clock

    def unmap(self) -> None:
        if self.puller is not None:
            self.puller.stop()
            self.puller = None


class Weights:
    """The learner's side of its pulls: which buffer is the front, the parameters over it, the low-precision
    copy and the model's buffers brought up to date, the copies of its own ranges, and ``pull()``. A part of
    :class:`psd.learner.Learner` (its base class); the buffers it moves live on the learner, and its ``Pull``
    (above) decides how they are filled."""

    def _point(self, index: int) -> None:
        """Make buffer ``index`` the front: a float32 model's parameters become views of it."""
        self._front = index
        self._front_array = self._bufs[index].numpy()
        if self._lowp is None:
            # The trainable parameters follow the front buffer; the frozen ones stay views of buffer 0's
            # copy (pulls move only the trainable weights), so a local write to one survives every swap.
            t = len(self._train)
            self._set_params(self._buf_views[index][:t] + self._buf_views[0][t:])

    def _set_params(self, views: list[torch.Tensor]) -> None:
        """Make the parameters (trainable, then frozen) these views, without copying."""
        with torch.no_grad():
            for p, v in zip(self._params, views, strict=True):
                p.data = v

    def _sync_model(self, frozen: bool = True) -> None:
        """New weights are in the front buffer: bring them to a low-precision model, with the job's buffers.

        ``frozen=False`` (a step's pull, which moved only the trainable weights) leaves the model's frozen
        weights as they are."""
        if self._lowp is not None:
            front = self._bufs[self._front]
            for off, length, is_frozen in self._own:
                if frozen or not is_frozen:
                    self._lowp[off:off + length].copy_(front[off:off + length])
        self._pull_buffers()

    def _copy_own(self, dst: torch.Tensor, trainable: bool = True, frozen: bool = False) -> int:
        """Copy this learner's weights (all, or a partial attach's own) from the job's into ``dst``; the bytes."""
        if self._present is None:  # the whole model: the trainable prefix, the frozen rest, or both, in one copy
            lo, hi = 0 if trainable else self.n_train, self.n_params if frozen else self.n_train
            dst[lo:hi].copy_(self._weights[lo:hi])
            return 4 * (hi - lo)
        done = 0
        for off, length, is_frozen in self._own:
            if (frozen if is_frozen else trainable):
                dst[off:off + length].copy_(self._weights[off:off + length])
                done += 4 * length
        return done

    def _take_newer(self, a: _native.Arena) -> None:
        """Swap in newer weights, if the job has them (the pull after a push, or an empty step)."""
        before = self.clock
        copied = self._pull.take_newer(a)
        if self.clock != before or copied:  # (copied: weights written outside an update, same clock)
            if self.predict:
                self._predict()
            self._sync_model(frozen=False)

    def pull(self) -> int:
        """Copy the current shared weights into the model now; returns their clock.

        With ``pull="view"`` the model computes on the shared weights already: this only takes the
        job's buffers and the clock."""
        if self._pull is None:
            raise Error(f"this learner of job {self.job!r} is closed (or lost its job and could not reattach): "
                        f"attach the model again (psd.learner.attach)")
        return self._pull.now()
