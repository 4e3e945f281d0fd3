"""How fast psd recovers: a dead learner's slot reclaimed, a killed server replaced.

    python benchmarks/recovery.py [--rounds 5]

*learner*: SIGKILL a learner that is pushing; time until its slot is freed
(its pushed gradients applied) and usable by another learner.
*server*: SIGKILL the server under its watchdog; time until a new server has
taken over the arena and its update loop beats. Prints each figure and the median.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from psd.arena import open_job, wait_for_job

HELPER = Path(__file__).resolve().parent.parent / "tests" / "helpers" / "pusher.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    job = f"bench-recovery-{os.getpid()}"
    wd = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--job", job, "--learners", "2", "--quiet",
                           "--checkpoint-every", "0", "--checkpoint-dir", f"/tmp/{job}"])
    try:
        wait_for_job(job)
        a = open_job(job)
        reclaim, restart = [], []
        for _ in range(args.rounds):
            learner = subprocess.Popen([sys.executable, str(HELPER), job, "--forever", "--fill", "--ready-after",
                                        "100"], stdout=subprocess.PIPE, text=True)
            assert learner.stdout.readline().strip() == "ready"
            a.remap()
            before = a.header()["reclaimed"]
            t0 = time.monotonic()
            learner.kill()
            learner.wait()
            while a.header()["reclaimed"] == before:
                time.sleep(0.001)
            reclaim.append(time.monotonic() - t0)
        for _ in range(args.rounds):
            time.sleep(0.5)  # the watchdog must have seen the server run (a start failure is backed off)
            old = a.header()["server_pid"]
            t0 = time.monotonic()
            os.kill(old, signal.SIGKILL)
            while True:
                h = a.header()
                if h["server_pid"] not in (0, old) and 0 <= h["heartbeat_age_s"] < 0.05 and a.server_alive():
                    break
                time.sleep(0.001)
            restart.append(time.monotonic() - t0)
        a.close()
    finally:
        wd.send_signal(signal.SIGTERM)
        wd.wait()
    for name, xs in (("learner death -> slot reclaimed", reclaim), ("server kill -> new server running", restart)):
        print(f"{name}: median {statistics.median(xs) * 1000:.0f} ms, max {max(xs) * 1000:.0f} ms "
              f"({', '.join(f'{x * 1000:.0f}' for x in xs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
