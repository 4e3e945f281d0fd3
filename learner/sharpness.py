"""The loss's sharpness, measured by a learner for ``--async-momentum auto`` (psd/gain.py).

The sharpness is the largest eigenvalue of the mini-batch loss's Hessian. The server needs it to know how
much of one process's momentum gain a job can keep under staleness without leaving the edge of stability:
a job whose lr times sharpness is small keeps it all, one near one process's edge keeps none.

Measured by power iteration on finite-difference Hessian-vector products, ``H v ~ (g(w + eps v) - g(w)) /
eps``, each gradient from the user's closure (torch.optim's ``step(closure)``: it recomputes the
mini-batch's loss and gradients). The closure runs under a fixed random seed each time (the same dropout
masks for both gradients); the weights, the gradients and the module's buffers (BatchNorm's statistics)
are put back afterwards, so training goes on as if nothing happened, and the caller's random streams are
untouched. The direction ``v`` carries over between measurements (a warm start), so ``ITERS`` products
suffice after the first measurement's ``COLD_ITERS`` (power iteration from a random direction underestimates
until it has converged). Sharpness rises fastest early in training (progressive sharpening), so the first
measurements come at steps 1, 2, 4, ..., 32, then every ``EVERY``. Cost: ``1 + ITERS`` extra forward and
backward passes every ``EVERY`` steps (6% at the defaults).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["COLD_ITERS", "EVERY", "ITERS", "SharpnessProbe"]

EVERY = 50  # steps between measurements (after steps 1, 2, 4, ..., 32)
ITERS = 2  # Hessian-vector products a measurement, warm
COLD_ITERS = 8  # the first measurement's
REL_EPS = 1e-3  # the finite difference's step, relative to the weights' norm (at least 1)


class SharpnessProbe:
    """Measures the sharpness of a model's loss now and then from a closure.

    ``params``: the trainable tensors; ``buffers``: the module's buffers, restored after each
    measurement. ``every``: measure at calls 1, 2, 4, ... below ``every`` of :meth:`due`, then at every
    ``every``-th (0: never)."""

    def __init__(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor] = (), every: int = EVERY,
                 iters: int = ITERS) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.buffers = list(buffers)
        self.every = int(every)
        self.iters = max(1, int(iters))
        self.calls = 0
        self.last = math.nan  # the last measurement (NaN: none yet)
        self._v: list[torch.Tensor] | None = None
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
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params]

    def measure(self, closure: Callable[[], Any]) -> float:
        """The sharpness at the current weights (NaN if the closure gave no usable gradient)."""
        params = self.params
        devices = sorted({p.device.index or 0 for p in params if p.is_cuda})
        seed = int(torch.randint(0, 2**62, (), generator=self._gen))
        with torch.no_grad():
            w0 = [p.detach().clone() for p in params]
            b0 = [b.detach().clone() for b in self.buffers]
        grads = [p.grad for p in params]
        lam = math.nan
        try:
            g0 = self._grads(closure, seed, devices)
            v = self._v or [torch.randn(p.shape, generator=self._gen).to(p) for p in params]
            eps = REL_EPS * max(1.0, math.sqrt(sum(float((w * w).sum()) for w in w0)))
            for _ in range(self.iters if self._v else COLD_ITERS):
                norm = math.sqrt(sum(float((x * x).sum()) for x in v))
                if not (norm > 0 and math.isfinite(norm)):
                    break
                v = [x / norm for x in v]
                with torch.no_grad():
                    for p, w, x in zip(params, w0, v, strict=True):
                        p.copy_(w).add_(x, alpha=eps)
                g1 = self._grads(closure, seed, devices)
                hv = [(a - b) / eps for a, b in zip(g1, g0, strict=True)]
                lam = sum(float((h * x).sum()) for h, x in zip(hv, v, strict=True))
                v = hv
            self._v = [x.detach() for x in v]
        finally:
            with torch.no_grad():
                for p, w in zip(params, w0, strict=True):
                    p.copy_(w)
                for b, old in zip(self.buffers, b0, strict=True):
                    b.copy_(old)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
        self.last = abs(lam) if math.isfinite(lam) else math.nan
        return self.last
