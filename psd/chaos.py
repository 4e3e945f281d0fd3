"""``psd chaos``: kill parts of a live psd job at random intervals, to test its fault tolerance.

    psd chaos --job demo --target learner --every 1 --signal KILL,SEGV --duration 60
    psd chaos --job demo --target server --count 1 --after-clock 2000
    psd chaos --job demo --target all-learners --count 1

The victims are read from the job's arena: the server and watchdog pids from its
header, the learner pids from its learner slots, each checked against its
process start time, so only processes of that job are ever signalled. Each kill
is printed as a JSON line: {"t": ..., "target": ..., "pid": ..., "signal": ...,
"clock": ...}. It stops by itself: after --count kills, after --duration
seconds, or when the job is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from psd import _native
from psd.arena import open_job
from psd.errors import Error

__all__ = ["TARGETS", "ChaosConfig", "add_arguments", "config_from_args", "job_pids", "run"]

TARGETS = ("learner", "server", "watchdog", "all-learners", "any")


@dataclass
class ChaosConfig:
    """What ``psd chaos`` is asked to do."""

    job: str
    target: str = "learner"
    signals: tuple[str, ...] = ("KILL",)
    every: float = 1.0
    count: int = 0
    duration: float = 60.0
    after_clock: int = 0
    seed: int | None = None

    def validate(self) -> None:
        """Raise ValueError with a fix for each bad value."""
        if self.target not in TARGETS:
            raise ValueError(f"--target must be one of {', '.join(TARGETS)}, not {self.target!r}")
        for s in self.signals:
            if not isinstance(getattr(signal, "SIG" + s, None), signal.Signals):
                raise ValueError(f"--signal {s!r} is not a signal name; give e.g. KILL, SEGV or KILL,SEGV")
        if not self.every > 0:
            raise ValueError(f"--every must be a positive number of seconds, not {self.every}")
        if self.count < 0 or self.duration < 0:
            raise ValueError("--count and --duration must be 0 (no limit) or more")
        if not self.count and not self.duration:
            raise ValueError("give --count N or --duration S (or both): psd chaos must stop by itself")


def job_pids(job: str) -> dict[str, list[int]] | None:
    """The live processes of ``job`` by role (learner, server, watchdog) and its weights clock; None if no job."""
    try:
        a = open_job(job, role="reader")
    except Error:
        return None
    try:
        h = a.header()
        learners = []
        if a.state == _native.ARENA_READY:
            a.remap()
            for i in range(h["n_slots"]):
                s = a.slot_info(i)
                if s["state"] == _native.SLOT_ACTIVE and _native.owner_alive(s["pid"], s["start_time"]):
                    learners.append(s["pid"])

        def alive(pid: int, start: int) -> list[int]:
            return [pid] if _native.owner_alive(pid, start) else []

        return {
            "clock": [a.clock()],
            "learner": learners,
            "server": alive(h["server_pid"], h["server_start_time"]),
            "watchdog": alive(h["watchdog_pid"], h["watchdog_start_time"]),
        }
    finally:
        a.close()


def run(cfg: ChaosConfig, out: Callable[[str], None] = print) -> int:
    """Kill parts of ``cfg.job`` until a bound is reached or the job is gone; returns the number of kills."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    sigs = [getattr(signal, "SIG" + s) for s in cfg.signals]
    t0 = time.monotonic()
    kills = 0
    seen_job = False
    while not (cfg.duration and time.monotonic() - t0 > cfg.duration):
        pids = job_pids(cfg.job)
        if pids is None:
            if seen_job:
                return kills  # the job ended
        else:
            seen_job = True
        if pids is not None and pids["clock"][0] >= cfg.after_clock:
            target = cfg.target if cfg.target != "any" else rng.choice(("learner", "server", "watchdog"))
            if target == "all-learners":
                victims = [("learner", pid) for pid in pids["learner"]]
            else:
                victims = [(target, rng.choice(pids[target]))] if pids[target] else []
            for what, pid in victims:
                sig = rng.choice(sigs)
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    continue
                out(json.dumps({"t": round(time.monotonic() - t0, 3), "target": what, "pid": pid,
                                "signal": signal.Signals(sig).name, "clock": pids["clock"][0]}))
            if victims:
                kills += 1
                if cfg.count and kills >= cfg.count:
                    return kills
                time.sleep(rng.uniform(0.5, 1.5) * cfg.every)  # the fault rate asked for, not synchronisation
                continue
        time.sleep(0.05)  # polling the arena: waiting for the job, or for something to kill
    return kills


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``psd chaos``: from the command line only, unlike every other command's.

    psd chaos sends signals (SIGKILL by default) to a job's processes, so what it kills, how often and for
    how long must be what its command line says. A PSD_<FLAG> default would aim it at whatever job the
    environment names: ``psd run`` sets PSD_JOB in every learner's environment, and a shell that exported
    PSD_JOB for ``psd status`` would hand it to chaos too.
    """
    p.add_argument("--job", required=True, help="the job whose processes to kill (only its own are ever signalled)")
    p.add_argument("--target", choices=TARGETS, default="learner",
                   help="what to kill: one learner, the server, the watchdog, every learner at once, or any one "
                        "of learner/server/watchdog at random (default: %(default)s)")
    p.add_argument("--signal", default="KILL", metavar="SIG[,SIG...]",
                   help="the signal, or several chosen at random, e.g. KILL,SEGV (default: %(default)s)")
    p.add_argument("--every", type=float, default=1.0,
                   help="mean seconds between kills (each gap uniform in 0.5x..1.5x) (default: %(default)s)")
    p.add_argument("--count", type=int, default=0, help="stop after this many kills (0: no limit; default)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="stop after this many seconds (0: no limit, then --count must be set) (default: %(default)s)")
    p.add_argument("--after-clock", type=int, default=0,
                   help="wait until the job's weights clock reaches this before the first kill (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed, for a repeatable sequence of victims")


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    """The ChaosConfig that parsed ``psd chaos`` flags ask for."""
    names = [s.strip().upper().removeprefix("SIG") for s in args.signal.split(",")]
    return ChaosConfig(job=args.job, target=args.target, signals=tuple(n for n in names if n),
                       every=args.every, count=args.count, duration=args.duration, after_clock=args.after_clock,
                       seed=args.seed)
