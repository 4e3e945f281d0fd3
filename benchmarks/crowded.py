"""Crowded cores: does the server keep its update rate when learners outnumber the cores?

    python benchmarks/crowded.py [--learners 4] [--updates 2100] [--batch 2] [--optimizers sgd,adam]
                                 [--rounds 3] [--out benchmarks/results]

A 301k-parameter MLP (64 -> 512 -> 512 -> 10, as the digits MLP), `--learners` learner processes at a
mini-batch of `--batch` on whatever cores this machine has, `--updates` updates in all, through a real
`psd serve` job per optimizer. Reported per optimizer: the wall time from the last attach to the last
gradient applied, updates/s, the learners' mean staleness (a ring pinned full shows as staleness near
learners x ring depth), and each optimizer's wall time over sgd's (target: adam within 1.3x). The median
over --rounds, with the least and most; crowded.json and crowded.md (with the machine) go into --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from psd.arena import wait_for_job
from psd.bench.record import RESULTS, command_line, machine, machine_line, write_results
from psd.status import job_status

LEARNER = r"""
import os, sys, torch
from psd import learner
torch.set_num_threads(1)
torch.manual_seed(int(os.environ["R"]))
m = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                        torch.nn.Linear(512, 10))
x, y = torch.randn(256, 64), torch.randint(10, (256,))
steps, batch = int(sys.argv[1]), int(sys.argv[2])
with learner.attach(m, job=os.environ["JOB"], rank=int(os.environ["R"])) as ps:
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(steps):
        j = (i * batch) % 256
        torch.nn.functional.cross_entropy(m(x[j:j + batch]), y[j:j + batch]).backward()
        ps.step()
    ps.flush()
    s = ps._arena.slot_info(ps.slot)
    print(s["staleness_sum"] / max(1, s["applied"]), flush=True)
"""


def one(optimizer: str, learners: int, updates: int, batch: int) -> dict:
    job = f"crowded-{os.getpid()}-{optimizer}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--job", job, "--learners", str(learners),
                               "--optimizer", optimizer, "--lr", "0.01", "--no-watchdog", "--quiet"], env=env)
    try:
        wait_for_job(job, timeout=60, server_pid=server.pid)
        per = updates // learners
        procs = [subprocess.Popen([sys.executable, "-c", LEARNER, str(per), str(batch)],
                                  env=dict(env, JOB=job, R=str(r)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True) for r in range(learners)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        stale = [float(p.stdout.readline()) for p in procs]
        wall = time.perf_counter() - t0
        for p in procs:
            p.wait(timeout=600)
        st = job_status(job)
        return {"optimizer": optimizer, "wall_s": wall, "updates": st["applied"], "updates_per_s": st["applied"] / wall,
                "staleness_mean": statistics.mean(stale) if stale else None}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--updates", type=int, default=2100)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--optimizers", default="sgd,adam")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    opts = [o for o in args.optimizers.split(",") if o]
    runs: dict[str, list[dict]] = {o: [] for o in opts}
    for k in range(args.rounds):
        for o in opts:  # taking turns, so a noisy spell hits both
            r = one(o, args.learners, args.updates, args.batch)
            runs[o].append(r)
            print(f"round {k + 1}: {o}: {r['wall_s']:.2f} s, {r['updates_per_s']:.0f} updates/s, staleness "
                  f"{r['staleness_mean']:.1f}", flush=True)
    base = statistics.median(r["wall_s"] for r in runs[opts[0]])
    rows = []
    for o in opts:
        walls = [r["wall_s"] for r in runs[o]]
        rows.append({"optimizer": o, "wall_s": statistics.median(walls), "wall_min": min(walls), "wall_max": max(walls),
                     "updates_per_s": statistics.median(r["updates_per_s"] for r in runs[o]),
                     "staleness_mean": statistics.median(r["staleness_mean"] for r in runs[o]),
                     "vs_first": statistics.median(walls) / base})
    cores = len(os.sched_getaffinity(0))
    res = {"machine": machine(), "command": command_line(), "learners": args.learners, "cores": cores,
           "updates": args.updates, "batch": args.batch, "rounds": args.rounds, "rows": rows, "runs": runs}
    md = [f"# Crowded cores: {args.learners} learners on {cores} cores, {args.updates} updates, batch {args.batch}",
          "", machine_line(res["machine"]), "", f"Command: `{res['command']}`", "",
          f"Median of {args.rounds} rounds (least-most); wall over {opts[0]}'s: target 1.3 or less.", "",
          f"| optimizer | wall s | updates/s | mean staleness | wall / {opts[0]} |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['optimizer']} | {r['wall_s']:.2f} ({r['wall_min']:.2f}-{r['wall_max']:.2f}) | "
                  f"{r['updates_per_s']:.0f} | {r['staleness_mean']:.1f} | {r['vs_first']:.2f} |")
    write_results(args.out, "crowded", res, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
