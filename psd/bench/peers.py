"""The peers psd is measured beside: torch.multiprocessing Hogwild (with and without a copy of the
weights per step) and DistributedDataParallel's all_reduce over gloo."""

from __future__ import annotations

import time

from psd.bench._common import LR, _free_port, _run_procs, _timed


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
