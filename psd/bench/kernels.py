"""The update kernel alone: its limits (from DRAM and from the cache), the kernel written four ways, the
update loop on full rings as a fraction of those limits, and what an idle server costs.

A "memory limit" measured on vectors that fit the last-level cache is a cache limit: with a 300 MiB L3,
100 MB vectors never leave it. So the limits are measured twice, at sizes taken from the machine's own
last-level cache (read from sysfs): once on vectors several LLCs long (DRAM) and once on a working set
within half the LLC (cache), and the update loop is reported as a fraction of the limit at its own size.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from psd import __version__, _native
from psd.bench._common import STREAM_BYTES, BenchConfig, _server_thread

CACHE_SYSFS = "/sys/devices/system/cpu/cpu0/cache"
DEFAULT_LLC_BYTES = 32 << 20  # what this VM has; used, and said to be used, where sysfs does not tell
# A vector this many LLCs long is streamed from DRAM whatever the cache's replacement policy: below
# about twice the LLC, adaptive policies keep part of it resident between passes.
DRAM_HONEST_LLCS = 4
# update_loop()'s rings: every entry is a different gradient vector, so its working set is
# (learners * ring + 1) vectors, the weights included.
LOOP_LEARNERS, LOOP_RING = 2, 4
# Traffic per update-loop timing: starting the loop costs tens of microseconds, which an in-cache round
# of a few hundred microseconds would otherwise carry.
LOOP_BYTES = 1 << 30


@dataclass(frozen=True)
class Cache:
    """The last-level cache: its size in bytes, where that came from, and whether it is a default."""

    bytes: int
    source: str
    fallback: bool


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_cache_size(text: str) -> int:
    """A sysfs cache size ("32768K", "1M", "512") in bytes."""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)I?B?", text.strip().upper())
    if not m:
        raise ValueError(f"not a cache size: {text.strip()!r}")
    return int(m[1]) * _UNITS[m[2]]


def last_level_cache(root: str | os.PathLike = CACHE_SYSFS) -> Cache:
    """The highest-level data or unified cache of CPU 0, from sysfs; ``DEFAULT_LLC_BYTES`` (with
    ``fallback`` set and the reason in ``source``) where sysfs has none or cannot be read."""
    best: tuple[int, int, str, Path] | None = None
    problems = []
    try:
        entries = sorted(Path(root).glob("index*"))
    except OSError as e:
        entries, problems = [], [str(e)]
    for d in entries:
        try:
            level = int((d / "level").read_text())
            kind = (d / "type").read_text().strip()
            size = parse_cache_size((d / "size").read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{d.name}: {e}")
            continue
        if kind in ("Unified", "Data") and (best is None or (level, size) > best[:2]):
            best = (level, size, kind, d)
    if best is None:
        why = "; ".join(problems) or f"no data or unified cache under {root}"
        return Cache(DEFAULT_LLC_BYTES, f"default {DEFAULT_LLC_BYTES >> 20} MiB ({why})", True)
    level, size, kind, d = best
    return Cache(size, f"sysfs: L{level} {kind} {size / (1 << 20):g} MiB ({d})", False)


def cache_params(llc: int) -> int:
    """Floats per vector for the in-cache figures: the update loop's whole working set (every ring entry
    and the weights) within half the LLC, so w and g of the bare kernel fit as well."""
    return max(1024, llc // 2 // ((LOOP_LEARNERS * LOOP_RING + 1) * 4) // 16 * 16)


def dram_params(cfg: BenchConfig, llc: int) -> int:
    """Floats per vector for the DRAM figures: ``cfg.llc_multiple`` LLCs, and at least ``cfg.limit_size``."""
    return max(cfg.limit_size, math.ceil(cfg.llc_multiple * llc / 4))


def where(n: int, llc: int) -> str:
    """"cache" where the update loop's working set over ``n`` floats fits half the LLC, else "dram"."""
    return "cache" if loop_working_set(n) <= llc // 2 else "dram"


def loop_working_set(n: int) -> int:
    """Bytes update_loop() touches over ``n`` floats: every ring entry and the weights."""
    return (LOOP_LEARNERS * LOOP_RING + 1) * 4 * n


def honest(place: str, n: int, llc: int) -> bool:
    """Whether figures over ``n`` floats are what ``place`` says: a working set within half the LLC for
    "cache", vectors of at least ``DRAM_HONEST_LLCS`` LLCs each for "dram"."""
    return loop_working_set(n) <= llc // 2 if place == "cache" else 4 * n >= DRAM_HONEST_LLCS * llc


def limit(n: int, threads: int, reps: int = 7) -> float:
    """GB/s of the bare kernel over ``n`` floats, median of ``reps`` timings (each of enough calls to
    cover about 16M floats, so that an in-cache vector's time is not all call overhead)."""
    import numpy as np

    w = np.zeros(n, dtype=np.float32)
    g = np.full(n, 1e-3, dtype=np.float32)
    _native.apply_sgd(w, g, 0.01, threads)  # fault the pages in
    calls = max(1, (1 << 24) // n)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            _native.apply_sgd(w, g, 0.01, threads)
        times.append(time.perf_counter() - t0)
    return calls * n * STREAM_BYTES / statistics.median(times) / 1e9


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


def update_loop(n: int, threads: int, rounds: int | None = None, learners: int = LOOP_LEARNERS,
                ring: int = LOOP_RING) -> float:
    """GB/s of the server's update loop, in this process, draining pre-filled rings.

    Each round publishes every entry of every ring while the loop is stopped, then times the
    loop from its start until the rings are empty: the loop alone, with nothing else touching memory.
    ``rounds`` (default: enough for about ``LOOP_BYTES`` of traffic, and at least 4).
    """
    import numpy as np

    if rounds is None:
        rounds = max(4, math.ceil(LOOP_BYTES / (learners * ring * n * STREAM_BYTES)))

    name = f"/psd.bench-loop-{os.getpid()}"
    a = _native.create(name, 0o600, learners, ring, 1 << 16, __version__)
    try:
        me, start = os.getpid(), _native.proc_start_time(os.getpid())
        a.set_spec(b"[]", 0, (n, n, 0, 1), me, start)
        a.grow()
        a.become_server(me, start, 0.01, threads, 50)
        a.set_state(_native.ARENA_READY)
        slots = [a.assign(me, start) for _ in range(learners)]
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


def _room() -> int:
    """Bytes an arena may take: the smaller of the memory available and /dev/shm's free space."""
    room = []
    try:
        st = os.statvfs("/dev/shm")
        room.append(st.f_bavail * st.f_frsize)
    except OSError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return min(room) if room else 1 << 62


def limits(cfg: BenchConfig, log=print) -> dict:
    """The bare kernel's limit and the update loop, 1 and N threads, over DRAM-sized and cache-sized
    vectors (and ``cfg.loop_sizes``): the top-level ``llc_*``, ``limit`` and ``update_loop`` of a run.

    Each size's limit is measured at the loop's own size, so that the fraction compares like with like;
    limit and loop take turns ``cfg.reps`` times and the medians are reported, with their spread.
    """
    cache = last_level_cache()
    llc = cache.bytes
    threads = sorted({1, max(1, _native.omp_info()["max_threads"])})
    sizes = {dram_params(cfg, llc): "dram", cache_params(llc): "cache"}
    for n in cfg.loop_sizes:
        sizes.setdefault(n, where(n, llc))
    log(f"last-level cache {llc / (1 << 20):g} MiB ({cache.source})")
    out: dict = {"llc_bytes": llc, "llc_source": cache.source, "llc_fallback": cache.fallback, "limit": [],
                 "update_loop": []}
    for n, place in sizes.items():
        fair = honest(place, n, llc)
        if not fair:  # --quick's DRAM vectors, or a loop size between the two places
            need = (f"{DRAM_HONEST_LLCS} or more, as the default run's" if place == "dram"
                    else "a working set within half of one")
            log(f"limit {place:<5} {n:>11,} params: NOT a {place} figure: each vector is {4 * n / llc:.2f} LLCs "
                f"(a {place} figure needs {need})")
        arena, room = loop_working_set(n) + (1 << 20), _room()
        skipped = (f"the update loop's arena ({arena / 1e9:.1f} GB) does not fit the memory and /dev/shm "
                   f"left ({room / 1e9:.1f} GB)") if arena > room * 0.8 else None
        for t in threads:
            lims, loops = [], []
            for _ in range(max(1, cfg.reps)):  # taking turns, as the round trips do
                lims.append(limit(n, t))
                if not skipped:
                    loops.append(update_loop(n, t))
            lim = statistics.median(lims)
            common = {"where": place, "params": n, "threads": t, "honest": fair}
            out["limit"].append({**common, "gbs": lim, "gbs_min": min(lims), "gbs_max": max(lims),
                                 "reps": len(lims), "vector_llcs": 4 * n / llc})
            row = {**common, "working_set_llcs": loop_working_set(n) / llc}
            if skipped:
                out["update_loop"].append({**row, "gbs": None, "fraction_of_limit": None, "skipped": skipped})
                log(f"limit {place:<5} {n:>11,} params  {t} thread(s)  {lim:6.2f} GB/s;  update loop skipped: "
                    f"{skipped}")
                continue
            loop = statistics.median(loops)
            # The spread of the fraction: each rep's loop over the limit measured just before it.
            fractions = [lp / li for lp, li in zip(loops, lims, strict=True)] + [loop / lim]
            out["update_loop"].append({**row, "gbs": loop, "gbs_min": min(loops), "gbs_max": max(loops),
                                       "fraction_of_limit": loop / lim, "fraction_of_limit_min": min(fractions),
                                       "fraction_of_limit_max": max(fractions), "reps": len(loops)})
            log(f"limit {place:<5} {n:>11,} params  {t} thread(s)  {lim:6.2f} GB/s;  update loop {loop:6.2f} GB/s "
                f"= {loop / lim:.2f} of the limit")
    return out


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
