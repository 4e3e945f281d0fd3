"""A process killed while holding a robust mutex, or while waiting on a condition variable, never hangs the others.

glibc's process-shared pthread_cond_t can hang a broadcaster after a waiter dies
(osrm-backend#3911); psd's condition variables are futex words that leave no
waiter state behind, and its mutexes are robust. These tests kill processes at
exactly those points (SIGKILL), then check the job goes on and nothing is lost. The servers run without a
watchdog (its last checkpoint costs seconds at each stop) but where a killed server must be replaced.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from conftest import arena_header, kill, read_line, spawn, wait_until
from psd import _native, learner
from psd.arena import open_job
from psd.status import job_status


def flat() -> torch.nn.Module:
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(64))
    return m



def test_learner_killed_holding_its_slot_frees_it_without_any_lock(job, serve):
    """A slot has no lock a learner could die holding: the server alone changes its owner."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1")
    victim = spawn("holder.py", job, "--idle")
    assert read_line(victim) == "ready"
    kill(victim)
    wait_until(lambda: job_status(job)["reclaimed_slots"] == 1, what="the slot to be reclaimed")
    with learner.attach(flat(), job=job) as ps:  # the only slot is free again
        ps.step()
        ps.flush()
    assert arena_header(job)["lock_recoveries"] == 0


def test_learner_killed_holding_the_admission_mutex(job, serve):
    """Claims never take the admission mutex (only spec offers do): a learner that dies holding it, or a
    live one that holds it for good, delays no attach."""
    serve(job, "--no-watchdog", "--learners", "3", "--lr", "1")
    victim = spawn("holder.py", job, "--hold", "admission")
    assert read_line(victim) == "ready"
    t0 = time.monotonic()
    with learner.attach(flat(), job=job, timeout=20) as ps:  # while it holds the mutex
        ps.step()
    assert time.monotonic() - t0 < 2
    kill(victim)
    with learner.attach(flat(), job=job, timeout=20) as ps:  # after it died holding it
        ps.step()
        ps.flush()
    assert arena_header(job)["lock_recoveries"] == 0


def test_learner_killed_waiting_on_a_condition_variable(job, serve):
    # --overlap on: the victim's steps return before the (paused) loop applied them, so its ring fills
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1", "--ring-depth", "4", "--overlap", "on")
    me = os.getpid()
    with learner.attach(flat(), job=job) as other:
        a = open_job(job)
        a.remap()
        a.pause(me, _native.proc_start_time(me), 5.0)  # the ring cannot drain: the victim will wait
        try:
            victim = spawn("holder.py", job, "--fill-ring")
            assert read_line(victim) == "ready"

            def waiting_slot() -> list[int]:
                return [i for i in range(2) if a.slot_info(i)["waiters"] == 1]

            (slot,) = wait_until(waiting_slot, what="the victim to wait on its ring's condition variable")
            assert a.slot_info(slot)["tail"] - a.slot_info(slot)["head"] == 4
            kill(victim)
        finally:
            a.resume()
        # The loop now signals a condition variable whose only waiter is dead: it must not hang.
        for _ in range(20):
            other.model.w.grad = torch.ones_like(other.model.w)
            other.step()
        other.flush(timeout=10)
        wait_until(lambda: job_status(job)["reclaimed_slots"] == 1, what="the victim's slot to be reclaimed")
        st = job_status(job)
        assert st["pushed"] == st["applied"] == 24  # the victim's 4 fully pushed gradients included
        a.close()


def test_server_killed_while_sleeping_on_the_doorbell(job, serve):
    """An idle server sleeps on a condition variable; learners that ring it after it died must not hang."""
    serve(job, "--learners", "1", "--lr", "1")
    with learner.attach(flat(), job=job) as ps:
        wait_until(lambda: arena_header(job)["sleeping"] == 1, what="the server to go to sleep")
        old = arena_header(job)
        os.kill(old["server_pid"], signal.SIGKILL)
        for _ in range(10):  # each push sees `sleeping` left set by the dead server, and rings
            ps.model.w.grad = torch.ones_like(ps.model.w)
            ps.step()
        ps.flush(timeout=30)  # the watchdog's new server applies them
    assert arena_header(job)["generation"] == old["generation"] + 1
    assert learner.pull_state_dict(job)["w"][0] == -10.0
