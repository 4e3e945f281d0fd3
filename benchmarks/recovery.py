"""How fast psd recovers: a dead learner's slot reclaimed, a killed server replaced.

    python benchmarks/recovery.py [--runs 3] [--rounds 5] [--out benchmarks/results]

*learner*: SIGKILL a learner that is pushing; time until its slot is freed
(its pushed gradients applied) and usable by another learner.
*server*: SIGKILL the server under its watchdog, ``--rounds`` times 0.5 s apart;
time until a new server has taken over the arena and its update loop beats.
The watchdog restarts the first crash at once and waits before each later one
(0.1 s, doubling: a crash loop is backed off; see watchdog/supervisor.py), so
the first kill and the later ones are reported apart, each later one with its
back-off (from the job's event log) and what is left without it. Each of the
``--runs`` runs is a new job, so each has a first kill of its own: the figures
are over all runs.

Prints each figure and writes recovery.json and recovery.md (with the machine)
into --out, replacing the old ones only once both are written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from psd.arena import open_job, wait_for_job
from psd.bench.record import RESULTS, command_line, machine, machine_line, write_results

HELPER = Path(__file__).resolve().parent.parent / "tests" / "helpers" / "pusher.py"


def _ms(xs: list[float]) -> str:
    """Milliseconds: the median, then the range and every value."""
    if not xs:
        return "-"
    return (f"median {statistics.median(xs):.0f} ms, {min(xs):.0f}-{max(xs):.0f} "
            f"({', '.join(f'{x:.0f}' for x in xs)})")


def _backoffs(event_log: Path) -> list[float]:
    """The watchdog's wait before each server restart, in ms, in order (its server_restart events)."""
    if not event_log.exists():
        return []
    out = []
    for line in event_log.read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "server_restart":
            out.append(1000 * float(e.get("backoff_s", 0.0)))
    return out


def measure(rounds: int, state: Path) -> dict:
    """``rounds`` learner kills, then ``rounds`` server kills, under one `psd serve` job."""
    job = f"bench-recovery-{os.getpid()}"
    events = state / "events.jsonl"
    wd = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--job", job, "--learners", "2", "--quiet",
                           "--checkpoint-every", "0", "--checkpoint-dir", str(state / "checkpoints"),
                           "--event-log", str(events)])
    try:
        wait_for_job(job)
        a = open_job(job)
        reclaim, restart = [], []
        for _ in range(rounds):
            learner = subprocess.Popen([sys.executable, str(HELPER), job, "--forever", "--fill", "--ready-after",
                                        "100"], stdout=subprocess.PIPE, text=True)
            assert learner.stdout is not None
            if learner.stdout.readline().strip() != "ready":
                raise RuntimeError("the pushing learner did not start; run tests/helpers/pusher.py by hand to see why")
            a.remap()
            before = a.header()["reclaimed"]
            t0 = time.monotonic()
            learner.kill()
            learner.wait()
            while a.header()["reclaimed"] == before:
                time.sleep(0.001)
            reclaim.append(1000 * (time.monotonic() - t0))
        for _ in range(rounds):
            time.sleep(0.5)  # the watchdog must have seen the server run (a start failure is backed off)
            old = a.header()["server_pid"]
            t0 = time.monotonic()
            os.kill(old, signal.SIGKILL)
            while True:
                h = a.header()
                if h["server_pid"] not in (0, old) and 0 <= h["heartbeat_age_s"] < 0.05 and a.server_alive():
                    break
                time.sleep(0.001)
            restart.append(1000 * (time.monotonic() - t0))
        a.close()
    finally:
        wd.send_signal(signal.SIGTERM)
        wd.wait()
    backoff = _backoffs(events)[:len(restart)]
    backoff += [0.0] * (len(restart) - len(backoff))
    return {"learner_reclaim_ms": [round(x, 1) for x in reclaim], "server_restart_ms": [round(x, 1) for x in restart],
            "server_backoff_ms": [round(x, 1) for x in backoff]}


def summary(runs: list[dict]) -> dict:
    """Every run's figures pooled: learner reclaims, first kills, later kills with and without their back-off."""
    later = [(t, b) for r in runs for t, b in zip(r["server_restart_ms"][1:], r["server_backoff_ms"][1:], strict=True)]
    return {"learner_reclaim_ms": [x for r in runs for x in r["learner_reclaim_ms"]],
            "first_kill_ms": [r["server_restart_ms"][0] for r in runs],
            "later_kills_ms": [t for t, _ in later], "later_backoff_ms": [b for _, b in later],
            "later_kills_without_backoff_ms": [round(t - b, 1) for t, b in later]}


def markdown(r: dict) -> str:
    """The figures as the README quotes them."""
    return "\n".join([
        "# Recovery: a learner killed, a server killed", "", f"Machine: {machine_line(r.get('machine'))}.", "",
        f"Command: `{r['command']}`.", "",
        f"{len(r['runs'])} runs (a new job each) of {r['rounds']} learner kills, then {r['rounds']} server kills "
        "0.5 s apart; every figure pooled over the runs.", "",
        "| what | ms |", "| --- | --- |",
        f"| learner death -> slot reclaimed | {_ms(r['learner_reclaim_ms'])} |",
        f"| server kill -> new server running, first kill of a run (restarted at once) | {_ms(r['first_kill_ms'])} |",
        f"| server kill -> new server running, later kills | {_ms(r['later_kills_ms'])} |",
        f"| the watchdog's back-off before each of those | {_ms(r['later_backoff_ms'])} |",
        f"| later kills less their back-off | {_ms(r['later_kills_without_backoff_ms'])} |", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="jobs to run the rounds in, one after the other")
    p.add_argument("--rounds", type=int, default=5, help="learner kills, then server kills, in each run (2 or more)")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"where recovery.json/.md go (default: {RESULTS})")
    args = p.parse_args(argv)
    if args.rounds < 2 or args.runs < 1:
        p.error("--rounds must be 2 or more (the first server kill and the later ones are reported apart), "
                "--runs 1 or more")
    host = machine()
    runs = []
    for i in range(args.runs):
        state = Path(f"/tmp/psd-bench-recovery-{os.getpid()}-{i}")
        try:
            runs.append(measure(args.rounds, state))
        finally:
            shutil.rmtree(state, ignore_errors=True)
    r = {"machine": host, "command": command_line(["benchmarks/recovery.py", *(sys.argv[1:] if argv is None
                                                                                  else argv)]),
         "rounds": args.rounds, "runs": runs, **summary(runs)}
    print(markdown(r))
    write_results(args.out, "recovery", r, markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
