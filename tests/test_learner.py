"""The learner client in this process: attach, step, pull, detach, reattach.

The servers run without a watchdog: nothing here needs one, and its last checkpoint costs seconds at each stop.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from conftest import wait_until
from psd import _native, learner
from psd.arena import open_job
from psd.learner.pull import ThreadPull
from psd.status import job_status


class Flat(torch.nn.Module):
    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))
        self.b = torch.nn.Parameter(torch.zeros(3))


def test_first_learner_brings_the_model_and_later_ones_get_its_weights(job, serve):
    serve(job, "--no-watchdog", "--learners", "2")
    a = Flat()
    with torch.no_grad():
        a.w.copy_(torch.arange(64.0))
    with learner.attach(a, job=job):
        b = Flat()  # zeros; must be replaced by the job's weights on attach
        with learner.attach(b, job=job):
            assert torch.equal(b.w.detach(), torch.arange(64.0))
    assert torch.equal(learner.pull_state_dict(job)["w"], torch.arange(64.0))


@pytest.mark.timeout(60)
def test_a_restarted_learner_waits_for_its_last_lifes_slot(job, serve):
    """psd run restarts a killed learner at once, and its next life may ask for a slot before the server has
    freed its last one (here a lease of 2 s decides: --liveness lease). With the job's slots all held, it waits
    for the slot of its rank (it failed at once with NoFreeSlot, slot_timeout being 0), up to its timeout."""
    import subprocess
    import sys
    import time

    from conftest import HELPERS, child_env, read_line

    serve(job, "--no-watchdog", "--learners", "1", "--liveness", "lease", "--lease", "2")
    first = subprocess.Popen([sys.executable, str(HELPERS / "honest.py"), job, "0", str(10**9)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env())
    try:
        assert read_line(first, 60) == "ready"
    finally:
        first.kill()
        first.wait()
    a = open_job(job, role="reader")
    assert a.slot_info(0)["state"] == _native.SLOT_ACTIVE and a.slot_info(0)["rank"] == 0  # held by the dead one
    t0 = time.monotonic()
    model = torch.nn.Linear(8, 2, bias=False)
    with learner.attach(model, job=job, rank=0, timeout=30) as ps:
        waited = time.monotonic() - t0
        assert ps.slot == 0 and a.slot_info(0)["pid"] == os.getpid()
        model.weight.grad = torch.ones(2, 8)
        ps.step()
    a.close()
    assert waited > 0.5, f"the slot was free after {waited:.2f} s: the test checks less than it says"


def test_attach_detach_reattach(job, serve):
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1")
    m = Flat()
    for round_ in range(3):
        with learner.attach(m, job=job) as ps:
            for _ in range(10):
                m.w.grad = torch.zeros_like(m.w)
                m.w.grad[1] = 1.0
                ps.step()
        # Detaching frees the only slot, so the next round can claim it.
        wait_until(lambda: not job_status(job)["learners"], what="the slot to be freed")
        assert learner.pull_state_dict(job)["w"][1] == -10.0 * (round_ + 1)
        assert m.w.grad is None  # no tensor of ours points into the arena any more
    st = job_status(job)
    assert st["pushed"] == st["applied"] == 30


def test_gradients_from_autograd_are_pushed_exactly(job, serve):
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.5")
    m = Flat()
    c = torch.linspace(-1, 1, 64)
    with learner.attach(m, job=job) as ps:
        (m.w * c).sum().backward()
        ps.step(loss=1.5, batch_size=4)
        ps.flush()
    assert torch.allclose(learner.pull_state_dict(job)["w"], -0.5 * c)


def test_user_zero_grad_is_harmless(job, serve):
    """Scripts that still call zero_grad() (set_to_none) push the right gradient, through a copy."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1")
    m = Flat()
    opt_like = torch.optim.SGD(m.parameters(), lr=0.1)
    with learner.attach(m, job=job) as ps:
        for _ in range(3):
            opt_like.zero_grad()
            (m.w * 2.0).sum().backward()
            ps.step()
        ps.flush()
    assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((64,), -6.0))


@pytest.mark.parametrize("pull", ["inline", "thread"])
def test_steps_swap_in_weights_pushed_by_others(job, serve, monkeypatch, pull):
    """Inline (a small model, or no core for a thread) and by the pull thread (a model over
    INLINE_PULL_BYTES in a job with --overlap on, where the job leaves the thread a core: asked for here, on
    2 cores it never is)."""
    from psd.learner import client

    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1", *["--overlap", "on"] * (pull == "thread"))
    monkeypatch.setattr(client, "pull_thread_has_a_core", lambda *_: pull == "thread")
    n = 64 if pull == "inline" else client.INLINE_PULL_BYTES // 4 + 1
    a, b = Flat(n), Flat(n)
    with learner.attach(a, job=job) as pa, learner.attach(b, job=job) as pb:
        assert isinstance(pb._pull, ThreadPull) == (pull == "thread") and (pb._stepper is None) == (pull == "thread")
        for _ in range(5):
            a.w.grad = torch.zeros_like(a.w)
            a.w.grad[7] = 1.0
            pa.step()
        pa.flush()

        def b_sees_them():
            pb.step()  # no gradient: pushes nothing, but takes newer weights (the pull thread hands over)
            return b.w[7].item() == -5.0

        wait_until(b_sees_them, what="learner b to swap in a's updates")
        assert pb.clock >= 5
        assert pb.pull() >= 5 and b.w[7].item() == -5.0


@pytest.mark.parametrize("pull", ["inline", "thread"])
def test_pulls_leave_the_frozen_weights_in_place(job, serve, monkeypatch, pull):
    """Pulls copy the trainable weights alone (nothing moves the frozen ones while the job runs): the
    frozen weights a learner got when it attached stay right through pulls and buffer swaps (the pull
    thread's two buffers both hold them); a local write to one is not undone by a step's pull, only by
    an explicit pull(), which copies everything."""
    from psd.learner import client

    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1", *["--overlap", "on"] * (pull == "thread"))
    monkeypatch.setattr(client, "pull_thread_has_a_core", lambda *_: pull == "thread")
    n = 64 if pull == "inline" else client.INLINE_PULL_BYTES // 4 + 1

    def model() -> torch.nn.Module:
        m = Flat(n)
        m.frozen = torch.nn.Parameter(torch.arange(5.0) + 1, requires_grad=False)
        return m

    a, b = model(), model()
    with learner.attach(a, job=job) as pa, learner.attach(b, job=job) as pb:
        assert isinstance(pb._pull, ThreadPull) == (pull == "thread")
        for i in range(1, 6):
            a.w.grad = torch.zeros_like(a.w)
            a.w.grad[7] = 1.0
            pa.step()
            pa.flush()

            def b_sees_it(i=i):
                b.w.grad = torch.zeros_like(b.w)
                pb.step()  # lets the pull thread hand over (each swap brings the other buffer in)
                return b.w[7].item() == -i

            wait_until(b_sees_it, what=f"learner b to swap in a's update {i}")
            assert torch.equal(b.frozen, torch.arange(5.0) + 1) and torch.equal(a.frozen, torch.arange(5.0) + 1)
        b.frozen.data[0] = 99.0  # a local write: not the job's, and no pull copies the frozen weights
        a.w.grad = torch.zeros_like(a.w)
        a.w.grad[7] = 1.0
        pa.step()
        pa.flush()

        def b_sees_the_last():
            b.w.grad = torch.zeros_like(b.w)
            pb.step()
            return b.w[7].item() == -6.0

        wait_until(b_sees_the_last, what="learner b to swap in a's last update")
        assert b.frozen[0].item() == 99.0  # the frozen weights are not swapped with the pull thread's buffers
        assert pb.pull() >= 6 and torch.equal(b.frozen, torch.arange(5.0) + 1)
    assert torch.equal(learner.pull_state_dict(job)["frozen"], torch.arange(5.0) + 1)


def test_detached_learner_refuses_to_step(job, serve):
    serve(job, "--no-watchdog", "--learners", "1")
    m = Flat()
    ps = learner.attach(m, job=job)
    ps.close()
    with pytest.raises(learner.client.Error, match="detached"):
        ps.step()


def test_gradients_of_every_kind_are_pushed_and_reset(job, serve):
    """Sparse, non-contiguous and missing gradients reach the server as the dense gradient; a
    gradient left from before attaching is dropped; after step() every p.grad is None."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1")
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(5, 2, sparse=True)
    m.mat = torch.nn.Parameter(torch.zeros(3, 4))
    m.unused = torch.nn.Parameter(torch.zeros(2))
    torch.nn.init.zeros_(m.emb.weight)
    m.mat.grad = torch.ones(3, 4)  # from before attaching: not pushed
    with learner.attach(m, job=job) as ps:
        assert all(p.grad is None for p in m.parameters())
        m.emb(torch.tensor([1, 3, 3])).sum().backward()
        assert m.emb.weight.grad.is_sparse
        m.mat.grad = torch.arange(12.0).reshape(4, 3).t()  # non-contiguous
        ps.step()
        assert all(p.grad is None for p in m.parameters())
        ps.flush()
    w = learner.pull_state_dict(job)
    expected_emb = torch.zeros(5, 2)
    expected_emb[1], expected_emb[3] = -1.0, -2.0
    assert torch.equal(w["emb.weight"], expected_emb)
    assert torch.equal(w["mat"], -torch.arange(12.0).reshape(4, 3).t())
    assert torch.equal(w["unused"], torch.zeros(2))


def test_push_from_refuses_lengths_that_are_not_the_model(job, serve):
    serve(job, "--no-watchdog", "--learners", "1")
    with learner.attach(Flat(), job=job) as ps:
        a = ps._arena
        for lens in ([2**64 - 1, 68], [63], [65], [2**64 - 1], [64, 3, 1], [0] * 68):
            with pytest.raises(ValueError):
                a.push_from(ps.slot, 0, 1, 0.0, 1.0, [0] * len(lens), lens)
        assert a.tail(ps.slot) == 0  # nothing was published


def test_a_view_learner_computes_on_the_shared_weights_without_pulling(job, serve):
    """pull="view": the parameters are the job's weights, so what another learner's gradients did is
    in the model without a step or a pull of this one, and nothing is ever copied (no pulls counted)."""
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1")
    a, b = Flat(), Flat()
    with learner.attach(a, job=job) as pa, learner.attach(b, job=job, pull="view") as pb:
        assert pb.pull_mode == "view" and pa.pull_mode == "copy"
        for _ in range(5):
            a.w.grad = torch.zeros_like(a.w)
            a.w.grad[7] = 1.0
            pa.step()
        pa.flush()
        assert b.w[7].item() == -5.0  # no step, no pull by b
        b.w.grad = torch.zeros_like(b.w)
        b.w.grad[3] = 2.0
        pb.step()
        assert pb.clock >= 5  # the gradient was computed on weights at least that new
        pb.flush()
        assert b.w[3].item() == -2.0
        assert pb._arena.slot_info(pb.slot)["pulls"] == 0
        assert pb.pull() == pb.clock >= 6
    assert torch.equal(learner.pull_state_dict(job)["w"][[3, 7]], torch.tensor([-2.0, -5.0]))
    # Detached, the model keeps the last weights in memory of its own.
    assert b.w[7].item() == -5.0 and b.w[3].item() == -2.0
    with torch.no_grad():
        b.w.add_(1.0)  # writable again: no longer the read-only shared pages


def test_pull_modes_refuse_what_they_cannot_do(job, serve, monkeypatch):
    serve(job, "--no-watchdog", "--learners", "1", "--predict", "--optimizer", "momentum")
    with pytest.raises(learner.client.Error, match="is not a pull mode"):
        learner.attach(Flat(), job=job, pull="mmap")
    monkeypatch.setenv("PSD_PULL", "zero")
    with pytest.raises(learner.client.Error, match="PSD_PULL='zero'"):
        learner.attach(Flat(), job=job)
    monkeypatch.setenv("PSD_PULL", "view")
    with pytest.raises(learner.client.SpecError, match="float32 model on the CPU"):
        learner.attach(Flat().to(torch.bfloat16), job=job)
    with pytest.raises(learner.client.SpecError, match="--predict"):
        learner.attach(Flat(), job=job)  # refused before it claims the only slot:
    with learner.attach(Flat(), job=job, pull="copy") as ps:
        assert ps.pull_mode == "copy" and ps.slot == 0


@pytest.mark.parametrize("pull", ["copy", "view"])
def test_the_native_step_takes_plain_gradients_and_hands_the_others_to_the_general_path(job, serve, pull,
                                                                                       monkeypatch):
    """A float32 asp learner steps in one native call; a gradient it does not take as it is (not
    contiguous, sparse) sends that step down the general path, with the same result; a full
    ring (depth 2) waits in Python; every p.grad is None after each step either way. (--overlap: a
    step returns before the server applied its push, so that the paused loop below lets the ring fill.)"""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1", "--ring-depth", "2", "--overlap", "on")
    m = torch.nn.Module()
    m.mat = torch.nn.Parameter(torch.zeros(3, 4))
    m.vec = torch.nn.Parameter(torch.zeros(5))
    with learner.attach(m, job=job, pull=pull) as ps:
        assert ps._stepper is not None
        general = []
        take = ps._take_gradients
        monkeypatch.setattr(ps, "_take_gradients", lambda gs: (general.append(1), take(gs))[1])
        for i in range(40):
            if i % 3 == 0:
                m.mat.grad = torch.ones(4, 3).t()  # not contiguous: the general path
            elif i % 3 == 1:
                m.mat.grad = torch.ones(3, 4)
                m.vec.grad = torch.ones(5).to_sparse()  # another layout: the general path
            else:
                m.mat.grad = torch.ones(3, 4)  # plain, and vec has no gradient: the native step
            ps.step()
            assert m.mat.grad is None and m.vec.grad is None
        assert ps.push_ns > 0
        assert len(general) == 27  # the steps with a non-contiguous or sparse gradient; 13 were native
        ps.flush()
        # A native push that fills the ring: the step waits in Python until the paused loop goes on.
        holder = open_job(job)
        me = os.getpid()
        holder.pause(me, _native.proc_start_time(me), 10.0)
        m.mat.grad = torch.ones(3, 4)
        ps.step()  # one entry of two
        resumer = threading.Thread(target=lambda: (
            wait_until(lambda: ps._arena.slot_info(ps.slot)["full_waits"] > 0, what="the learner to wait"),
            holder.resume()))
        resumer.start()
        m.mat.grad = torch.ones(3, 4)
        ps.step()  # fills the ring: returns once the loop took an entry
        resumer.join()
        holder.close()
        ps.flush()
        assert ps.pull() == 42
        assert torch.equal(m.mat.detach(), torch.full((3, 4), -42.0))
        assert torch.equal(m.vec.detach(), torch.full((5,), -13.0))
    st = job_status(job)
    assert st["pushed"] == st["applied"] == 42


def _step_with_the_loop_paused(ps, m: Flat, holder: _native.Arena, past_s: float) -> None:
    """One step of ``ps`` (gradient all ones) while ``holder`` pauses the update loop: the step must still be
    waiting for its own update ``past_s`` seconds on (the clock unchanged); resumed from here, it returns."""
    import time

    me, before = os.getpid(), ps.clock
    holder.pause(me, _native.proc_start_time(me), 10.0)
    t0 = time.monotonic()
    m.w.grad = torch.ones(64)
    stepped = threading.Thread(target=ps.step)
    stepped.start()
    wait_until(lambda: time.monotonic() - t0 > past_s and holder.slot_info(ps.slot)["waiters"] > 0,
               what="the step to wait for its own update")
    assert stepped.is_alive() and ps.clock == before
    holder.resume()
    stepped.join(timeout=30)
    assert not stepped.is_alive()


@pytest.mark.parametrize("pull", ["copy", "view"])
def test_a_step_returns_with_its_own_update_in_the_weights(job, serve, pull):
    """--overlap off (auto's choice for a CPU learner in asp and ssp): step() returns only
    once the server applied that step's gradient, and with the weights that hold it: no flush, no wait here.
    Also when the loop is held past the native step's own wait (200 ms; a pause here): the step then waits on
    in Python, and still returns with its update."""
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1", "--overlap", "off")
    m = Flat()
    with learner.attach(m, job=job, pull=pull) as ps:
        assert ps._stepper is not None and not isinstance(ps._pull, ThreadPull)
        for i in range(1, 6):
            m.w.grad = torch.ones(64)
            ps.step()
            assert ps.clock == i and torch.equal(m.w.detach(), torch.full((64,), -float(i)))
        holder = open_job(job)
        # past the native step's 200 ms: the step waits in Python now (resumed from here, not by a timer)
        _step_with_the_loop_paused(ps, m, holder, 0.5)
        holder.close()
        assert ps.clock == 6 and torch.equal(m.w.detach(), torch.full((64,), -6.0))
    st = job_status(job)
    assert st["pushed"] == st["applied"] == 6 and st["staleness_max"] == 0


@pytest.mark.parametrize("flags, waits", [
    ((), True),  # auto waits with any optimizer and any number of slots
    (("--optimizer", "adam"), True),
    (("--optimizer", "adagrad", "--sync", "ssp:1"), True),
    (("--optimizer", "momentum"), True),  # layout 11 took the hand-off here; the matrix chose the wait
    (("--optimizer", "nesterov", "--async-momentum", "off"), True),
    (("--optimizer", "nesterov", "--overlap", "off"), True),
    (("--overlap", "on"), False),
    (("--optimizer", "momentum", "--overlap", "on"), False),
    (("--sync", "kasync:2"), False),  # kasync and bsp wait in their own way
    (("--sync", "bsp"), False),
])
def test_overlap_auto_with_several_learners_waits_for_its_own_update(job, serve, flags, waits):
    """--overlap auto in a job of two learner slots: a step waits for its own update under asp and ssp, every
    optimizer (docs/training.md, "When a learner takes newer weights"): with the loop paused, such a step
    waits (the other slot idle), and returns once resumed with its own update in the weights."""
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1", *flags)
    m = Flat()
    with learner.attach(m, job=job) as ps:
        holder = open_job(job)
        assert holder.header()["learners_wait_for_their_own"] is waits
        assert ps.waits_for_own is waits
        if waits:
            _step_with_the_loop_paused(ps, m, holder, 0.3)
            assert ps.clock == 1 and torch.all(m.w.detach() < -0.5), "the step's own update is in the weights"
        holder.close()


def test_a_pull_thread_only_where_the_job_leaves_it_a_core():
    from psd.learner import client

    assert client.pull_thread_has_a_core(2, 1, cpus=4) and not client.pull_thread_has_a_core(2, 1, cpus=3)
    assert not client.pull_thread_has_a_core(1, 0, cpus=2)
