"""Least privilege: a learner maps the arena read-only except its own slot (with its ring), the header's
shared page and, while it offers a spec, its offer window; `psd status` and other readers map it all
read-only. A stray write anywhere else kills the writer with SIGSEGV, and the job goes on untouched.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from conftest import HELPERS, arena_header, child_env, read_line
from psd import learner


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["weights", "header", "other_slot", "own_record", "reader", "view_param"])
def test_a_stray_write_kills_the_writer_and_the_job_goes_on(job, serve, target):
    served = serve(job, "--learners", "2", "--lr", "1", "--no-watchdog")
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    honest = learner.attach(model, job=job, timeout=30)  # also brings the job to READY for the reader
    proc = subprocess.Popen([sys.executable, str(HELPERS / "stray_write.py"), job, target],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        assert read_line(proc) == "own ok"  # where it may write, it wrote
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGSEGV, f"exit {proc.returncode}, stdout {out!r}:\n{err}"
    for _ in range(3):  # the job goes on
        model.weight.grad = torch.ones(1, 4)
        honest.step()
    honest.flush()
    pushed_by_writer = 0 if target == "reader" else 1
    c = honest._arena.counters()
    assert c["applied"] == 3 + pushed_by_writer and c["pending"] == 0
    assert torch.equal(learner.pull_state_dict(job)["weight"], torch.full((1, 4), -3.0 - pushed_by_writer))
    assert arena_header(job)["evicted"] == 0
    honest.close()
    served.stop()
