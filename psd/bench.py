"""`psd bench`: what psd does on this machine, next to the peers a user would pick, in one run.

Workloads (each reported as figures and, for peers, as psd/peer ratios):

- *limit*: the update kernel ``w -= lr*g`` over one vector, in the same native
  code as the server, 1 and N threads (three streams per element: read g,
  read w, write w);
- *kernels*: the update written four ways (scalar, the compiler's vectorised
  loop, vectors unrolled 4 and 8 times), in cache and over the limit's vector;
- *update loop*: the server's loop applying pre-filled rings, as GB/s and as a
  fraction of the limit;
- *round trip*: null learners (the gradient is precomputed) doing push + pull
  against a live server, for several learner counts and model sizes:
  updates/s, GB/s of model traffic (gradient in, weights out: GaDei's Table 7
  measure), p50/p99 push and step latency; beside torch.multiprocessing Hogwild (with
  and without a copy of the weights per step, which is what a pull is) and
  DistributedDataParallel's all_reduce over gloo;
- *training*: the shipped MLP workload at several mini-batch sizes and learner
  counts: samples/s and accuracy, beside Hogwild training the same model.

Every process sets one torch thread, so N learners do not oversubscribe the cores.
Each measurement runs ``reps`` times with psd and its peers taking turns, and
the median run is reported, so that a noisy spell on a shared machine does not
decide a ratio.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import dataclass
from functools import partial

from psd import __version__, _native

__all__ = ["BenchConfig", "gpu_round_trip", "host_device_gbs", "idle_cpu", "kernels", "limit", "round_trip", "run",
           "training", "update_loop"]

STREAM_BYTES = 12  # read g, read w, write w
LR = 1e-6


@dataclass
class BenchConfig:
    """What to measure. ``quick`` shrinks everything to a smoke test."""

    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000, 10_000_000)
    learners: tuple[int, ...] = (1, 2, 4, 8)
    batches: tuple[int, ...] = (1, 2, 4, 8)
    duration: float = 1.0
    limit_size: int = 25_000_000
    peers: bool = True
    training: bool = True
    epochs: int | None = None  # training epochs; None: as many as the mini-batch size (same steps per run)
    reps: int = 3  # each measurement is repeated, psd and peers interleaved; the median is reported

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(sizes=(10_000, 100_000), learners=(1, 2), batches=(4,), duration=0.5, limit_size=1_000_000,
                   epochs=1, reps=1)


def _ctx():
    return mp.get_context("spawn")


# -- limit and update loop ---------------------------------------------------

def limit(n: int, threads: int, reps: int = 7) -> float:
    """GB/s of the bare kernel over ``n`` floats, median of ``reps`` calls."""
    import numpy as np

    w = np.zeros(n, dtype=np.float32)
    g = np.full(n, 1e-3, dtype=np.float32)
    _native.apply_sgd(w, g, 0.01, threads)  # fault the pages in
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _native.apply_sgd(w, g, 0.01, threads)
        times.append(time.perf_counter() - t0)
    return n * STREAM_BYTES / statistics.median(times) / 1e9


KERNELS = {"scalar": _native.KERNEL_SCALAR, "vectorised": _native.KERNEL_VECTOR,
           "unrolled x4": _native.KERNEL_UNROLL4, "unrolled x8": _native.KERNEL_UNROLL8}
KERNEL_CACHE_SIZE = 32_768  # floats: g and w (256 KiB) stay in the core's cache


def kernels(n: int, reps: int = 7) -> list[dict]:
    """GB/s of the update written four ways (see native/update.c), one thread, over a vector that stays
    in the cache (where the arithmetic shows) and over ``n`` floats (where memory does)."""
    import numpy as np

    rows = []
    for size in (KERNEL_CACHE_SIZE, n):
        w = np.zeros(size, dtype=np.float32)
        g = np.full(size, 1e-3, dtype=np.float32)
        calls = max(1, (1 << 24) // size)  # about 16M floats per timing, so small sizes are not all overhead
        for name, kernel in KERNELS.items():
            _native.apply_sgd_kernel(w, g, 0.01, kernel)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(calls):
                    _native.apply_sgd_kernel(w, g, 0.01, kernel)
                times.append(time.perf_counter() - t0)
            rows.append({"params": size, "kernel": name, "gbs": calls * size * STREAM_BYTES / statistics.median(times)
                         / 1e9})
    return rows


def update_loop(n: int, threads: int, rounds: int = 4, learners: int = 2, ring: int = 4) -> float:
    """GB/s of the server's update loop, in this process, draining pre-filled rings.

    Each round publishes every entry of every ring while the loop is stopped, then times the
    loop from its start until the rings are empty: the loop alone, with nothing else touching memory.
    """
    import numpy as np

    name = f"/psd.bench-loop-{os.getpid()}"
    a = _native.create(name, 0o600, learners, ring, 1 << 16, __version__)
    try:
        me, start = os.getpid(), _native.proc_start_time(os.getpid())
        a.set_spec(b"[]", 0, (n, n, 0, 1), me, start)
        a.grow()
        a.become_server(me, start, 0.01, threads, 50)
        a.set_state(_native.ARENA_READY)
        slots = [a.claim(me, start) for _ in range(learners)]
        view = np.frombuffer(a, dtype=np.uint8)
        for slot, _ in slots:
            for k in range(ring):
                off = a.grad_offset(slot, k)
                view[off:off + 4 * n].view(np.float32)[:] = 1e-3
        weights = view[a.header()["weights_off"]:][:4 * n].view(np.float32)
        weights[:] = 0.0  # fault the weights in: the loop should not pay for first touches
        del view, weights
        elapsed = 0.0
        for _ in range(rounds):
            for slot, _claim in slots:
                for _ in range(ring):
                    a.push(slot, 0, 1, 0.0)
            t0 = time.perf_counter()
            a.start_loop()
            for slot, claim in slots:
                a.wait_drained(slot, claim, 60.0)
            elapsed += time.perf_counter() - t0
            a.stop_loop()
        return a.counters()["applied"] * n * STREAM_BYTES / elapsed / 1e9
    finally:
        _native.unlink(name)
        a.close()


# -- round trip: psd and its peers --------------------------------------------

def _percentiles(ns: list[int]) -> tuple[float, float]:
    if not ns:
        return 0.0, 0.0
    s = sorted(ns)
    return s[len(s) // 2] / 1000, s[min(len(s) - 1, int(len(s) * 0.99))] / 1000


def _psd_null_learner(job: str, n: int, device: str, duration: float, barrier, q) -> None:
    """A learner whose gradient is precomputed (on ``device``: a GPU model is a DeviceLearner)."""
    import torch

    from psd import learner

    torch.set_num_threads(1)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(n, device=device))
    g = torch.full((n,), 1e-6, device=device)
    with learner.attach(m, job=job, timeout=120) as ps:
        for _ in range(ps._k + 1):  # touch every ring entry once: page faults are set-up, not traffic
            m.w.grad = g
            ps.step()
        ps.flush()
        barrier.wait()
        lat, push, k = [], [], 0
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            m.w.grad = g  # the precomputed gradient, where a backward pass would leave it
            t0 = time.perf_counter_ns()
            ps.step()
            lat.append(time.perf_counter_ns() - t0)
            push.append(ps.push_ns)
            k += 1
        ps.flush()
        q.put({"updates": k, "lat": lat, "push": push})


def _hogwild_null(w, n: int, duration: float, snapshot: bool, barrier, q) -> None:
    import torch

    torch.set_num_threads(1)
    g = torch.full((n,), 1e-6)
    local = torch.empty(n)
    w.sub_(g, alpha=LR)  # touch every page once, as psd's learners do before the clock starts
    local.copy_(w)
    barrier.wait()
    k = 0
    end = time.perf_counter() + duration
    while time.perf_counter() < end:
        w.sub_(g, alpha=LR)  # lock-free, in place on the shared weights
        if snapshot:
            local.copy_(w)
        k += 1
    q.put({"updates": k})


def _ddp_null(rank: int, world: int, port: int, n: int, steps: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.full((n,), 1e-6)
    w = torch.zeros(n)
    buf = torch.empty(n)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        buf.copy_(g)
        dist.all_reduce(buf)  # what DDP does with every step's gradient
        w.sub_(buf, alpha=LR / world)
    elapsed = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    q.put({"updates": steps * world, "elapsed": elapsed})


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
            server = Server(ServeConfig(job=job, learners=k, lr=LR, ring_depth=4, threads=1))
            server.start()
            stop = _server_thread(server)
            try:
                results, elapsed = _timed([(_psd_null_learner, (job, n, f"cuda:{r % gpus}", cfg.duration))
                                           for r in range(k)])
            finally:
                stop()
            rate = sum(r["updates"] for r in results) / elapsed
            gbs = rate * n * 4 * 2 / 1e9
            row = {"params": n, "learners": k, "gpus": min(k, gpus), "updates_per_s": rate, "model_gbs": gbs,
                   "fraction_of_pcie": gbs / ((bw["h2d"] + bw["d2h"]) / 2)}
            rows.append(row)
            log(f"gpu round trip {n:>11,} params  {k} learner(s) on {row['gpus']} GPU(s)  {rate:10,.0f} upd/s  "
                f"{gbs:6.2f} GB/s = {row['fraction_of_pcie']:.2f} of host<->device")
    return {"host_device_gbs": bw, "gpus": gpus, "rows": rows}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(targets: list[tuple]) -> tuple[list[dict], float]:
    """One process per (function, args), each called with (*args, barrier, queue); the clock runs from
    the barrier (all set up) to the last result."""
    ctx = _ctx()
    barrier = ctx.Barrier(len(targets) + 1)
    q = ctx.Queue()
    procs = [ctx.Process(target=t, args=(*args, barrier, q)) for t, args in targets]
    for p in procs:
        p.start()
    barrier.wait(timeout=300)
    t0 = time.perf_counter()
    results = [q.get(timeout=600) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(60)
    return results, elapsed


def _run_procs(targets: list[tuple], timeout: float = 600) -> list[dict]:
    ctx = _ctx()
    q = ctx.Queue()
    procs = [ctx.Process(target=t, args=(*args, q)) for t, args in targets]
    for p in procs:
        p.start()
    results = [q.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout)
    return results


def _psd_round_trip(n: int, learners: int, duration: float) -> dict:
    from psd.server import ServeConfig, Server

    job = f"bench-{os.getpid()}-{n}-{learners}"
    server = Server(ServeConfig(job=job, learners=learners, lr=LR, ring_depth=4, threads=1))
    server.start()
    stop = _server_thread(server)
    try:
        results, elapsed = _timed([(_psd_null_learner, (job, n, "cpu", duration))] * learners)
    finally:
        stop()
    updates = sum(r["updates"] for r in results)
    p50, p99 = _percentiles([x for r in results for x in r["lat"]])
    push50, push99 = _percentiles([x for r in results for x in r["push"]])
    rate = updates / elapsed
    return {"updates_per_s": rate, "model_gbs": rate * n * 4 * 2 / 1e9, "step_p50_us": p50, "step_p99_us": p99,
            "push_p50_us": push50, "push_p99_us": push99}


def _server_thread(server):
    import threading

    ev = threading.Event()
    t = threading.Thread(target=server.run, args=(ev,), daemon=True)
    t.start()

    def stop():
        ev.set()
        t.join()
        server.stop()

    return stop


def _hogwild_round_trip(n: int, learners: int, duration: float, snapshot: bool) -> dict:
    import torch

    w = torch.zeros(n).share_memory_()
    results, elapsed = _timed([(_hogwild_null, (w, n, duration, snapshot))] * learners)
    rate = sum(r["updates"] for r in results) / elapsed
    return {"updates_per_s": rate, "model_gbs": rate * n * 4 * (2 if snapshot else 1) / 1e9}


def _ddp_round_trip(n: int, learners: int, duration: float) -> dict:
    # A short calibration run sizes the measured one to about `duration` seconds.
    port = _free_port()
    cal = _run_procs([(_ddp_null, (r, learners, port, n, 5)) for r in range(learners)])
    per_step = max(r["elapsed"] for r in cal) / 5
    steps = max(5, int(duration / max(per_step, 1e-6)))
    port = _free_port()
    res = _run_procs([(_ddp_null, (r, learners, port, n, steps)) for r in range(learners)])
    rate = steps * learners / max(r["elapsed"] for r in res)
    return {"updates_per_s": rate, "model_gbs": rate * n * 4 / 1e9}


def _median_of(runs: list[dict], key: str) -> dict:
    """The run with the median ``key`` (its other figures stay consistent with it)."""
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def _interleaved(cfg: BenchConfig, measures: dict, key: str) -> dict:
    """Run every measure ``cfg.reps`` times, taking turns, so that a noisy spell on the machine hits
    psd and its peers alike; the median run of each."""
    runs: dict = {name: [] for name in measures}
    for _ in range(max(1, cfg.reps)):
        for name, measure in measures.items():
            runs[name].append(measure())
    return {name: _median_of(r, key) for name, r in runs.items()}


def round_trip(cfg: BenchConfig, log=print) -> list[dict]:
    """The round-trip table: one row per (size, learners) with psd's figures and, if asked, the peers'."""
    rows = []
    for n in cfg.sizes:
        for k in cfg.learners:
            measures = {"psd": partial(_psd_round_trip, n, k, cfg.duration)}
            if cfg.peers:
                measures["hogwild"] = partial(_hogwild_round_trip, n, k, cfg.duration, snapshot=False)
                measures["hogwild_snapshot"] = partial(_hogwild_round_trip, n, k, cfg.duration, snapshot=True)
                if k > 1:
                    measures["ddp_gloo"] = partial(_ddp_round_trip, n, k, cfg.duration)
            row = {"params": n, "learners": k, **_interleaved(cfg, measures, "updates_per_s")}
            if cfg.peers:
                row.setdefault("ddp_gloo", None)
                for peer in ("hogwild", "hogwild_snapshot", "ddp_gloo"):
                    if row[peer]:
                        row[f"psd_over_{peer}"] = row["psd"]["updates_per_s"] / row[peer]["updates_per_s"]
            log(_round_trip_line(row))
            rows.append(row)
    return rows


def _round_trip_line(r: dict) -> str:
    p = r["psd"]
    line = (f"round trip  {r['params']:>11,} params  {r['learners']} learners  psd {p['updates_per_s']:>9,.0f} upd/s "
            f"{p['model_gbs']:6.2f} GB/s  push p50 {p['push_p50_us']:7.1f} us  step p50 {p['step_p50_us']:7.1f} us "
            f"p99 {p['step_p99_us']:8.1f} us")
    for peer in ("hogwild", "hogwild_snapshot", "ddp_gloo"):
        if r.get(peer):
            line += f"  {peer} {r[peer]['updates_per_s']:,.0f} (x{r[f'psd_over_{peer}']:.2f})"
    return line


# -- training -------------------------------------------------------------------

def _psd_train_learner(job: str, rank: int, world: int, batch: int, epochs: int, barrier, q) -> None:
    import torch

    from psd import learner
    from psd.workloads import make_classification, make_mlp, shard

    torch.set_num_threads(1)
    data = make_classification(0)
    x, y = shard(data, rank, world)
    model = make_mlp(data.dim, data.classes)
    g = torch.Generator().manual_seed(rank)
    with learner.attach(model, job=job, timeout=120) as ps:
        barrier.wait()
        for _ in range(epochs):
            order = torch.randperm(len(x), generator=g)
            for i in range(0, len(x), batch):
                idx = order[i:i + batch]
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                ps.step()
        ps.flush()
    q.put({"samples": len(x) * epochs})


def _hogwild_train(model, rank: int, world: int, batch: int, epochs: int, lr: float, barrier, q) -> None:
    import torch

    from psd.workloads import make_classification, shard

    torch.set_num_threads(1)
    data = make_classification(0)
    x, y = shard(data, rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(rank)
    barrier.wait()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            idx = order[i:i + batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    q.put({"samples": len(x) * epochs})


TRAIN_LR = {1: 0.01, 2: 0.02, 4: 0.03, 8: 0.05}


def _samples_per_s(targets: list[tuple]) -> float:
    results, elapsed = _timed(targets)
    return sum(r["samples"] for r in results) / elapsed


def training(cfg: BenchConfig, log=print) -> list[dict]:
    """Samples/s and accuracy of the shipped workload, psd beside Hogwild."""
    from psd.learner import pull_state_dict
    from psd.server import ServeConfig, Server
    from psd.workloads import evaluate, make_classification, make_mlp

    data = make_classification(0)

    def psd_run(b: int, k: int, lr: float, epochs: int) -> dict:
        job = f"bench-train-{os.getpid()}-{b}-{k}"
        server = Server(ServeConfig(job=job, learners=k, lr=lr, threads=1))
        server.start()
        stop = _server_thread(server)
        try:
            rate = _samples_per_s([(_psd_train_learner, (job, r, k, b, epochs)) for r in range(k)])
            model = make_mlp(data.dim, data.classes)
            model.load_state_dict(pull_state_dict(job))
        finally:
            stop()
        return {"samples_per_s": rate, "accuracy": evaluate(model, data)}

    def hogwild_run(b: int, k: int, lr: float, epochs: int) -> dict:
        shared = make_mlp(data.dim, data.classes)
        shared.share_memory()
        rate = _samples_per_s([(_hogwild_train, (shared, r, k, b, epochs, lr)) for r in range(k)])
        return {"samples_per_s": rate, "accuracy": evaluate(shared, data)}

    rows = []
    for b in cfg.batches:
        lr = TRAIN_LR.get(b, 0.03)
        epochs = cfg.epochs or b
        for k in cfg.learners:
            measures = {"psd": partial(psd_run, b, k, lr, epochs)}
            if cfg.peers:
                measures["hogwild"] = partial(hogwild_run, b, k, lr, epochs)
            row = {"batch": b, "learners": k, "epochs": epochs, **_interleaved(cfg, measures, "samples_per_s")}
            rate = row["psd"]["samples_per_s"]
            if cfg.peers:
                row["psd_over_hogwild"] = rate / row["hogwild"]["samples_per_s"]
            log(f"training    mini-batch {b}  {k} learners  psd {rate:>8,.0f} samples/s "
                f"acc {row['psd']['accuracy']:.4f}"
                + (f"  hogwild {row['hogwild']['samples_per_s']:,.0f} acc {row['hogwild']['accuracy']:.4f} "
                   f"(x{row['psd_over_hogwild']:.2f})" if cfg.peers else ""))
            rows.append(row)
    return rows


def idle_cpu(seconds: float = 1.0) -> float:
    """Fraction of a core an idle server (ready, update loop running, no learners) uses."""
    from psd.arena import ParamSpec, encode_spec
    from psd.server import ServeConfig, Server

    job = f"bench-idle-{os.getpid()}"
    server = Server(ServeConfig(job=job, learners=1, threads=1))
    server.start()
    me = os.getpid()
    spec, digest = encode_spec([ParamSpec("w", (1024,))])
    server.arena.set_spec(spec, digest, (1024, 1024, 0, 1), me, _native.proc_start_time(me))
    server.poll()  # grows the arena for the spec
    server.arena.set_state(_native.ARENA_READY)
    server.poll()  # starts the update loop
    stop = _server_thread(server)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        time.sleep(seconds)  # a measurement window
        return (time.process_time() - c0) / (time.perf_counter() - t0)
    finally:
        stop()


# -- the whole run ----------------------------------------------------------------

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
