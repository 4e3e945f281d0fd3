"""What every measurement shares: the configuration, spawned processes timed together, medians."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from dataclasses import dataclass

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


def _percentiles(ns: list[int]) -> tuple[float, float]:
    if not ns:
        return 0.0, 0.0
    s = sorted(ns)
    return s[len(s) // 2] / 1000, s[min(len(s) - 1, int(len(s) * 0.99))] / 1000


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
