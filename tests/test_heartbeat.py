"""The update loop's heartbeat tracks its work, not its passes.

One pass of the loop takes one entry from every ring; with a large model, Adam and a full ring per
learner, a pass lasts far longer than the watchdog's heartbeat timeout. The loop beats from inside each
update (psd_beat, every few milliseconds), so a healthy server is never taken for a hung one, and a
pause for a checkpoint still waits for the end of an update: the snapshot is never torn.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from conftest import wait_until
from psd import _native, learner
from psd.arena import open_job
from psd.watchdog.checkpoint import snapshot

ROWS, COLS = 3000, 4000  # 1.2e7 float32: one Adam step on one thread takes tens of milliseconds
FILLED, DEPTH = 4, 4  # rings filled while the loop is paused: 16 updates, passes of 4


def adam_reference(steps: int, lr: float) -> float:
    """What torch.optim.Adam makes of a zero weight after `steps` gradients of 1."""
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w], lr=lr)
    for _ in range(steps):
        w.grad = torch.ones(1)
        opt.step()
    return w.item()


def test_a_long_pass_keeps_beating_and_a_checkpoint_in_it_is_whole(job, serve):
    lr = 1e-3
    serve(job, "--learners", str(FILLED + 1), "--ring-depth", str(DEPTH), "--optimizer", "adam", "--lr", str(lr),
          "--threads", "1", "--heartbeat-timeout", "1", "--checkpoint-every", "0")
    model = torch.nn.Linear(COLS, ROWS, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    ps = learner.attach(model, job=job, timeout=30)  # brings the model; its own slot stays empty
    a = open_job(job)
    a.remap()
    h0 = a.header()
    me, start = os.getpid(), _native.proc_start_time(os.getpid())
    n = ROWS * COLS
    view = np.frombuffer(a, dtype=np.uint8)
    a.pause(me, start, 10.0)  # fill every ring before the loop may take anything
    try:
        slots = [a.assign(me, start)[0] for _ in range(FILLED)]
        for slot in slots:
            for k in range(DEPTH):
                off = a.grad_offset(slot, k)
                view[off:off + 4 * n].view(np.float32)[:] = 1.0
                a.push(slot, 0, 1, 0.0)
    finally:
        a.resume()
    ages, done = [], threading.Event()

    def watch() -> None:  # the heartbeat's age as the watchdog sees it, while gradients are pending
        while not done.is_set():
            age = a.header()["heartbeat_age_s"]
            if a.counters()["pending"]:
                ages.append(age)
            done.wait(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        wait_until(lambda: a.clock() >= 2, timeout=30, what="the first updates")
        ckpt = snapshot(a, job, pause_timeout=10.0)  # in the middle of the drain
        wait_until(lambda: a.counters()["pending"] == 0, timeout=60, what="the rings to drain")
    finally:
        done.set()
        watcher.join()
    total = FILLED * DEPTH
    assert 0 < ckpt.clock < total, f"the checkpoint was taken at clock {ckpt.clock}, not during the drain"
    w = ckpt.weights["weight"]
    assert w.min() == w.max(), "torn checkpoint: some weights hold one more update than others"
    assert torch.allclose(w[0, 0], torch.tensor(adam_reference(ckpt.clock, lr)), rtol=1e-5, atol=0)
    assert ages and max(ages) < 0.2, f"the heartbeat aged {max(ages):.3f} s during the drain"
    h = a.header()
    assert (h["server_pid"], h["generation"], h["server_restarts"]) == (h0["server_pid"], h0["generation"], 0)
    assert a.counters()["applied"] == total
    del view
    for slot, claim in ((s, a.slot_info(s)["claims"]) for s in slots):
        a.release(slot, claim)
    a.close()
    ps.close()
