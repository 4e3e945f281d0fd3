"""One `psd bench` run: every measurement in turn, reported as figures and psd/peer ratios."""

from __future__ import annotations

import json
import os

from psd import __version__
from psd.bench._common import BenchConfig
from psd.bench.kernels import dram_params, idle_cpu, kernels, limits
from psd.bench.optim import measure
from psd.bench.record import machine
from psd.bench.round_trip import gpu_round_trip, round_trip
from psd.bench.training import training


def optimizer_kernels(cfg: BenchConfig, log=print) -> list[dict]:
    """psd's optimizer kernels against torch's fused ones (and DeepSpeed's CPU Adam, where installed) at each
    of ``cfg.optimizer_sizes``, one thread and every usable core: rows of ``psd.bench.optim.measure``."""
    import torch

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    rows: list[dict] = []
    try:
        for n in cfg.optimizer_sizes:
            for threads in sorted({1, cores}):
                rows += measure(n, threads, reps=max(3, 2 * cfg.reps + 1), log=lambda line: log("optimizer" + line))
    finally:
        torch.set_num_threads(before)
    return rows


def run(cfg: BenchConfig, log=print) -> dict:
    """Every workload; the result is what `psd bench --json` prints."""
    out: dict = {"psd_version": __version__, "cpus": len(os.sched_getaffinity(0)), "machine": machine()}
    from psd.server import auto_threads

    out["server_threads"] = cfg.server_threads or auto_threads()
    log(f"server threads {out['server_threads']} (the round trips' and training's update loops)")
    if cfg.limits:
        out.update(limits(cfg, log))
        # The kernels over the DRAM limit's vector, where memory shows (and over one in the core's cache).
        out["kernels"] = kernels(dram_params(cfg, out["llc_bytes"]))
        for row in out["kernels"]:
            log(f"kernel      {row['params']:>11,} params  {row['kernel']:<12} {row['gbs']:6.2f} GB/s")
    out["optimizer_kernels"] = optimizer_kernels(cfg, log) if cfg.peers else []
    out["idle_server_cpu"] = idle_cpu()
    log(f"idle server {out['idle_server_cpu']:.2%} of a core")
    out["pull_modes"] = ["copy", "view"] if cfg.view_pulls() else ["copy"]
    out["grad_dtypes"] = ["float32", "bf16"] if "bf16" in cfg.grad_dtypes else ["float32"]
    out["learner_sched"] = cfg.learner_sched
    out["overlap_modes"] = ["auto", *cfg.overlap_modes]
    out["round_trip"] = round_trip(cfg, log)
    out["training"] = training(cfg, log) if cfg.training else []
    out["gpu_round_trip"] = gpu_round_trip(cfg, log)
    return out


def main_json(cfg: BenchConfig) -> str:
    return json.dumps(run(cfg, log=lambda *a: None), indent=2, allow_nan=False)
