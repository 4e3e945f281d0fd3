"""How close the update loop comes to the machine's memory-bandwidth limit.

    python benchmarks/update_loop.py [--params 25000000] [--threads 1 2] [--rounds 10] [--json]

*limit*: the update kernel itself (``w -= lr*g`` in C, psd._native.apply_sgd)
over a vector of --params floats (100 MB by default), called back to back.
*update loop*: the real server loop, in this process, draining learner rings
that are refilled as fast as the loop frees them (the entries were written
once, so this measures the loop, not the learners). Both count three streams
per element (read g, read w, write w), 12 bytes, as GaDei's Table 7 does.
Reported as GB/s and as the loop's fraction of the limit, from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from psd import __version__, _native

STREAM_BYTES = 12  # read g, read w, write w


def limit(n: int, threads: int, reps: int) -> float:
    """GB/s of the bare kernel, median of ``reps`` calls."""
    w = torch.zeros(n, dtype=torch.float32)
    g = torch.full((n,), 1e-3, dtype=torch.float32)
    _native.apply_sgd(w.numpy(), g.numpy(), 0.01, threads)  # fault the pages in
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _native.apply_sgd(w.numpy(), g.numpy(), 0.01, threads)
        times.append(time.perf_counter() - t0)
    return n * STREAM_BYTES / statistics.median(times) / 1e9


def update_loop(n: int, threads: int, rounds: int, learners: int = 2, ring: int = 4) -> float:
    """GB/s of the server's loop applying ``rounds`` x ``learners`` x ``ring`` gradients."""
    name = f"/psd.bench-{os.getpid()}"
    a = _native.create(name, 0o600, learners, ring, 1 << 16, __version__)
    try:
        me, start = os.getpid(), _native.proc_start_time(os.getpid())
        a.set_spec(b"[]", 0, n, me, start)
        a.grow()
        a.become_server(me, start, 0.01, threads, 50)
        a.set_state(_native.ARENA_READY)
        slots = [a.claim(me, start) for _ in range(learners)]
        for slot, _ in slots:
            for k in range(ring):
                g = torch.frombuffer(a, dtype=torch.float32, count=n, offset=a.grad_offset(slot, k))
                g.fill_(1e-3)
                del g
        a.start_loop()
        t0 = time.perf_counter()
        for _ in range(rounds):
            for slot, claim in slots:
                for _ in range(ring):
                    a.wait_space(slot, claim, 60.0)
                    a.push(slot, 0, 1, 0.0)
        for slot, claim in slots:
            a.wait_drained(slot, claim, 60.0)
        elapsed = time.perf_counter() - t0
        a.stop_loop()
        applied = a.counters()["applied"]
        assert applied == rounds * learners * ring, applied
        return applied * n * STREAM_BYTES / elapsed / 1e9
    finally:
        _native.unlink(name)
        a.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=25_000_000, help="vector length (default: 100 MB)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for t in args.threads:
        lim = limit(args.params, t, reps=max(5, args.rounds))
        loop = update_loop(args.params, t, args.rounds)
        rows.append({"params": args.params, "threads": t, "limit_gbs": round(lim, 2),
                     "loop_gbs": round(loop, 2), "loop_over_limit": round(loop / lim, 3)})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'params':>12} {'threads':>7} {'limit GB/s':>10} {'loop GB/s':>10} {'loop/limit':>10}")
        for r in rows:
            print(f"{r['params']:>12,} {r['threads']:>7} {r['limit_gbs']:>10.2f} {r['loop_gbs']:>10.2f} "
                  f"{r['loop_over_limit']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
