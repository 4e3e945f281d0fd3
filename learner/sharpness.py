"""The sharpness a job feels, measured by a learner for ``--async-momentum auto`` (psd/gain.py).

The server needs to know how much of one process's momentum gain a job can keep under staleness without
leaving the edge of stability: a job whose lr times sharpness is small keeps it all, one near one process's
edge keeps none. The sharpness measured is the loss's curvature along the direction the job moves: the
Rayleigh quotient of the mini-batch loss's Hessian at the mini-batch's own gradient, ``g.Hg / g.g``, which
weighs each direction's curvature by how much of the gradient lies along it.

The Hessian's largest eigenvalue (what an earlier version measured, by power iteration) is too cautious:
the convergence matrix's character-level LSTM runs at lr x (largest eigenvalue) 0.2, four times past the
quadratic model's edge for the full gain at a staleness of 2, and trains there as one process does; its
curvature along the gradient is 0.02-0.05, at that edge. The BatchNorm CNN at one process's edge reads
0.08-0.29 along its gradient over one process's run (0.70 at the start), where the full gain diverges
(benchmarks/delayed_momentum.py, ``--along``; benchmarks/results/matrix/README.md).

Measured by one finite-difference Hessian-vector product, ``H v ~ (g(w + eps v) - g(w)) / eps`` with ``v``
the gradient's direction, each gradient from the user's closure (torch.optim's ``step(closure)``: it
recomputes the mini-batch's loss and gradients). The closure runs under a fixed random seed each time (the
same dropout masks for both gradients); the weights, the gradients and the module's buffers (BatchNorm's
statistics) are put back afterwards, so training goes on as if nothing happened, and the caller's random
streams are untouched. A loss that is flat or bends down along the gradient reads ``FLAT`` (the level
is then as high as the staleness allows); NaN means the closure gave no usable gradient. Curvature rises
fastest early in training (progressive sharpening), so the first measurements come at steps 1, 2, 4, ...,
32, then every ``EVERY``. Cost: 2 extra forward and backward passes every ``EVERY`` steps (4% at the
default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["EVERY", "FLAT", "SharpnessProbe"]

EVERY = 50  # steps between measurements (after steps 1, 2, 4, ..., 32)
REL_EPS = 1e-3  # the finite difference's step, relative to the weights' norm (at least 1)
FLAT = 1e-12  # the reading of a loss that is flat or bends down along the gradient


class SharpnessProbe:
    """Measures the curvature of a model's loss along its gradient now and then from a closure.

    ``params``: the trainable tensors; ``module``: the model, whose buffers (BatchNorm's statistics) are taken
    at each measurement and restored after it (taken then, not now: a learner replaces them with views of its
    own storage after this is built; None: no buffers). ``every``: measure at calls 1, 2, 4, ... below
    ``every`` of :meth:`due`, then at every ``every``-th (0: never)."""

    def __init__(self, params: Sequence[torch.Tensor], every: int = EVERY,
                 module: torch.nn.Module | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.module = module
        self.every = int(every)
        self.calls = 0
        self.last = math.nan  # the last measurement (NaN: none yet, or none usable)
        self._gen = torch.Generator().manual_seed(0x5eed)  # its own randomness: the user's stays theirs

    def due(self) -> bool:
        """Count a step; true when this one should measure."""
        self.calls += 1
        n = self.calls
        return self.every > 0 and bool(self.params) and ((n < self.every and n & (n - 1) == 0) or n % self.every == 0)

    def _grads(self, closure: Callable[[], Any], seed: int, devices: list[int]) -> list[torch.Tensor]:
        for p in self.params:
            p.grad = None
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.manual_seed(seed)
            closure()
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().to_dense().clone() for p in self.params]

    def measure(self, closure: Callable[[], Any]) -> float:
        """The loss's curvature along the mini-batch's gradient at the current weights (at least ``FLAT``; NaN if
        the closure gave no usable gradient)."""
        params = self.params
        buffers = list(self.module.buffers()) if self.module is not None else []
        devices = sorted({p.device.index or 0 for p in params if p.is_cuda})
        seed = int(torch.randint(0, 2**62, (), generator=self._gen))
        with torch.no_grad():
            w0 = [p.detach().clone() for p in params]
            b0 = [b.detach().clone() for b in buffers]
        grads = [p.grad for p in params]
        lam = math.nan
        try:
            g0 = self._grads(closure, seed, devices)
            norm = math.sqrt(sum(float((g * g).sum()) for g in g0))
            if norm > 0 and math.isfinite(norm):
                v = [g / norm for g in g0]
                eps = REL_EPS * max(1.0, math.sqrt(sum(float((w * w).sum()) for w in w0)))
                with torch.no_grad():
                    for p, w, x in zip(params, w0, v, strict=True):
                        p.copy_(w).add_(x, alpha=eps)
                g1 = self._grads(closure, seed, devices)
                lam = sum(float(((a - b) * x).sum()) for a, b, x in zip(g1, g0, v, strict=True)) / eps
        finally:
            with torch.no_grad():
                for p, w in zip(params, w0, strict=True):
                    p.copy_(w)
                for b, old in zip(buffers, b0, strict=True):
                    b.copy_(old)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
        # A loss that is flat or bends down along the gradient reads FLAT: a reading (the server counts only
        # positive ones), the flattest there is
        self.last = max(lam, FLAT) if math.isfinite(lam) else math.nan
        return self.last
