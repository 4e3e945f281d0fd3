"""The push path of a learner's step: take the mini-batch's gradients (``p.grad``, sparse rows, dtypes) into
its ring, then wait for ring space and for the job's sync mode (bsp rounds, ssp bounds) before it takes
newer weights. ``Learner.step`` (learner/client.py) decides what a step pushes (learner/waves.py: a wave's
mean under ``--push-every``).

``Pushing`` is the part of :class:`psd.learner.Learner` that does it.
"""

from __future__ import annotations

import time

import torch

from psd import _native

__all__ = ["Pushing"]


class Pushing:
    """What a learner pushes, and the waits that follow a push. A part of
    :class:`psd.learner.Learner` (one of its base classes); what it reads and writes lives on the learner."""

    def _grads_of(self, mask: tuple[int, ...] | None) -> list[torch.Tensor | None]:
        """This mini-batch's gradients of the trained tensors (all, or those in ``mask``: None for the
        others), each ``p.grad`` of them reset to None, as ``zero_grad()`` does: the next backward pass
        writes fresh gradients instead of adding into zeroed ones, which saves a pass over the model."""
        out: list[torch.Tensor | None] = [None] * len(self._train)
        for k in range(len(self._train)) if mask is None else mask:
            p = self._train[k]
            out[k] = p.grad
            p.grad = None
        return out

    def _has_gradient(self, mask: tuple[int, ...] | None) -> bool:
        train = self._train
        return any(train[k].grad is not None for k in (range(len(train)) if mask is None else mask))

    def _take_gradients(self, gs: list[torch.Tensor | None]) -> tuple[list, list[int], list | None]:
        """The gradients ``gs`` as the push takes them (kept alive for the copy), their addresses (0:
        none) and the sparse ones' rows ((tensor index, rows address, row count, row length), or
        None). A tensor without a gradient gets no update from this push at all, as in torch.optim."""
        keep, ptrs, sparse = [], [], None
        for k, g in enumerate(gs):
            if g is None:
                ptrs.append(0)
                continue
            if g.layout == torch.sparse_coo and k in self._sparse and g.sparse_dim() == 1:
                g = g.coalesce()  # repeated rows add up first (Adagrad squares the sum)
                rows, vals = g.indices()[0].contiguous(), g.values().to(self.dtype).contiguous()
                if rows.numel() == 0:
                    ptrs.append(0)
                    continue
                keep += [rows, vals]
                ptrs.append(vals.data_ptr())
                sparse = (sparse or []) + [(k, rows.data_ptr(), rows.numel(), self._row_lens[k])]
                continue
            if g.layout != torch.strided:
                g = g.to_dense()  # sparse (any layout) or mkldnn
            if g.dtype != self.dtype:
                g = g.to(self.dtype)
            if not g.is_contiguous():
                g = g.contiguous()
            keep.append(g)
            ptrs.append(g.data_ptr())
        return keep, ptrs, sparse

    def _push(self, lv: float, batch_size: int, gs: list[torch.Tensor | None], own: bool = True) -> None:
        """Push the gradients ``gs``, then wait for ring space, the sync mode and (``own``, where --overlap says so)
        the server's update with them, and pull."""
        a = self._arena
        if self.predict and self._tail >= self._k:
            self._sample_staleness(self._tail - self._k)
        rounds = a.rounds() if self.sync == "bsp" else 0
        grads, ptrs, sparse = self._take_gradients(gs)
        t0 = time.perf_counter_ns()
        a.push_from(self.slot, self.clock, int(batch_size), lv, 1.0, ptrs, self._numels, self._dtype_code,
                    self._buffer_delta(), sparse, self._store)
        self.push_ns = time.perf_counter_ns() - t0
        del grads
        self._tail += 1
        self.pushed += 1
        self._after_push(a, rounds, own)

    def _after_push(self, a: _native.Arena, rounds: int, own: bool = True) -> None:
        """What follows a push: wait for ring space, for the sync mode and (``own``: where --overlap says so)
        for the server to apply it, then take newer weights."""
        if not a.has_space(self.slot):
            self._with_server(self._arena.wait_space, self.slot, self._claim_token, self.timeout)
            if self._arena is not a:
                return  # reattached to a new arena: weights pulled
        if self.sync == "bsp":
            self._wait_sync(a.wait_round, "the bsp round", self.slot, self._claim_token, rounds)
        elif self.sync == "ssp":
            self._wait_sync(a.wait_ssp, "the ssp bound", self.slot, self._claim_token)
        if own and self.waits_for_own and self._arena is a:  # the next gradient holds this one (--overlap)
            self._with_server(a.wait_drained, self.slot, self._claim_token, self.timeout)
        if self._arena is not a:
            return
        self._take_newer(a)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the server has applied every gradient this learner pushed."""
        self._with_server(self._arena.wait_drained, self.slot, self._claim_token,
                          self.timeout if timeout is None else timeout)
