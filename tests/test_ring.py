"""The ring protocol across real processes: nothing applied twice, nothing lost, nothing half-written.

The servers run without a watchdog: nothing here needs one, and its last checkpoint costs seconds at each stop.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from conftest import finish, kill, read_line, spawn, wait_until
from psd.learner import pull_state_dict
from psd.status import job_status


def status(job: str) -> dict:
    return job_status(job)


def test_every_gradient_applied_exactly_once_across_processes(job, serve):
    s = serve(job, "--no-watchdog", "--learners", "4", "--lr", "1", "--ring-depth", "4")
    count = 1500
    procs = [spawn("pusher.py", job, "--index", str(r), "--count", str(count)) for r in range(4)]
    for p in procs:
        assert finish(p).strip().endswith(f"done {count}")
    w = pull_state_dict(job)["w"]
    # lr 1, one unit per gradient at the learner's own index: the weights count applications.
    assert w[:4].tolist() == [-float(count)] * 4
    assert torch.count_nonzero(w[4:]) == 0
    out = subprocess.run([sys.executable, "-m", "psd.cli", "status", "--job", job, "--json"],
                         capture_output=True, text=True, check=True).stdout
    st = json.loads(out)
    assert st["pushed"] == st["applied"] == 4 * count
    assert st["pending"] == 0 and st["rejected"] == 0
    assert st["clock"] == 4 * count
    log = s.stop()
    assert f"{4 * count} gradients pushed, {4 * count} applied" in log


def test_half_written_gradient_is_never_applied(job, serve):
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1")
    victim = spawn("pusher.py", job, "--half-write", "--n", "4096")
    assert read_line(victim) == "ready"
    kill(victim)
    wait_until(lambda: status(job)["reclaimed_slots"] == 1, what="the dead learner's slot to be freed")
    st = status(job)
    assert st["pushed"] == st["applied"] == 0
    assert st["learners"] == []
    w = pull_state_dict(job)
    assert torch.count_nonzero(w["w"]) == 0 and torch.count_nonzero(w["b"]) == 0


def test_learner_killed_while_pushing(job, serve):
    """The server keeps going; what the victim fully pushed is applied exactly once, and whole."""
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1", "--ring-depth", "8")
    steady_count = 4000
    victim = spawn("pusher.py", job, "--fill", "--forever", "--ready-after", "300", "--n", "4096")
    assert read_line(victim) == "ready"
    steady = spawn("pusher.py", job, "--index", "0", "--count", str(steady_count), "--n", "4096",
                   "--ready-after", "1")
    assert read_line(steady) == "ready"  # both are pushing now
    kill(victim)
    assert finish(steady).strip().endswith(f"done {steady_count}")
    wait_until(lambda: status(job)["reclaimed_slots"] == 1, what="the victim's slot to be freed")
    wait_until(lambda: not status(job)["learners"], what="both slots to be free")
    st = status(job)
    assert st["pending"] == 0
    assert st["pushed"] == st["applied"] + st["rejected"]
    victim_applied = st["applied"] - steady_count
    assert victim_applied >= 300
    w = pull_state_dict(job)
    # Every element got exactly the victim's gradients: a torn gradient would leave them unequal.
    assert torch.all(w["w"][1:] == -victim_applied)
    assert torch.all(w["b"] == -victim_applied)
    assert w["w"][0] == -victim_applied - steady_count
