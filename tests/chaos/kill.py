"""Kill parts of a live psd job at random intervals: learners, the server, the watchdog, or all.

    python tests/chaos/kill.py --job demo --target learner --every 1.0 --signal KILL
    python tests/chaos/kill.py --job demo --target server --count 1 --after-clock 2000
    python tests/chaos/kill.py --job demo --target all-learners --count 1

Targets are read from the job's arena header (server and watchdog pids) and
its learner slots (learner pids), so it works against any job on the machine.
Each kill is printed as a JSON line: {"t": ..., "target": ..., "pid": ..., "signal": ...}.
Stops after --count kills, after --duration seconds, or when the job is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

from psd import _native
from psd.arena import open_job
from psd.errors import Error

TARGETS = ("learner", "server", "watchdog", "all-learners", "any")


def pids_of(job: str) -> dict[str, list[int]] | None:
    try:
        a = open_job(job)
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
        alive = lambda pid, start: [pid] if _native.owner_alive(pid, start) else []  # noqa: E731
        return {
            "clock": [a.clock()],
            "learner": learners,
            "server": alive(h["server_pid"], h["server_start_time"]),
            "watchdog": alive(h["watchdog_pid"], h["watchdog_start_time"]),
        }
    finally:
        a.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True)
    p.add_argument("--target", choices=TARGETS, default="learner")
    p.add_argument("--signal", default="KILL", help="KILL, SEGV, or several: KILL,SEGV (chosen at random)")
    p.add_argument("--every", type=float, default=1.0, help="mean seconds between kills")
    p.add_argument("--count", type=int, default=0, help="stop after this many kills (0: no limit)")
    p.add_argument("--duration", type=float, default=0, help="stop after this many seconds (0: no limit)")
    p.add_argument("--after-clock", type=int, default=0, help="wait until the weights clock passes this")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    sigs = [getattr(signal, "SIG" + s.strip().upper()) for s in args.signal.split(",")]
    t0 = time.monotonic()
    kills = 0
    seen_job = False
    while True:
        pids = pids_of(args.job)
        if pids is None:
            if seen_job:
                return 0  # the job ended
        else:
            seen_job = True
        if args.duration and time.monotonic() - t0 > args.duration:
            return 0
        if pids is not None and pids["clock"][0] >= args.after_clock:
            target = args.target if args.target != "any" else rng.choice(("learner", "server", "watchdog"))
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
                print(json.dumps({"t": round(time.monotonic() - t0, 3), "target": what, "pid": pid,
                                  "signal": signal.Signals(sig).name, "clock": pids["clock"][0]}), flush=True)
            if victims:
                kills += 1
                if args.count and kills >= args.count:
                    return 0
                time.sleep(rng.uniform(0.5, 1.5) * args.every)
                continue
        time.sleep(0.05)  # waiting for the job, or for something to kill


if __name__ == "__main__":
    sys.exit(main())
