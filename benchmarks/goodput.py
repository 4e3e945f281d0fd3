"""Goodput under faults: how much of a training job's throughput is kept while learners and the server die.

    python benchmarks/goodput.py [--learners 2] [--epochs 12] [--batch 1] [--learner-every 10]
                                 [--server-every 60] [--rounds 3] [--out benchmarks/results]

The same `psd run` job (examples/train_mlp.py: it resumes with `resume_step`, so a restarted learner
replays nothing) runs twice per round, taking turns: clean, and with two `psd chaos` processes killing a
learner (SIGKILL) every --learner-every seconds and the server every --server-every seconds, each gap
uniform around its mean. Goodput kept: clean wall time / faulty wall time for the same work, from the
first update applied to the end of the job (psd run's start-up is left out). Work lost or repeated: the
applied totals of the final checkpoints (per rank) against a clean run's. Target (issue 27): >= 0.97
kept at a learner kill every 10 s plus a server kill a minute. goodput.json and goodput.md (with the
machine) go into --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psd.arena import open_job
from psd.bench.record import RESULTS, command_line, machine, machine_line, write_results
from psd.errors import Error
from psd.watchdog import checkpoint

ROOT = Path(__file__).resolve().parents[1]


def run(job: str, learners: int, epochs: int, batch: int, faults: tuple[float, float] | None,
        flags: list[str]) -> dict:
    ck = Path(tempfile.mkdtemp(prefix="psd-goodput-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", str(learners), "--lr", "0.02",
           "--checkpoint-dir", str(ck), "--max-restarts", "50", *flags, "--", sys.executable,
           str(ROOT / "examples" / "train_mlp.py"), "--epochs", str(epochs), "--batch-size", str(batch)]
    t0 = time.perf_counter()
    job_proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    chaos = []
    if faults:
        for target, every in (("learner", faults[0]), ("server", faults[1])):
            chaos.append(subprocess.Popen(
                [sys.executable, "-m", "psd.cli", "chaos", "--job", job, "--target", target, "--signal", "KILL",
                 "--every", str(every), "--duration", "0", "--count", "100000", "--after-clock", "1",
                 "--seed", str(len(chaos))], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    first = None  # when the first update was applied: psd run's own start-up (watchdog, imports) is not training
    while first is None and job_proc.poll() is None:
        try:
            a = open_job(job, role="reader")
            try:
                if a.clock() > 0:
                    first = time.perf_counter()
            finally:
                a.close()
        except Error:
            pass
        time.sleep(0.02)
    _, err = job_proc.communicate(timeout=3600)
    wall = time.perf_counter() - (first or t0)
    kills = {"learner": 0, "server": 0}
    for c, target in zip(chaos, ("learner", "server"), strict=False):
        c.terminate()
        text, _ = c.communicate(timeout=60)
        kills[target] = sum(1 for line in text.splitlines() if line.startswith("{"))
    if job_proc.returncode != 0:
        raise SystemExit(f"goodput.py: the job failed (exit {job_proc.returncode}):\n{err[-3000:]}")
    last = checkpoint.latest(ck)
    return {"wall_s": wall, "ranks": last.ranks[:learners] if last else None, "kills": kills,
            "restarts": err.count(" restarted (")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--learner-every", type=float, default=10.0)
    p.add_argument("--server-every", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run-flags", default="", help="more psd run flags for both runs, e.g. '--fork-server off'")
    p.add_argument("--name", default="goodput", help="the results' file name (NAME.json, NAME.md)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    flags = args.run_flags.split()
    rounds = []
    for k in range(args.rounds):
        job = f"goodput-{os.getpid()}-{k}"
        clean = run(job + "-c", args.learners, args.epochs, args.batch, None, flags)
        faulty = run(job + "-f", args.learners, args.epochs, args.batch, (args.learner_every, args.server_every), flags)
        kept = clean["wall_s"] / faulty["wall_s"]
        extra = sum(faulty["ranks"]) - sum(clean["ranks"])
        rounds.append({"clean": clean, "faulty": faulty, "kept": kept, "applied_beyond_clean": extra})
        print(f"round {k + 1}: clean {clean['wall_s']:.1f} s, with faults {faulty['wall_s']:.1f} s "
              f"({faulty['kills']['learner']} learner and {faulty['kills']['server']} server kills): kept {kept:.3f}, "
              f"applied {sum(faulty['ranks'])} against {sum(clean['ranks'])}", flush=True)
    kept = [r["kept"] for r in rounds]
    res = {"machine": machine(), "command": command_line(), "run_flags": flags, "learners": args.learners,
           "epochs": args.epochs,
           "batch": args.batch, "learner_every": args.learner_every, "server_every": args.server_every,
           "kept_median": statistics.median(kept), "kept_min": min(kept), "kept_max": max(kept), "rounds": rounds}
    md = [f"# Goodput under faults: {args.learners} learners, a learner killed every ~{args.learner_every:g} s and "
          f"the server every ~{args.server_every:g} s" + (f" (psd run {' '.join(flags)})" if flags else ""), "",
          machine_line(res["machine"]), "",
          f"Command: `{res['command']}`", "",
          "| round | clean s | with faults s | learner kills | server kills | kept | applied (faults / clean) |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(rounds):
        f = r["faulty"]
        md.append(f"| {i + 1} | {r['clean']['wall_s']:.1f} | {f['wall_s']:.1f} | {f['kills']['learner']} | "
                  f"{f['kills']['server']} | {r['kept']:.3f} | {sum(f['ranks'])} / {sum(r['clean']['ranks'])} |")
    md += ["", f"Kept: median {res['kept_median']:.3f} ({res['kept_min']:.3f}-{res['kept_max']:.3f}); target 0.97."]
    write_results(args.out, args.name, res, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
