"""A server SIGKILLed again and again, at random moments, under the watchdog, in each sync mode: nothing lost,
and no more applied twice than the kills allow, by the counts and by the weights.

Two honest learners (tests/helpers/honest.py, ranks 0 and 1) push gradients of ones into a Linear(262144, 2)
(524,288 weights: the update loop is busy enough that about half the kills land while it finishes a bsp /
kasync round, where update.c recover_round takes over) under sgd at lr 1, while the test SIGKILLs the server
PSD_KILLS times (default 4; the slow suite 30: `PSD_KILLS=30 pytest tests/chaos/test_server_kills.py`), each
after a random number of updates (seeded) of the watchdog's next server. With P the gradients pushed and K the
kills: each rank's applied count is within [its pushes, its pushes + K], their excess together at most K, and
every weight moved by: under asp one per applied gradient, a whole number in [P, P + K]; under kasync:2 each
closed round by its two gradients (the last round's one may be pending), a whole number in [P - 1, P + 2K] and
in [2 R, 2 R + 2K] for R rounds (an entry taken again adds one, a round applied again after a kill inside its
update two); under bsp each round by the mean of its gradients, 1, in [R, R + K], with R at least P / 2 (not
always whole: an entry taken again after a kill inside its own take is in its round's sum twice, in part).
These bounds catch a loss; a round applied again after a kill (+1 under bsp, +3 under kasync:2 before
update.c recover_round) fits them, and tests/test_sync.py's test_a_server_killed_finishing_a_round_applies_it_once
catches it at each point of a round's finish.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys

import pytest

from conftest import HELPERS, arena_header, child_env, read_line, wait_until
from psd import learner

KILLS = int(os.environ.get("PSD_KILLS", "4"))
FEATURES = 1 << 18


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sync", ["asp", "kasync:2", "bsp"])
def test_a_server_killed_again_and_again_loses_nothing(job, serve, sync):
    serve(job, "--learners", "2", "--lr", "1", "--ring-depth", "8", "--sync", sync, "--server-restarts",
          str(KILLS + 1))
    honest = [subprocess.Popen([sys.executable, str(HELPERS / "honest.py"), job, str(r), str(10**9), str(FEATURES)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=child_env()) for r in (0, 1)]
    try:
        for p in honest:
            assert read_line(p, 60) == "ready"
        w0 = learner.pull_state_dict(job)["weight"].double()
        first = arena_header(job)
        for p in honest:
            p.stdin.write("go\n")
            p.stdin.flush()
        rng = random.Random(f"{sync}-{KILLS}")
        for k in range(KILLS):
            # a random moment of this server's life: inside a take, a round's finish, or between
            due = arena_header(job)["applied"] + rng.randint(1, 200)
            wait_until(lambda d=due: arena_header(job)["applied"] >= d, timeout=120, what="updates")
            h = arena_header(job)
            os.kill(h["server_pid"], signal.SIGKILL)
            wait_until(lambda g=h["generation"]: (lambda x: x["generation"] == g + 1 and x["state"] == 4)(
                arena_header(job)), timeout=60, what=f"the watchdog's server after kill {k + 1}")
        for p in honest:
            p.stdin.write("stop\n")
            p.stdin.flush()
        done = [read_line(p, 180).split() for p in honest]
        for p in honest:
            assert p.wait(timeout=60) == 0
        h = arena_header(job)
        assert h["server_restarts"] == KILLS and h["generation"] == first["generation"] + KILLS
        for d in done:
            assert d[0] == "done" and int(d[1]) > 0 and int(d[1]) <= int(d[2]) <= int(d[1]) + KILLS, done
        assert sum(int(d[2]) - int(d[1]) for d in done) <= KILLS, done
        pushed, rounds = sum(int(d[1]) for d in done), h["rounds"]
        moved = w0 - learner.pull_state_dict(job)["weight"].double()
        if sync != "bsp":  # sums of ones; a bsp round's mean holding an entry taken twice in part moves by a part
            assert (moved - moved.round()).abs().max() < 0.05, "a weight moved by a part of a gradient"
            moved = moved.round()
        lo, hi = moved.min().item(), moved.max().item()
        if sync == "asp":
            assert pushed <= lo and hi <= pushed + KILLS, (pushed, lo, hi)
        elif sync == "kasync:2":
            assert pushed - 1 <= lo and hi <= pushed + 2 * KILLS, (pushed, lo, hi)
            assert 2 * rounds <= lo and hi <= 2 * rounds + 2 * KILLS, (rounds, lo, hi)
        else:
            assert math.ceil(pushed / 2) <= rounds <= lo + 0.05 and hi <= rounds + KILLS + 0.05, \
                (pushed, rounds, lo, hi)
    finally:
        for p in honest:
            if p.poll() is None:
                p.kill()
                p.wait()
