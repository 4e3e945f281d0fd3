"""The update kernel alone: the memory limit, the kernel written four ways, the update loop on full rings,
and what an idle server costs."""

from __future__ import annotations

import os
import statistics
import time

from psd import __version__, _native
from psd.bench._common import STREAM_BYTES, _server_thread


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
