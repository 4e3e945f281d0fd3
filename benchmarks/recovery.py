"""How fast psd recovers: a dead learner's slot reclaimed, a killed server replaced.

    python benchmarks/recovery.py [--runs 3] [--rounds 5] [--out benchmarks/results]

*learner*: SIGKILL a learner that is pushing, once the server has seen it
attach (its event log's learner_attached: the server then sleeps on its
pidfd); time until its slot is freed (its pushed gradients applied) and usable
by another learner. A learner killed before the server's first look at it (0.1
s) is reaped at that look instead.
*server*: SIGKILL the server under its watchdog, ``--rounds`` times 0.5 s apart,
while a learner pushes (a training job); time until a new server has taken over
the arena and its update loop beats. The watchdog restarts at once a server
that applied gradients in its life; one that did not is a crash loop, and each
restart of it after the first waits (0.1 s, doubling; see
watchdog/supervisor.py). The first kill and the later ones are reported apart,
each later one with its back-off (from the job's event log: 0 here, as every
life applies gradients) and what is left without it. Each of the ``--runs`` runs
is a new job, so each has a first kill of its own: the figures are over all
runs.

*learner under psd run*: the same job as a user runs it (`psd run --learners 2
-- python examples/train_mlp.py`): SIGKILL rank 0's learner ``--rounds``
times, 1 s apart, each once the server has seen it attach; time until its slot
is freed, until psd run's next life of it holds a slot of its rank, and until
that life's first gradient is applied (what its rank loses).

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


def _events(event_log: Path) -> list[dict]:
    """The job's events so far."""
    if not event_log.exists():
        return []
    return [json.loads(line) for line in event_log.read_text().splitlines() if line.endswith("}")]


def _backoffs(event_log: Path) -> list[float]:
    """The watchdog's wait before each server restart, in ms, in order (its server_restart events)."""
    return [1000 * float(e.get("backoff_s", 0.0)) for e in _events(event_log) if e.get("event") == "server_restart"]


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
            while not any(e.get("event") == "learner_attached" and e.get("learner_pid") == learner.pid
                          for e in _events(events)):
                time.sleep(0.01)  # polling the event log: the server logs the attach at its next look
            a.remap()
            before = a.header()["reclaimed"]
            t0 = time.monotonic()
            learner.kill()
            learner.wait()
            while a.header()["reclaimed"] == before:
                time.sleep(0.001)
            reclaim.append(1000 * (time.monotonic() - t0))
        pushing = subprocess.Popen([sys.executable, str(HELPER), job, "--forever", "--fill", "--ready-after", "100"],
                                   stdout=subprocess.PIPE, text=True)
        assert pushing.stdout is not None
        if pushing.stdout.readline().strip() != "ready":
            raise RuntimeError("the pushing learner did not start; run tests/helpers/pusher.py by hand to see why")
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
        pushing.kill()
        pushing.wait()
        a.close()
    finally:
        wd.send_signal(signal.SIGTERM)
        wd.wait()
    backoff = _backoffs(events)[:len(restart)]
    backoff += [0.0] * (len(restart) - len(backoff))
    return {"learner_reclaim_ms": [round(x, 1) for x in reclaim], "server_restart_ms": [round(x, 1) for x in restart],
            "server_backoff_ms": [round(x, 1) for x in backoff]}


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_mlp.py"


def measure_run(rounds: int, state: Path) -> dict:
    """``rounds`` kills of rank 0's learner under ``psd run``: its slot freed, its next life's slot, its first
    applied gradient, each in ms after the kill."""
    from psd import _native

    job = f"bench-recovery-run-{os.getpid()}"
    events = state / "events.jsonl"
    run = subprocess.Popen([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "2", "--quiet",
                            "--lr", "0.02", "--checkpoint-every", "0", "--checkpoint-dir", str(state / "checkpoints"),
                            "--event-log", str(events), "--max-restarts", str(rounds + 5), "--", sys.executable,
                            str(EXAMPLE), "--epochs", "1000", "--batch-size", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    freed, held, first = [], [], []
    try:
        wait_for_job(job, timeout=120)
        a = open_job(job, role="reader")
        deadline = time.monotonic() + 120
        while a.state != _native.ARENA_READY:  # the first learner's model, then the weights
            if time.monotonic() > deadline or run.poll() is not None:
                raise RuntimeError("psd run's job never held its model; run it by hand to see why")
            a.wait_state(a.state, 0.1)
        a.close()
        a = open_job(job, role="reader")  # mapped at the size the model grew it to

        def rank0() -> dict | None:
            for i in range(2):
                s = a.slot_info(i)
                if s["state"] == _native.SLOT_ACTIVE and s["rank"] == 0:
                    return s | {"slot": i}
            return None

        for _ in range(rounds):
            deadline = time.monotonic() + 120
            while (s := rank0()) is None or not any(
                    e.get("event") == "learner_attached" and e.get("learner_pid") == s["pid"] for e in _events(events)):
                if time.monotonic() > deadline or run.poll() is not None:
                    raise RuntimeError("psd run's rank 0 learner did not attach; run the job by hand to see why")
                time.sleep(0.01)  # polling the event log: the server logs the attach at its next look
            time.sleep(1.0)  # a learner that has trained a while, not one killed as it attached
            s = rank0()
            t0 = time.monotonic()
            os.kill(s["pid"], signal.SIGKILL)
            t_freed = t_held = t_first = None
            while t_first is None and time.monotonic() - t0 < 30:
                now = time.monotonic()
                if t_freed is None:
                    x = a.slot_info(s["slot"])
                    if x["claims"] != s["claims"] or x["state"] == _native.SLOT_FREE:  # freed (and maybe taken)
                        t_freed = now
                new = rank0()
                if new is not None and new["pid"] != s["pid"]:
                    t_held = t_held or now
                    if new["applied"] > 0:
                        t_first = now
                time.sleep(0.0005)
            if t_first is None:
                raise RuntimeError("the killed learner's next life applied nothing within 30 s")
            freed.append(1000 * ((t_freed or t_held) - t0))  # unseen: freed and taken between two looks
            held.append(1000 * (t_held - t0))
            first.append(1000 * (t_first - t0))
        a.close()
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
    return {"run_freed_ms": [round(x, 1) for x in freed], "run_next_life_ms": [round(x, 1) for x in held],
            "run_first_gradient_ms": [round(x, 1) for x in first]}


def summary(runs: list[dict]) -> dict:
    """Every run's figures pooled: learner reclaims, first kills, later kills with and without their back-off."""
    later = [(t, b) for r in runs for t, b in zip(r["server_restart_ms"][1:], r["server_backoff_ms"][1:], strict=True)]
    return {"learner_reclaim_ms": [x for r in runs for x in r["learner_reclaim_ms"]],
            **{k: [x for r in runs for x in r.get(k, [])] for k in ("run_freed_ms", "run_next_life_ms",
                                                                     "run_first_gradient_ms")},
            "first_kill_ms": [r["server_restart_ms"][0] for r in runs],
            "later_kills_ms": [t for t, _ in later], "later_backoff_ms": [b for _, b in later],
            "later_kills_without_backoff_ms": [round(t - b, 1) for t, b in later]}


def markdown(r: dict) -> str:
    """The figures as the README quotes them."""
    return "\n".join([
        "# Recovery: a learner killed, a server killed", "", f"Machine: {machine_line(r.get('machine'))}.", "",
        f"Command: `{r['command']}`.", "",
        f"{len(r['runs'])} runs (a new job each) of {r['rounds']} learner kills, then {r['rounds']} server kills "
        "0.5 s apart while a learner pushes; every figure pooled over the runs.", "",
        "| what | ms |", "| --- | --- |",
        f"| learner death -> slot reclaimed | {_ms(r['learner_reclaim_ms'])} |",
        f"| server kill -> new server running, first kill of a run | {_ms(r['first_kill_ms'])} |",
        f"| server kill -> new server running, later kills | {_ms(r['later_kills_ms'])} |",
        f"| the watchdog's back-off before each of those | {_ms(r['later_backoff_ms'])} |",
        f"| later kills less their back-off | {_ms(r['later_kills_without_backoff_ms'])} |",
        f"| psd run: rank 0's learner killed -> its slot freed | {_ms(r['run_freed_ms'])} |",
        f"| psd run: -> its next life holds a slot of its rank | {_ms(r['run_next_life_ms'])} |",
        f"| psd run: -> that life's first gradient applied | {_ms(r['run_first_gradient_ms'])} |", ""])


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
            runs.append(measure(args.rounds, state) | measure_run(args.rounds, state / "run"))
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
