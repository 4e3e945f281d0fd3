"""A clean stop is bounded: it drains what it can for DRAIN_TIMEOUT seconds, then stops anyway and says
what it left, per learner."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from conftest import Served, arena_header, read_line, spawn, wait_until
from psd import _native
from psd.arena import open_job


@pytest.mark.timeout(120)
def test_sigterm_with_a_backlog_that_cannot_drain_stops_and_reports_it(job, tmp_path):
    """Two Adam learners of a 2^20-parameter model fill their rings while the update loop is held paused (the
    slowest loop there is), and one ring's tail is then pushed far ahead (a stray write). SIGTERM to `psd serve`
    still ends it, cleanly, and the log and the event log name what each learner left unapplied."""
    events = tmp_path / "events.jsonl"
    s = Served(job, "--learners", "2", "--ring-depth", "8", "--optimizer", "adam", "--threads", "1",
               "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "0", "--event-log", str(events))
    procs = [spawn("pusher.py", job, "--n", str(1 << 20), "--index", str(r), "--forever") for r in range(2)]
    holder = None
    try:
        for p in procs:
            assert read_line(p, timeout=60) == "ready"
        holder = open_job(job)
        me = os.getpid()
        holder.pause(me, _native.proc_start_time(me), 10.0)  # held until we resume: nothing more is applied
        h = arena_header(job)
        full = lambda: all(holder.slot_info(i)["tail"] - holder.slot_info(i)["head"] == 8 for i in range(2))  # noqa: E731
        wait_until(full, timeout=60, what="both rings to fill")
        rogue, honest = holder.slot_info(1), holder.slot_info(0)
        view = np.frombuffer(holder, dtype=np.uint8)
        tail = h["slots_off"] + h["slot_stride"] + _native.SLOT_TAIL_OFFSET
        view[tail:tail + 8].view(np.uint64)[0] = rogue["tail"] + (1 << 40)
        del view
        s.proc.send_signal(signal.SIGTERM)
        out, _ = s.proc.communicate(timeout=60)
    finally:
        if holder is not None:
            holder.resume()
            holder.close()
        for p in procs:
            p.kill()
            p.wait()
    assert s.proc.returncode == 0, out
    assert not os.path.exists(f"/dev/shm/psd.{job}")
    report = next(line for line in out.splitlines() if "not applied" in line)
    assert f"learner pid {honest['pid']} (slot 0, rank {honest['rank']}): 8," in report, report
    assert f"learner pid {rogue['pid']} (slot 1, rank {rogue['rank']}): its ring's tail ran ahead" in report
    stopped = [json.loads(line) for line in events.read_text().splitlines() if '"server_stopped"' in line][-1]
    left = {x["slot"]: x["pending"] for x in stopped["unapplied"]}
    assert left == {0: 8, 1: None}, stopped["unapplied"]
