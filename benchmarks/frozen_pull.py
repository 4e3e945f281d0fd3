"""Fine-tuning shape: a frozen backbone and a small trainable head, one null learner against a live server.

Pulls copy the trainable weights alone (the frozen ones never move while the job runs), so a step's pull
costs the head, not the model. This times a learner's step (push of the head's gradient, pull) with the
trainable and frozen sizes given, median of several runs:

    python benchmarks/frozen_pull.py [--trainable 100000] [--frozen 10000000] [--seconds 2] [--reps 3]

frozen_pull.json and frozen_pull.md (with the machine, and the least and most of the runs) go into --out
(default benchmarks/results), replacing the old ones only once both are written.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from psd import learner
from psd.bench.record import RESULTS, command_line, machine, machine_line, write_results
from psd.server import ServeConfig, Server
from psd.signals import SignalFlag


def measure(trainable: int, frozen: int, seconds: float) -> dict:
    """One null learner stepping for ``seconds`` against a server in this process."""
    job = f"bench-frozen-{os.getpid()}"
    server = Server(ServeConfig(job=job, learners=1, lr=1e-9, threads=1))
    server.start()
    stop = SignalFlag()  # Server.run's stop: its wait also watches the learners' pidfds
    t = threading.Thread(target=server.run, args=(stop,), daemon=True)
    t.start()
    try:
        m = torch.nn.Module()
        m.head = torch.nn.Parameter(torch.zeros(trainable))
        m.backbone = torch.nn.Parameter(torch.zeros(frozen), requires_grad=False)
        g = torch.full((trainable,), 1e-6)
        with learner.attach(m, job=job) as ps:
            lat = []
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                m.head.grad = g
                t0 = time.perf_counter_ns()
                ps.step()
                lat.append(time.perf_counter_ns() - t0)
            ps.flush()
        return {"updates_per_s": len(lat) / seconds, "step_p50_us": statistics.median(lat) / 1000}
    finally:
        stop.set()
        t.join()
        server.stop()


def markdown(r: dict) -> str:
    """The run as the README quotes it."""
    return "\n".join([
        "# A frozen backbone's step", "", f"Machine: {machine_line(r.get('machine'))}.", "",
        f"Command: `{r['command']}`.", "",
        f"{r['trainable']:,} trainable + {r['frozen']:,} frozen parameters, 1 null learner, median of {r['reps']} "
        f"runs of {r['seconds']:g} s (least-most):", "",
        "| updates/s | step p50 |", "| ---: | ---: |",
        f"| {r['updates_per_s']:,.0f} ({min(r['updates_per_s_runs']):,.0f}-{max(r['updates_per_s_runs']):,.0f}) | "
        f"{r['step_p50_us']:.1f} us ({min(r['step_p50_us_runs']):.1f}-{max(r['step_p50_us_runs']):.1f}) |", ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainable", type=int, default=100_000)
    p.add_argument("--frozen", type=int, default=10_000_000)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS, help=f"where frozen_pull.json/.md go (default: {RESULTS})")
    args = p.parse_args()
    torch.set_num_threads(1)
    host = machine()
    runs = [measure(args.trainable, args.frozen, args.seconds) for _ in range(args.reps)]
    rate = statistics.median(r["updates_per_s"] for r in runs)
    step = statistics.median(r["step_p50_us"] for r in runs)
    print(f"{args.trainable:,} trainable + {args.frozen:,} frozen parameters, 1 learner: {rate:,.0f} updates/s, "
          f"step p50 {step:.1f} us (median of {args.reps})")
    r = {"machine": host, "command": command_line(), "trainable": args.trainable, "frozen": args.frozen,
         "seconds": args.seconds, "reps": args.reps, "updates_per_s": rate, "step_p50_us": step,
         "updates_per_s_runs": [x["updates_per_s"] for x in runs], "step_p50_us_runs": [x["step_p50_us"] for x in runs]}
    write_results(args.out, "frozen_pull", r, markdown(r))


if __name__ == "__main__":
    main()
