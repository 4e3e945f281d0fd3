"""A learner that writes garbage into its own slot cannot break the job.

A stray write (a buggy C extension, a bit flip) into the fields of a learner's slot that the update loop
reads: a rank out of range (this crashed every server that took over the arena), a tail far ahead of the
head (the loop re-applied stale entries millions of times a second), an entry whose sequence number is
not its index. Each time the server evicts the rogue, keeps running, and applies every gradient of an
honest learner exactly once; the counters stay exact; SIGTERM still ends the server promptly.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from conftest import arena_header, wait_until
from psd import _native, learner
from psd.arena import open_job
from psd.errors import Error


def poke(job: str, offset: int, value: int, dtype) -> None:
    """Write `value` at byte `offset` of `job`'s arena, as a stray write would."""
    a = open_job(job)
    view = np.frombuffer(a, dtype=np.uint8)
    view[offset:offset + np.dtype(dtype).itemsize].view(dtype)[0] = value
    del view
    a.close()


@pytest.mark.parametrize("fault", ["rank", "tail", "seq"])
def test_a_rogue_write_evicts_the_learner_and_the_job_goes_on(job, serve, fault):
    served = serve(job, "--learners", "2", "--lr", "1")
    honest_model, rogue_model = torch.nn.Linear(4, 1, bias=False), torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        honest_model.weight.zero_()
    honest = learner.attach(honest_model, job=job, timeout=10)
    rogue = learner.attach(rogue_model, job=job, timeout=10)
    rogue_pid = os.getpid()  # both learners live in this process
    for _ in range(3):  # both train honestly first
        for m, ps in ((honest_model, honest), (rogue_model, rogue)):
            m.weight.grad = torch.ones(1, 4)
            ps.step()
    honest.flush()
    rogue.flush()
    h = arena_header(job)
    slot = h["slots_off"] + rogue.slot * h["slot_stride"]
    if fault == "rank":
        poke(job, slot + _native.SLOT_RANK_OFFSET, 1_000_000, np.int32)
    elif fault == "tail":
        poke(job, slot + _native.SLOT_TAIL_OFFSET, rogue._tail + (1 << 40), np.uint64)
    else:  # an entry published with a sequence number that is not its index
        entry = rogue._arena.grad_offset(rogue.slot, rogue._tail % h["ring_k"]) - 64
        poke(job, entry + _native.ENTRY_SEQ_OFFSET, 999, np.uint64)
        poke(job, slot + _native.SLOT_TAIL_OFFSET, rogue._tail + 1, np.uint64)
    wait_until(lambda: arena_header(job)["evicted"] == 1, timeout=10, what="the rogue's eviction")
    # The honest learner goes on; each of its gradients is applied exactly once.
    for _ in range(5):
        honest_model.weight.grad = torch.ones(1, 4)
        honest.step()
    honest.flush()
    c = honest._arena.counters()
    h = arena_header(job)
    assert h["evicted"] == 1 and h["evicted_pid"] == rogue_pid
    rogue_model.weight.grad = torch.ones(1, 4)
    with pytest.raises(Error, match=r"taken back"):  # the rogue's next push finds its slot gone
        rogue.step()
    rogue.close(flush=False)
    assert c["pushed"] == c["applied"] + c["rejected"] + c["dropped"] and c["pending"] == 0
    assert c["applied"] == 11  # the honest learner's 8 and the rogue's 3 valid gradients, each once
    assert torch.equal(learner.pull_state_dict(job)["weight"], torch.full((1, 4), -11.0))
    honest.close()
    t0 = time.monotonic()
    out = served.stop()
    assert time.monotonic() - t0 < 10, out

