"""Round trips: null learners pushing a precomputed gradient and pulling fresh weights against a live
server, beside the peers; and the GPU round trip.

Model traffic counts the pulls the learners actually made (the slot's ``pulls`` counter): a learner
skips a pull when the clock has not moved and its pull thread merges requests, so "one pull per update"
would overstate it. ``psd_view`` is the same learner attached with ``pull="view"``: its parameters are
views of the shared weights and it copies nothing back; ``psd_bf16`` (and ``psd_view_bf16``) push
bfloat16 gradients (``--grad-dtype bf16``); ``psd_overlap_on`` / ``psd_overlap_off`` are the default learner in a
job with ``--overlap on`` (it pulls right after its push) / ``off`` (once the server applied it); the job
runs sgd, so its default (``auto``) is ``off`` (docs/training.md).
"""

from __future__ import annotations

import os
import time
from functools import partial

from psd.bench._common import (
    LR,
    BenchConfig,
    _interleaved,
    _percentiles,
    _server_thread,
    _timed,
    reporting,
    set_learner_sched,
)
from psd.bench.peers import _ddp_round_trip, _hogwild_round_trip


def _pulls(ps) -> int | None:
    """The slot's count of pulls that copied the weights (skipped ones are counted apart); None where
    the learner does not say."""
    try:
        return int(ps._arena.slot_info(ps.slot)["pulls"])
    except (AttributeError, KeyError, TypeError):
        return None


@reporting
def _psd_null_learner(job: str, n: int, device: str, duration: float, pull: str, sched: tuple[str, int],
                      barrier, q) -> None:
    """A learner whose gradient is precomputed (on ``device``: a GPU model is a DeviceLearner); ``pull``
    is attach()'s pull mode, ``sched`` (policy name, learners) its scheduling as under `psd run`."""
    import torch

    from psd import learner

    set_learner_sched(*sched)
    torch.set_num_threads(1)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(n, device=device))
    g = torch.full((n,), 1e-6, device=device)
    with learner.attach(m, job=job, timeout=120, pull=pull) as ps:
        for _ in range(ps._k + 1):  # touch every ring entry once: page faults are set-up, not traffic
            m.w.grad = g
            ps.step()
        ps.flush()
        barrier.wait()
        pulls0 = _pulls(ps)
        lat, push, k = [], [], 0
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            m.w.grad = g  # the precomputed gradient, where a backward pass would leave it
            t0 = time.perf_counter_ns()
            ps.step()
            lat.append(time.perf_counter_ns() - t0)
            push.append(ps.push_ns)
            k += 1
        pulls1 = _pulls(ps)
        threads = ps._arena.header()["threads"]  # the job's update-loop threads, as its server recorded them
        ps.flush()
        # A reconnect (a new arena, its counters from zero) would make the difference meaningless.
        pulls = None if pulls0 is None or pulls1 is None or pulls1 < pulls0 else pulls1 - pulls0
        q.put({"updates": k, "pulls": pulls, "lat": lat, "push": push, "server_threads": threads})


def _traffic(results: list[dict], n: int, elapsed: float, grad_bytes: int = 4) -> dict:
    """updates/s, model GB/s (a gradient in per update, of ``grad_bytes`` an element, the float32 weights out
    per pull made) and pulls per update. Where a learner did not count its pulls, one per update is
    assumed and ``pulls_counted`` is false."""
    updates = sum(r["updates"] for r in results)
    counted = all(r.get("pulls") is not None for r in results)
    pulls = sum(r["pulls"] for r in results) if counted else updates
    return {"updates_per_s": updates / elapsed, "model_gbs": (updates * grad_bytes + pulls * 4) * n / elapsed / 1e9,
            "pulls_per_update": pulls / updates if updates else 0.0, "pulls_counted": counted}


def host_device_gbs(device: str = "cuda:0", mib: int = 256) -> dict:
    """Pinned host <-> device copy bandwidth, GB/s each way (the ceiling of a GPU learner's traffic)."""
    import torch

    host = torch.empty(mib << 18, dtype=torch.float32).pin_memory()
    dev = torch.empty_like(host, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        for _ in range(2):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        out[name] = 5 * host.numel() * 4 / (time.perf_counter() - t0) / 1e9
    return out


def gpu_round_trip(cfg: BenchConfig, log=print) -> dict:
    """GPU learners (placed round-robin on the GPUs present) pushing and pulling through psd: model
    traffic in GB/s, as a fraction of the measured pinned host <-> device bandwidth."""
    import torch

    if not torch.cuda.is_available():
        log("gpu round trip: skipped (no CUDA device; torch reports none)")
        return {"skipped": "no CUDA device"}
    from psd.server import ServeConfig, Server

    gpus = torch.cuda.device_count()
    bw = host_device_gbs()
    rows = []
    for n in cfg.sizes:
        for k in cfg.learners:
            job = f"bench-gpu-{os.getpid()}-{n}-{k}"
            server = Server(ServeConfig(job=job, learners=k, lr=LR, ring_depth=4, threads=cfg.server_threads))
            server.start()
            stop = _server_thread(server)
            try:
                results, elapsed = _timed([(_psd_null_learner, (job, n, f"cuda:{r % gpus}", cfg.duration, "copy",
                                                                (cfg.learner_sched, k)))
                                           for r in range(k)])
            finally:
                stop()
            traffic = _traffic(results, n, elapsed)
            rate, gbs = traffic["updates_per_s"], traffic["model_gbs"]
            row = {"params": n, "learners": k, "gpus": min(k, gpus), **traffic,
                   "fraction_of_pcie": gbs / ((bw["h2d"] + bw["d2h"]) / 2)}
            rows.append(row)
            log(f"gpu round trip {n:>11,} params  {k} learner(s) on {row['gpus']} GPU(s)  {rate:10,.0f} upd/s  "
                f"{gbs:6.2f} GB/s = {row['fraction_of_pcie']:.2f} of host<->device")
    return {"host_device_gbs": bw, "gpus": gpus, "rows": rows}


def _psd_round_trip(n: int, learners: int, duration: float, pull: str = "copy", sched: str = "auto",
                    grad_dtype: str = "float32", overlap: str = "auto", threads: int = 0) -> dict:
    from psd.server import ServeConfig, Server

    job = f"bench-{os.getpid()}-{n}-{learners}-{pull}-{grad_dtype}-{overlap}"
    server = Server(ServeConfig(job=job, learners=learners, lr=LR, ring_depth=4, threads=threads, grad_dtype=grad_dtype,
                                overlap=overlap))
    server.start()
    stop = _server_thread(server)
    try:
        results, elapsed = _timed([(_psd_null_learner, (job, n, "cpu", duration, pull, (sched, learners)))]
                                  * learners)
    finally:
        stop()
    p50, p99 = _percentiles([x for r in results for x in r["lat"]])
    push50, push99 = _percentiles([x for r in results for x in r["push"]])
    traffic = _traffic(results, n, elapsed, 2 if grad_dtype == "bf16" else 4)
    return {**traffic, "step_p50_us": p50, "step_p99_us": p99, "push_p50_us": push50,
            "push_p99_us": push99, "server_threads": results[0]["server_threads"]}


PEERS = ("hogwild", "hogwild_snapshot", "ddp_gloo")
# The ratios of psd's other set-ups (psd_view, psd_bf16, psd_view_bf16): beside Hogwild (which copies nothing,
# as a view does), Hogwild with a snapshot per step (which copies as pull="copy" does), and psd's default.
VARIANT_OVER = ("hogwild", "hogwild_snapshot", "psd")


def round_trip(cfg: BenchConfig, log=print) -> list[dict]:
    """The round-trip table: one row per (size, learners) with psd's figures (``psd``, and ``psd_view``,
    ``psd_bf16``, ``psd_view_bf16``, ``psd_overlap_on|off`` as ``cfg.variants()`` says) and, if asked, the peers'."""
    variants = cfg.variants()
    rows = []
    for n in cfg.sizes:
        for k in cfg.learners:
            measures = {name: partial(_psd_round_trip, n, k, cfg.duration, pull, cfg.learner_sched, dtype, overlap,
                                      cfg.server_threads)
                        for name, (pull, dtype, overlap) in variants.items()}
            if cfg.peers:
                measures["hogwild"] = partial(_hogwild_round_trip, n, k, cfg.duration, snapshot=False)
                measures["hogwild_snapshot"] = partial(_hogwild_round_trip, n, k, cfg.duration, snapshot=True)
                if k > 1:
                    measures["ddp_gloo"] = partial(_ddp_round_trip, n, k, cfg.duration)
            row = {"params": n, "learners": k,
                   **_interleaved(cfg, measures, "updates_per_s", spread=("step_p50_us", "push_p50_us"))}
            if cfg.peers:
                row.setdefault("ddp_gloo", None)
                for peer in PEERS:
                    if row[peer]:
                        row[f"psd_over_{peer}"] = row["psd"]["updates_per_s"] / row[peer]["updates_per_s"]
            for name in variants:
                for other in VARIANT_OVER if name != "psd" else ():
                    if row.get(other):
                        row[f"{name}_over_{other}"] = row[name]["updates_per_s"] / row[other]["updates_per_s"]
            log(_round_trip_line(row, variants))
            rows.append(row)
    return rows


def _round_trip_line(r: dict, variants) -> str:
    line = f"round trip  {r['params']:>11,} params  {r['learners']} learners"
    for name in variants:
        p = r.get(name)
        if p:
            line += (f"  {name} {p['updates_per_s']:>9,.0f} upd/s {p['model_gbs']:6.2f} GB/s "
                     f"{p['pulls_per_update']:.2f} pulls/upd  push p50 {p['push_p50_us']:7.1f} us  "
                     f"step p50 {p['step_p50_us']:7.1f} us p99 {p['step_p99_us']:8.1f} us")
    for peer in PEERS:
        if r.get(peer):
            line += f"  {peer} {r[peer]['updates_per_s']:,.0f} (x{r[f'psd_over_{peer}']:.2f}"
            for name in variants:
                if f"{name}_over_{peer}" in r and name != "psd":
                    line += f", {name.removeprefix('psd_')} x{r[f'{name}_over_{peer}']:.2f}"
            line += ")"
    return line
