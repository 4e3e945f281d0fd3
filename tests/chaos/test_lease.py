"""Liveness without /proc: a learner whose pid the server cannot check (another PID namespace, /proc
hidden, or --liveness lease) keeps its slot while its lease is renewed, even idle; once it is
SIGKILLed its slot is taken back after the lease; and an entry pushed under a claim token that is not
the slot's current claim is never applied, only counted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import HELPERS, arena_header, child_env, read_line, wait_until
from psd import _native, learner
from psd.arena import open_job

LEASE = 1.0


def _unshare_prefix() -> list[str]:
    """A command prefix that runs the learner in a PID namespace of its own (with its own /proc)."""
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here to start a learner in another PID namespace")
    r = subprocess.run([*cmd, "true"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here (needs root or user namespaces): {r.stderr.strip()}")
    return cmd


def _slot(job: str, i: int) -> dict:
    a = open_job(job, role="reader")
    try:
        a.remap()
        return a.slot_info(i)
    finally:
        a.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["proc", "liveness-lease", "pid-namespace"])
def test_an_idle_learner_keeps_its_slot_and_a_killed_one_loses_it(job, serve, how):
    prefix = _unshare_prefix() if how == "pid-namespace" else []
    flags = ["--liveness", "lease"] if how == "liveness-lease" else []
    serve(job, "--learners", "2", "--lr", "1", "--lease", str(LEASE), "--no-watchdog", *flags)
    proc = subprocess.Popen([*prefix, sys.executable, str(HELPERS / "idler.py"), job], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        line = read_line(proc)
        assert line.startswith("ready slot "), line
        slot = int(line.split()[-1])
        by = _native.LIVE_BY_PROC if how == "proc" else _native.LIVE_BY_LEASE
        wait_until(lambda: _slot(job, slot)["liveness"] == by, what="the reaper's judgement")
        # Idle for 2.5 leases (not a synchronisation: nothing may happen meanwhile): the slot stays its own.
        end = time.monotonic() + 2.5 * LEASE
        while time.monotonic() < end:
            assert _slot(job, slot)["state"] == _native.SLOT_ACTIVE, "a live learner's slot was taken back"
            time.sleep(0.05)
        proc.stdin.write("push\n")
        proc.stdin.flush()
        assert read_line(proc) == "pushed 2"  # its slot is still its own: it pushes on
        wait_until(lambda: arena_header(job)["applied"] == 2, what="both gradients applied")
        t0 = time.monotonic()
        proc.kill()  # unshare --kill-child takes the learner in the namespace along
        proc.wait(timeout=30)
        wait_until(lambda: _slot(job, slot)["state"] == _native.SLOT_FREE, timeout=10 * LEASE,
                   what="the killed learner's slot freed")
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    h = arena_header(job)
    assert h["reclaimed"] == 1 and h["applied"] == 2
    if how != "proc":  # /proc could not tell: the lease had to run out (its last renewal came < 0.1 s before)
        assert took >= 0.8 * LEASE, f"freed after {took:.2f} s, before the {LEASE} s lease ran out"


@pytest.mark.timeout(120)
def test_a_stall_of_the_whole_machine_takes_no_live_learners_slot(job, serve):
    """The whole machine stalls for 3 leases (a paused VM, heavy swapping): watchdog, server and a learner known
    only by its lease (--liveness lease) all stop running, and wake one after the other, the learner 0.3 s after
    its server (and stopped 0.3 s before it). Its beat stood still only because nothing ran: the reaper starts
    every lease over after a gap in its own runs (it took the live learner's slot, which then failed at its next
    push)."""
    serve(job, "--learners", "2", "--lr", "1", "--lease", str(LEASE), "--liveness", "lease")
    proc = subprocess.Popen([sys.executable, str(HELPERS / "idler.py"), job], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        line = read_line(proc)
        assert line.startswith("ready slot "), line
        slot = int(line.split()[-1])
        wait_until(lambda: _slot(job, slot)["liveness"] == _native.LIVE_BY_LEASE, what="the reaper's judgement")
        h = arena_header(job)
        stalled = [h["watchdog_pid"], h["server_pid"], proc.pid]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            # The stall's start, staggered: the learner stops 0.3 s before its server, whose reaper (every 0.1 s)
            # so sees its last beat before the stall; had it not, the beat moving since its last look would
            # start the lease over at the wake, and the old reaper too would keep the slot.
            time.sleep(0.3)
            for pid in stalled[:2]:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(3 * LEASE)  # the stall itself, not synchronisation
            for pid in stalled[:2]:
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.3)  # the learner wakes later than its server (the stall's end, staggered)
        finally:
            for pid in stalled:
                os.kill(pid, signal.SIGCONT)
        wait_until(lambda: 0 <= arena_header(job)["heartbeat_age_s"] < 0.5, what="the server to beat again")
        # Two leases more, its lease thread renewing it: the slot is still the learner's, and it pushes on.
        end = time.monotonic() + 2 * LEASE
        while time.monotonic() < end:
            assert _slot(job, slot)["state"] == _native.SLOT_ACTIVE, "the live learner's slot was taken back"
            time.sleep(0.05)
        proc.stdin.write("push\n")
        proc.stdin.flush()
        assert read_line(proc) == "pushed 2"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert arena_header(job)["reclaimed"] == 0


@pytest.mark.timeout(120)
def test_an_entry_under_a_stale_claim_token_is_ignored_and_counted(job, serve):
    serve(job, "--learners", "1", "--lr", "1", "--no-watchdog")
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    ps = learner.attach(model, job=job, timeout=30)
    model.weight.grad = torch.ones(1, 4)
    ps.step()
    ps.flush()
    # What a learner whose slot was taken back and handed on would leave if its push raced the hand-over:
    # a whole entry, published at the tail, that carries the old claim's token.
    a = open_job(job)
    h = a.header()
    tail = a.tail(ps.slot)
    entry = a.grad_offset(ps.slot, tail % h["ring_k"]) - 64
    view = np.frombuffer(a, dtype=np.uint8)
    view[entry:entry + 64].view(np.uint64)[0] = tail  # seq: a well-formed entry
    view[entry + _native.ENTRY_CLAIM_OFFSET:][:8].view(np.uint64)[0] = ps._claim_token - 1
    view[entry + 64:][:16].view(np.float32)[:] = 100.0  # a gradient that must never land
    slot_tail = h["slots_off"] + ps.slot * h["slot_stride"] + _native.SLOT_TAIL_OFFSET
    view[slot_tail:slot_tail + 8].view(np.uint64)[0] = tail + 1
    del view
    wait_until(lambda: a.counters()["ignored"] == 1, what="the stale entry consumed")
    c = a.counters()
    assert c["applied"] == 1 and c["pending"] == 0
    assert c["pushed"] == c["applied"] + c["rejected"] + c["dropped"] + c["ignored"]
    assert a.slot_info(ps.slot)["ignored"] == 1
    a.close()
    assert torch.equal(learner.pull_state_dict(job)["weight"], torch.full((1, 4), -1.0))
    st = json.loads(subprocess.run([sys.executable, "-m", "psd.cli", "status", "--job", job, "--json"],
                                   capture_output=True, text=True, env=child_env(), timeout=60).stdout)
    assert st["ignored"] == 1 and st["learners"][0]["ignored"] == 1
    ps.close()
