"""One `psd bench` run: every measurement in turn, reported as figures and psd/peer ratios."""

from __future__ import annotations

import json
import os
import statistics

from psd import __version__, _native
from psd.bench._common import BenchConfig
from psd.bench.kernels import idle_cpu, kernels, limit, update_loop
from psd.bench.round_trip import gpu_round_trip, round_trip
from psd.bench.training import training


def run(cfg: BenchConfig, log=print) -> dict:
    """Every workload; the result is what `psd bench --json` prints."""
    threads = sorted({1, max(1, _native.omp_info()["max_threads"])})
    out: dict = {"psd_version": __version__, "cpus": len(os.sched_getaffinity(0)), "limit": [], "update_loop": []}
    for t in threads:
        lims, loops = [], []
        for _ in range(max(1, cfg.reps)):  # taking turns, as the round trips do
            lims.append(limit(cfg.limit_size, t))
            loops.append(update_loop(cfg.limit_size, t))
        lim, loop = statistics.median(lims), statistics.median(loops)
        out["limit"].append({"params": cfg.limit_size, "threads": t, "gbs": lim})
        out["update_loop"].append({"params": cfg.limit_size, "threads": t, "gbs": loop,
                                   "fraction_of_limit": loop / lim})
        log(f"limit       {cfg.limit_size:>11,} params  {t} thread(s)  {lim:6.2f} GB/s;  update loop {loop:6.2f} GB/s "
            f"= {loop / lim:.2f} of the limit")
    out["kernels"] = kernels(cfg.limit_size)
    for row in out["kernels"]:
        log(f"kernel      {row['params']:>11,} params  {row['kernel']:<12} {row['gbs']:6.2f} GB/s")
    out["idle_server_cpu"] = idle_cpu()
    log(f"idle server {out['idle_server_cpu']:.2%} of a core")
    out["round_trip"] = round_trip(cfg, log)
    out["training"] = training(cfg, log) if cfg.training else []
    out["gpu_round_trip"] = gpu_round_trip(cfg, log)
    return out


def main_json(cfg: BenchConfig) -> str:
    return json.dumps(run(cfg, log=lambda *a: None), indent=2)
