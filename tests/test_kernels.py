"""The server's optimizer kernels (native/optim.c, vectorised, cloned for AVX2 / AVX-512) against torch.optim.

Every optimizer, weight decay on and off, float32 and bfloat16 gradients, one and two threads, sizes that
leave every vector tail (1 to 2 vectors of 16 plus odd remainders, and one over the threaded cut-off) and
buffers that start off a vector boundary: three updates of `_native.optimizer_step` must match torch's
single-tensor optimizer (foreach=False) to 1e-6 relative, three seeds each (fixed, so a failure reruns).

Weight decay is torch's `grad.add(param, alpha=wd)`, one fused multiply-add: where the gradient and
wd * w nearly cancel, the sum's last bit decides Adam's and Adagrad's first step (they divide it by its
own size), so a kernel that rounded the product first would differ from torch by up to lr there. The
random data reaches such elements (about one run in seventy at 65,549 elements did before the kernels fused it).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from psd import _native

LR, MOM, B1, B2 = 0.01, 0.9, 0.9, 0.999


def torch_optimizer(name: str, p: torch.nn.Parameter, wd: float, eps: float) -> torch.optim.Optimizer:
    kw = {"lr": LR, "weight_decay": wd, "foreach": False}
    if name == "sgd":
        return torch.optim.SGD([p], **kw)
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD([p], momentum=MOM, nesterov=name == "nesterov", **kw)
    if name == "adam":
        return torch.optim.Adam([p], betas=(B1, B2), eps=eps, **kw)
    if name == "adamw":
        return torch.optim.AdamW([p], betas=(B1, B2), eps=eps, **kw)
    return torch.optim.Adagrad([p], eps=eps, **kw)


def unaligned(n: int, fill: np.ndarray | float = 0.0) -> np.ndarray:
    """A float32 array of n that starts 4 bytes past a 64-byte boundary (every vector load is unaligned)."""
    raw = np.zeros(n + 32, dtype=np.float32)
    start = (-raw.ctypes.data % 64) // 4 + 1
    out = raw[start:start + n]
    out[:] = fill
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("wd", [0.0, 0.05], ids=["no-decay", "decay"])
@pytest.mark.parametrize("name", ["sgd", "momentum", "nesterov", "adam", "adamw", "adagrad"])
def test_kernels_match_torch_optim(name, wd, bf16, threads, seed):
    eps = 1e-10 if name == "adagrad" else 1e-8
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name} {wd} {bf16} {threads} {seed}".encode()))
    for n in (1, 15, 33, 67, (1 << 16) + 13):
        w0 = torch.randn(n, generator=gen)
        w, s0, s1 = unaligned(n, w0.numpy()), unaligned(n), unaligned(n)
        p = torch.nn.Parameter(w0.clone())
        ref = torch_optimizer(name, p, wd, eps)
        for t in (1, 2, 3):
            g = torch.randn(n, generator=gen)
            if bf16:
                g = g.to(torch.bfloat16)
                gbuf = g.view(torch.int16).numpy().view(np.uint16)
            else:
                gbuf = unaligned(n, g.numpy())
            bad = _native.optimizer_step(name, w, gbuf, s0, s1, LR, t, threads, wd, MOM, B1, B2, eps, 1.0, bf16)
            assert bad == 0
            p.grad = g.float()
            ref.step()
            torch.testing.assert_close(torch.from_numpy(w.copy()), p.detach(), rtol=1e-6, atol=1e-7,
                                       msg=f"{name} n={n} step {t}")


def test_a_non_finite_gradient_moves_nothing_and_is_counted():
    n = 37
    w, s0, s1 = unaligned(n, 1.0), unaligned(n), unaligned(n)
    g = unaligned(n, 0.5)
    g[3], g[20] = np.nan, np.inf
    bad = _native.optimizer_step("adam", w, g, s0, s1, LR, 1, 1, 0.0, MOM, B1, B2, 1e-8, 1.0, False)
    assert bad > 0
    assert w[3] == 1.0 and w[20] == 1.0 and s0[3] == 0.0 and w[4] < 1.0  # taken as 0: Adam moves it not at all


def test_bad_arguments_are_clear_errors():
    w = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="unknown optimizer"):
        _native.optimizer_step("lamb", w, w, None, None, LR, 1, 1, 0.0, MOM, B1, B2, 1e-8, 1.0, False)
    with pytest.raises(ValueError, match="state vector"):
        _native.optimizer_step("adam", w, w, None, None, LR, 1, 1, 0.0, MOM, B1, B2, 1e-8, 1.0, False)
    with pytest.raises(ValueError, match="t >= 1"):
        _native.optimizer_step("sgd", w, w, None, None, LR, 0, 1, 0.0, MOM, B1, B2, 1e-8, 1.0, False)
