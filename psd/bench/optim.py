"""The server's optimizer kernels against the strongest CPU peers, at the same thread count.

One update of 10^6 to 10^8 float32 parameters: psd's kernel (``_native.optimizer_step``, what the update
loop runs per gradient) against torch.optim's fused CPU optimizers (``fused=True``) and, where it is
installed, DeepSpeed's CPU Adam. Each is reported as ms per update, the GB/s of the bytes it must move
(each of w, g and the state read once and written once), and that as a fraction of the stream limit
measured in the same run (``kernels.limit``: ``w -= lr*g`` at that size and thread count, the memory
roofline). ``benchmarks/optim_kernels.py`` runs it and writes the tables and the plot.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from psd import _native
from psd.bench.kernels import limit

__all__ = ["BYTES_PER_PARAM", "OPTIMIZERS", "measure"]

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "adagrad")
# Bytes each update must move per parameter: w read+write, g read, each state vector read+write.
BYTES_PER_PARAM = {"sgd": 12, "momentum": 20, "nesterov": 20, "adam": 28, "adamw": 28, "adagrad": 20}
LR, WD = 1e-3, 0.01


def _median_ms(step: Callable[[], Any], reps: int) -> float:
    step()  # first touch, state allocation
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _torch_fused(name: str, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    wd = WD if name == "adamw" else 0.0
    if name == "sgd":
        return torch.optim.SGD([p], lr=LR, fused=True)
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD([p], lr=LR, momentum=0.9, nesterov=name == "nesterov", fused=True)
    if name == "adam":
        return torch.optim.Adam([p], lr=LR, fused=True)
    if name == "adamw":
        return torch.optim.AdamW([p], lr=LR, weight_decay=wd, fused=True)
    return torch.optim.Adagrad([p], lr=LR, fused=True)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to 2 meanwhile: DeepSpeed's op prints from C++ (past sys.stdout), and
    ``psd bench --json`` keeps stdout for its JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _deepspeed_adam(name: str, p: torch.nn.Parameter) -> torch.optim.Optimizer | None:
    """DeepSpeed's CPU Adam (the ``deepspeed`` extra), or None where it is not installed or does not build."""
    if name not in ("adam", "adamw"):
        return None
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:
        return None
    try:
        return DeepSpeedCPUAdam([p], lr=LR, weight_decay=WD if name == "adamw" else 0.0, adamw_mode=name == "adamw")
    except Exception:
        return None


def measure(n: int, threads: int, optimizers: tuple[str, ...] = OPTIMIZERS, reps: int = 7,
            log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per optimizer at ``n`` parameters and ``threads`` threads: ms, GB/s and roofline fraction of
    psd, torch fused and DeepSpeed (None where absent), and the psd / peer ratios (> 1: psd is faster)."""
    torch.set_num_threads(threads)
    stream = limit(n, threads)  # GB/s of w -= lr*g: 12 bytes a parameter
    rows = []
    for name in optimizers:
        w = np.zeros(n, np.float32)
        g = np.full(n, 1e-3, np.float32)
        s0 = np.zeros(n, np.float32) if name != "sgd" else None
        s1 = np.zeros(n, np.float32) if name in ("adam", "adamw") else None
        t = [0]

        def ours(w=w, g=g, s0=s0, s1=s1, name=name, t=t) -> None:
            t[0] += 1
            _native.optimizer_step(name, w, g, s0, s1, LR, t[0], threads, WD if name == "adamw" else 0.0, 0.9, 0.9,
                                   0.999, 1e-8, 1.0, False)

        psd_ms = _median_ms(ours, reps)
        del w, g, s0, s1
        peers: dict[str, float | None] = {}
        for peer, make in (("torch_fused", _torch_fused), ("deepspeed", _deepspeed_adam)):
            p = torch.nn.Parameter(torch.zeros(n))
            p.grad = torch.full((n,), 1e-3)
            with _stdout_to_stderr() if peer == "deepspeed" else contextlib.nullcontext():
                opt = make(name, p)
                peers[peer] = None if opt is None else _median_ms(opt.step, reps)
            del opt, p
        nbytes = BYTES_PER_PARAM[name] * n

        def gbs(ms: float | None, nbytes: int = nbytes) -> float | None:
            return None if ms is None else nbytes / (ms / 1e3) / 1e9

        row = {"optimizer": name, "params": n, "threads": threads, "stream_gbs": stream,
               "psd_ms": psd_ms, "psd_gbs": gbs(psd_ms), "psd_roofline": gbs(psd_ms) / stream,
               "torch_fused_ms": peers["torch_fused"], "torch_fused_gbs": gbs(peers["torch_fused"]),
               "deepspeed_ms": peers["deepspeed"], "deepspeed_gbs": gbs(peers["deepspeed"]),
               "vs_torch_fused": peers["torch_fused"] / psd_ms if peers["torch_fused"] else None,
               "vs_deepspeed": peers["deepspeed"] / psd_ms if peers["deepspeed"] else None}
        rows.append(row)
        log(f"  {name:9s} {n:>11,} params {threads} thread(s): psd {psd_ms:8.2f} ms ({row['psd_roofline']:.2f} of "
            f"{stream:.1f} GB/s), torch fused {peers['torch_fused'] or float('nan'):8.2f} ms"
            + (f", DeepSpeed {peers['deepspeed']:.2f} ms" if peers["deepspeed"] else ""))
    return rows
