"""A clean stop is bounded: it drains what it can for DRAIN_TIMEOUT seconds, then stops anyway and says
what it left, per learner."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from conftest import Served, arena_header, wait_until
from psd import _native, learner
from psd.arena import open_job, shm_path

K = 8  # ring depth


@pytest.mark.timeout(120)
def test_sigterm_with_a_backlog_that_cannot_drain_stops_and_reports_it(job, tmp_path):
    """An Adam learner of a 2^20-parameter model fills most of its ring while the update loop is held paused
    (the slowest loop there is), and another learner's tail is pushed far ahead (a stray write). SIGTERM to
    `psd serve` still ends it, cleanly, and the log and the event log say what each learner left unapplied."""
    events = tmp_path / "events.jsonl"
    # --overlap on: a step returns before the (paused) loop applied its push, so the backlog can build up
    s = Served(job, "--learners", "2", "--ring-depth", str(K), "--optimizer", "adam", "--threads", "1",
               "--overlap", "on", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "0",
               "--event-log", str(events))
    big = torch.nn.Linear(1 << 10, 1 << 10, bias=False)
    honest = learner.attach(big, job=job, timeout=30)
    rogue_model = torch.nn.Linear(1 << 10, 1 << 10, bias=False)
    rogue = learner.attach(rogue_model, job=job, timeout=30)
    holder = open_job(job)
    me = os.getpid()
    holder.pause(me, _native.proc_start_time(me), 10.0)  # held until we resume: nothing more is applied
    try:
        for _ in range(K - 1):  # K - 1: a full ring would block this process in step()
            big.weight.grad = torch.ones_like(big.weight)
            honest.step()
        h = arena_header(job)
        wait_until(lambda: holder.slot_info(honest.slot)["tail"] - holder.slot_info(honest.slot)["head"] == K - 1,
                   what="the honest learner's entries to be pending")
        view = np.frombuffer(holder, dtype=np.uint8)
        tail = h["slots_off"] + rogue.slot * h["slot_stride"] + _native.SLOT_TAIL_OFFSET
        view[tail:tail + 8].view(np.uint64)[0] = rogue._tail + (1 << 40)
        del view
        s.proc.send_signal(signal.SIGTERM)
        out, _ = s.proc.communicate(timeout=60)
    finally:
        holder.resume()
        holder.close()
        honest.close(flush=False)
        rogue.close(flush=False)
    assert s.proc.returncode == 0, out
    assert not os.path.exists(shm_path(job))
    report = next((line for line in out.splitlines() if "not applied" in line), out)
    assert f"learner pid {me} (slot {honest.slot}, rank {honest.rank}): {K - 1}," in report, report
    assert f"learner pid {me} (slot {rogue.slot}, rank {rogue.rank}): its ring's tail ran ahead" in report, report
    stopped = [json.loads(line) for line in events.read_text().splitlines() if '"server_stopped"' in line][-1]
    left = {x["slot"]: x["pending"] for x in stopped["unapplied"]}
    assert left == {honest.slot: K - 1, rogue.slot: None}, stopped["unapplied"]
