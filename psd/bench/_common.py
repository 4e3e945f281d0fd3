"""What every measurement shares: the configuration, spawned processes timed together (a failing one stops
the run at once), medians and the spread of the runs behind them."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
from dataclasses import dataclass

from psd.choices import OVERLAP, PULL_MODES

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
    # The DRAM limit's vectors hold at least this many last-level caches each (and at least limit_size
    # floats), so that neither stays in the cache between calls. 0: limit_size alone decides.
    llc_multiple: float = 4.0
    # Sizes, beside the DRAM and in-cache ones, to measure the update loop (and the limit it is a
    # fraction of) at; each is labelled "cache" or "dram" by whether its working set fits half the LLC.
    # The loop holds learners x ring entries plus the weights: 1e8 floats is 3.6 GB of arena.
    loop_sizes: tuple[int, ...] = ()
    # How the round trip's and training's learners get the weights: "copy" (pulled after each step: the
    # "psd" figures, always measured) and "view" (parameters are views of the shared weights: "psd_view").
    pull_modes: tuple[str, ...] = ("copy", "view")
    # The scheduling policy psd's learners run under, as `psd run --learner-sched` gives it (auto: SCHED_BATCH
    # when the learners fill the cores: they do not preempt the update loop when they wake). The peers'
    # processes keep the normal policy: that is how they run.
    learner_sched: str = "auto"
    # What psd's learners push (--grad-dtype): "float32" (always measured) and "bf16" (half the bytes of a
    # gradient: the "psd_bf16" figures, and "psd_view_bf16" with the view pull).
    grad_dtypes: tuple[str, ...] = ("float32", "bf16")
    # More --overlap modes to measure psd's learners in, beside the default (auto: bench's job runs sgd, so
    # "off" there at any learner count): "on" (pulling right after a push: GaDei's hand-off) and "off" (once
    # the server applied it): "psd_overlap_on", "psd_overlap_off", copy pulls and float32 gradients.
    overlap_modes: tuple[str, ...] = ()
    # Sizes to measure the server's optimizer kernels at, against torch's fused CPU optimizers (and DeepSpeed's
    # CPU Adam where installed) at one thread and at every usable core (with the peers only).
    optimizer_sizes: tuple[int, ...] = (10_000_000,)
    # Update-loop threads of the round trips' and training's jobs; 0: what `psd serve` picks (auto_threads).
    server_threads: int = 0
    # The memory limits, the update loop and the kernels beside them (run first; minutes where the last-level
    # cache is large, since the DRAM vectors hold four of them).
    limits: bool = True

    @classmethod
    def quick(cls) -> BenchConfig:
        """Small sizes and short runs; its DRAM limit is not one (1M floats may well stay in the cache)."""
        return cls(sizes=(10_000, 100_000), learners=(1, 2), batches=(4,), duration=0.5, limit_size=1_000_000,
                   epochs=1, reps=1, llc_multiple=0.0, optimizer_sizes=(100_000,))

    def __post_init__(self) -> None:
        from psd.choices import GRAD_DTYPES

        if self.server_threads < 0:
            raise ValueError(f"server_threads: {self.server_threads} (use 0 for psd serve's default, or a count)")
        unknown = set(self.pull_modes) - set(PULL_MODES)
        if unknown:
            raise ValueError(f"pull_modes: {sorted(unknown)} are not pull modes (use {', '.join(PULL_MODES)})")
        unknown = set(self.overlap_modes) - set(OVERLAP[1:])
        if unknown:
            raise ValueError(f"overlap_modes: {sorted(unknown)} are not --overlap modes to add (use "
                             f"{', '.join(OVERLAP[1:])})")
        unknown = set(self.grad_dtypes) - set(GRAD_DTYPES)
        if unknown:
            raise ValueError(f"grad_dtypes: {sorted(unknown)} are not --grad-dtype values "
                             f"(use {', '.join(GRAD_DTYPES)})")

    def view_pulls(self) -> bool:
        """Whether to measure pull="view" beside the default copy."""
        return "view" in self.pull_modes

    def variants(self) -> dict[str, tuple[str, str, str]]:
        """psd's measured set-ups, name -> (pull mode, --grad-dtype, --overlap): "psd" (copy, float32, auto)
        always, then "psd_view", "psd_bf16" and "psd_view_bf16" as pull_modes and grad_dtypes ask, and
        "psd_overlap_on" / "psd_overlap_off" as overlap_modes do."""
        out = {}
        for dtype in ("float32", *(["bf16"] if "bf16" in self.grad_dtypes else [])):
            for pull in ("copy", *(["view"] if self.view_pulls() else [])):
                name = "psd" + ("_view" if pull == "view" else "") + ("_bf16" if dtype == "bf16" else "")
                out[name] = (pull, dtype, "auto")
        for mode in self.overlap_modes:
            out[f"psd_overlap_{mode}"] = ("copy", "float32", mode)
        return out


def set_learner_sched(name: str, learners: int) -> None:
    """In a learner process: the scheduling policy `psd run --learner-sched name` would give it."""
    from psd.watchdog.launcher import learner_sched_policy

    os.sched_setscheduler(0, learner_sched_policy(name, learners), os.sched_param(0))


# What the measured processes import before their clock starts, imported once by the fork server they
# are forked from (torch alone is 1.5-3 s of CPU a process on a small machine; a default run starts
# hundreds of processes, the suite's --quick run 16). A failed import here is only not preloaded.
PRELOAD = ("torch", "psd.learner", "psd.bench.round_trip", "psd.bench.training", "psd.bench.peers")


def _ctx():
    """Processes start from multiprocessing's fork server with ``PRELOAD`` imported (as `psd run --fork-server`
    starts learners): each is still a fresh child that unpickles its target and arguments (as "spawn" does),
    without importing torch again. Every clock starts after the children's set-up (``_timed``'s barrier; a
    DDP child's own, after init_process_group), so how a process was started is no part of any figure."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


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
    the barrier (all set up) to the last result.

    A child that fails reports ``{"error": ...}`` (see ``reporting``) or dies: either way the run stops
    at once with the child's error, instead of waiting out the barrier's timeout.
    """
    import threading

    ctx = _ctx()
    barrier = ctx.Barrier(len(targets) + 1)
    q = ctx.Queue()
    procs = [ctx.Process(target=t, args=(*args, barrier, q)) for t, args in targets]
    for p in procs:
        p.start()
    passed = threading.Event()

    def watch() -> None:  # a child killed before the barrier (a SIGSEGV, say) would never reach it
        while not passed.wait(0.1):
            if any(p.exitcode not in (None, 0) for p in procs):
                barrier.abort()
                return

    threading.Thread(target=watch, daemon=True).start()
    try:
        barrier.wait(timeout=300)
    except threading.BrokenBarrierError:
        passed.set()
        _fail(procs, q, "before the clock started")
    passed.set()
    t0 = time.perf_counter()
    results = []
    deadline = t0 + 600
    while len(results) < len(procs):
        try:
            results.append(q.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.perf_counter() > deadline:
                _fail(procs, q, f"exit codes {dead}" if dead else "timed out")
            continue
        if "error" in results[-1]:
            _fail(procs, q, results[-1]["error"])
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(60)
    return results, elapsed


def _fail(procs: list, q, why: str) -> None:
    errors = [why]
    try:
        while True:
            r = q.get(timeout=0.5)
            if "error" in r:
                errors.append(r["error"])
    except queue.Empty:
        pass
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join(10)
    raise RuntimeError("a benchmark process failed: " + "; ".join(errors))


def reporting(fn):
    """Wrap a child's body (called with (..., barrier, q)) so that an exception reaches the parent as
    ``{"error": ...}`` and breaks the barrier, rather than leaving the parent waiting for it."""
    import functools
    import traceback

    @functools.wraps(fn)
    def child(*args):
        barrier, q = args[-2], args[-1]
        try:
            fn(*args)
        except BaseException as e:
            q.put({"error": f"{fn.__name__}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"})
            barrier.abort()
            raise

    return child


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

    from psd.signals import SignalFlag

    ev = SignalFlag()  # Server.run's stop: its wait also watches the learners' pidfds
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


def _interleaved(cfg: BenchConfig, measures: dict, key: str, spread: tuple[str, ...] = ()) -> dict:
    """Run every measure ``cfg.reps`` times, taking turns, so that a noisy spell on the machine hits
    psd and its peers alike; the median run of each, with the least and the most ``key`` of its runs
    (``<key>_min``, ``<key>_max``) and ``reps``, from which a ratio's spread can be bounded. Each figure
    named in ``spread`` that every run of a measure has gets its ``_min`` and ``_max`` over the runs too."""
    runs: dict = {name: [] for name in measures}
    for _ in range(max(1, cfg.reps)):
        for name, measure in measures.items():
            runs[name].append(measure())
    out = {}
    for name, r in runs.items():
        values = [x[key] for x in r]
        out[name] = {**_median_of(r, key), f"{key}_min": min(values), f"{key}_max": max(values), "reps": len(r)}
        for k in spread:
            if all(isinstance(x.get(k), int | float) for x in r):
                out[name].update({f"{k}_min": min(x[k] for x in r), f"{k}_max": max(x[k] for x in r)})
    return out
