"""`psd chaos` itself: it signals only the job's own processes, read from its arena, and stops by itself."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import child_env, read_line, spawn, wait_until
from psd.chaos import job_pids


def chaos(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psd.cli", "chaos", *args], capture_output=True, text=True,
                          env=child_env(), timeout=60)


def test_chaos_kills_a_learner_of_the_job_and_stops_after_count(job, serve):
    s = serve(job, "--learners", "2", "--lr", "1", "--no-watchdog")
    victim = spawn("holder.py", job, "--idle")
    assert read_line(victim) == "ready"
    wait_until(lambda: (job_pids(job) or {}).get("learner") == [victim.pid], what="the learner in the arena")
    r = chaos("--job", job, "--target", "learner", "--count", "1", "--signal", "kill", "--seed", "0")
    assert r.returncode == 0, r.stderr
    (kill,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert kill["target"] == "learner" and kill["pid"] == victim.pid and kill["signal"] == "SIGKILL"
    assert victim.wait(timeout=30) == -9
    assert s.proc.poll() is None, "a learner target must leave the server alone"


def test_chaos_must_be_bounded():
    r = chaos("--job", "anything", "--duration", "0")
    assert r.returncode != 0 and "--count" in r.stderr and "--duration" in r.stderr


def test_chaos_rejects_an_unknown_signal():
    r = chaos("--job", "anything", "--count", "1", "--signal", "KILL,NOPE")
    assert r.returncode != 0 and "NOPE" in r.stderr


def test_chaos_without_the_job_stops_at_its_duration():
    r = chaos("--job", "no-such-job-for-chaos", "--duration", "0.2")
    assert r.returncode == 0 and r.stdout == "" and "0 kill(s)" in r.stderr
