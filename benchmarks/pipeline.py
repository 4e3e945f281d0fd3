"""Virtual workers against data-parallel learners and one process: loss, time, memory per process.

    python benchmarks/pipeline.py [--reps 2] [--out benchmarks/results]

The workload is examples/pipeline_lm.py (a character-level transformer on the Python reference manual,
Adam at lr 0.003, mini-batches of 16 windows, 2 passes over the data). Set-ups, each through `psd run`
(asp, the server's Adam at the same lr): V x K virtual workers of K pipeline stages (torch.distributed.
pipelining, GPipe, 4 micro-batches), with and without --predict; V x K data-parallel learners of the whole
model; and one process with torch.optim.Adam. Each psd set-up runs --reps times (asynchrony makes runs
differ; the one process is deterministic). Reported: the job's validation loss (nats a character) and its
gap to one process's, wall time, and the peak resident memory of a learner process (its mean over the
job's learners). Results: pipeline.json and pipeline.md in --out (with the machine they ran on).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psd.bench.record import RESULTS, command_line, machine, machine_line, write_results

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pipeline_lm.py"
SETUPS = [  # (name, --learners, --stages, extra server flags)
    ("2 virtual workers x 2 stages", 2, 2, []),
    ("2 virtual workers x 2 stages, --predict", 2, 2, ["--predict"]),
    ("1 virtual worker x 2 stages", 1, 2, []),
    ("4 data-parallel learners", 4, 1, []),
    ("4 data-parallel learners, --predict", 4, 1, ["--predict"]),
]


def _parse(out: str) -> tuple[float, list[float]]:
    loss = float(re.search(r"val loss ([0-9.]+)", out).group(1))
    return loss, [float(m) for m in re.findall(r"peak RSS ([0-9.]+) MiB", out)]


def one_process() -> dict:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(EXAMPLE), "--single"], capture_output=True, text=True, check=True)
    loss, rss = _parse(r.stdout)
    return {"loss": loss, "seconds": round(time.monotonic() - t0, 1), "rss_mib": rss[0]}


def psd_run(learners: int, stages: int, flags: list[str], tmp: Path) -> dict:
    init = tmp / "lm.safetensors"
    if not init.exists():
        subprocess.run([sys.executable, str(EXAMPLE), "--save-init", str(init)], check=True)
    job = f"bench-pipeline-{os.getpid()}"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", str(learners),
                        "--stages", str(stages), "--init", str(init), "--optimizer", "adam", "--lr", "0.003",
                        "--checkpoint-dir", str(tmp / "ck"), "--checkpoint-every", "0", "-q", *flags, "--",
                        sys.executable, str(EXAMPLE)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"psd run exited {r.returncode}:\n{r.stderr[-3000:]}")
    loss, rss = _parse(r.stdout)
    return {"loss": loss, "seconds": round(time.monotonic() - t0, 1), "rss_mib": statistics.mean(rss),
            "processes": len(rss)}


def markdown(r: dict) -> str:
    base = r["one_process"]
    lines = ["# Virtual workers (pipeline stages) against data-parallel learners", "",
             f"Machine: {machine_line(r.get('machine'))}.", "", f"Command: `{r['command']}`.", "",
             "examples/pipeline_lm.py: a 4-block character transformer on the Python reference manual, Adam lr "
             "0.003, mini-batches of 16, 2 passes; validation loss in nats a character (the job's final model), "
             f"gap relative to one process's; {r['reps']} runs of each psd set-up (least-most).", "",
             "| set-up | processes | val loss | gap | wall s | peak RSS a process, MiB |",
             "| --- | ---: | --- | --- | --- | ---: |",
             f"| one process (torch.optim.Adam) | 1 | {base['loss']:.4f} | | {base['seconds']:.0f} | "
             f"{base['rss_mib']:.0f} |"]
    for s in r["setups"]:
        losses = [x["loss"] for x in s["runs"]]
        gaps = [(x / base["loss"] - 1) * 100 for x in losses]
        secs = [x["seconds"] for x in s["runs"]]
        lines.append(f"| {s['name']} | {s['runs'][0]['processes']} | {statistics.median(losses):.4f} "
                     f"({min(losses):.4f}-{max(losses):.4f}) | {statistics.median(gaps):+.1f}% "
                     f"({min(gaps):+.1f} to {max(gaps):+.1f}) | {statistics.median(secs):.0f} | "
                     f"{statistics.mean(x['rss_mib'] for x in s['runs']):.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    host = machine()
    base = one_process()
    print("one process", base, flush=True)
    setups = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, learners, stages, flags in SETUPS:
            runs = []
            for _ in range(args.reps):
                runs.append(psd_run(learners, stages, flags, Path(tmp)))
                print(name, runs[-1], flush=True)
            setups.append({"name": name, "learners": learners, "stages": stages, "flags": flags, "runs": runs})
    r = {"machine": host, "command": command_line(), "reps": args.reps, "one_process": base, "setups": setups}
    print(markdown(r))
    write_results(args.out, "pipeline", r, markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
