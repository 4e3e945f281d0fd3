"""--async-momentum auto's gain level (psd/gain.py) and the sharpness learners measure for it
(learner/sharpness.py): the stability edges against the iteration itself, the probe against a known Hessian,
and a real server steering the level from what a learner reports, junk included."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest
import torch

from conftest import arena_header
from psd import gain, learner
from psd.learner.sharpness import FLAT, SharpnessProbe


def iterate(lr_h: float, mu: float, tau: int, steps: int = 6000) -> float:
    """|w| after heavy-ball momentum with a gradient tau updates old, on f(w) = h w^2 / 2, from w = 1."""
    ws, m = [1.0] * (tau + 1), 0.0
    for _ in range(steps):
        m = mu * m + ws[-1 - tau]
        ws.append(ws[-1] - lr_h * m)
        ws.pop(0)
        if abs(ws[-1]) > 1e6:
            break
    return abs(ws[-1])


@pytest.mark.parametrize("tau", [1, 2, 4, 8])
@pytest.mark.parametrize("level", [0.0, 0.5, 1.0])
def test_each_levels_edge_is_where_the_delayed_iteration_stops_converging(tau, level):
    mu, f = gain.rule(0.9, tau, level)
    edge = gain.edge(mu, f, tau)
    assert 0 < edge < 8
    assert iterate(0.9 * edge * f, mu, tau) < 1e-2  # converges below the edge
    assert iterate(1.1 * edge * f, mu, tau) > 1e2  # diverges above it


def test_the_level_keeps_as_much_gain_as_the_measured_sharpness_allows():
    # nothing measured, no staleness, no momentum: the staleness rule alone
    for bad in (math.nan, math.inf, -1.0, 0.0):
        assert gain.level(bad, 0.9, 4.0) == 0.0
    assert gain.level(1e-4, 0.9, 0.0) == 0.0
    assert gain.level(1e-4, 0.0, 4.0) == 0.0
    assert gain.level(1e-4, 0.9, gain.MAX_TAU + 1) == 0.0
    # a flat loss keeps all of one process's gain, a sharp one none; in between it falls as sharpness rises
    assert gain.level(1e-4, 0.9, 4.0) == 1.0
    assert gain.level(1.0, 0.9, 4.0) == 0.0
    levels = [gain.level(x, 0.9, 4.0) for x in (0.01, 0.03, 0.06, 0.1, 0.15, 0.2)]
    assert levels == sorted(levels, reverse=True) and levels[0] > levels[-1]
    # the chosen level's edge is at least MARGIN times lr x sharpness
    for x in (0.01, 0.05, 0.1):
        lv = gain.level(x, 0.9, 4.0)
        assert gain.edge(*gain.rule(0.9, 4, lv), 4) >= gain.MARGIN * x
    # the rule's ends: level 0 takes asynchrony's implicit momentum off; level 1 keeps lr / (1 - mu)
    assert gain.rule(0.9, 4, 0.0) == pytest.approx((0.9 - 4 / 5, 1.0))
    mu1, f1 = gain.rule(0.9, 4, 1.0)
    assert mu1 / (1 - mu1) == pytest.approx(0.9 / 0.1 - 4)
    assert f1 / (1 - mu1) == pytest.approx(1 / (1 - 0.9))


def test_the_probe_measures_the_curvature_along_the_gradient_and_leaves_training_as_it_was():
    torch.manual_seed(0)
    x = torch.randn(64, 12) * torch.linspace(0.2, 3.0, 12)
    y = torch.randn(64, 1)
    model = torch.nn.Sequential(torch.nn.Linear(12, 1, bias=False), torch.nn.BatchNorm1d(1, affine=False))

    def closure() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model[0](x), y) + 0.0 * model(x).sum()  # BatchNorm runs too
        loss.backward()
        return loss

    # MSE of a linear map: the Hessian is 2 X^T X / (B d_out), exactly, and the gradient 2 X^T (Xw - y) / B
    hessian = 2 * x.T @ x / 64
    closure()
    w, g = model[0].weight.detach().clone(), model[0].weight.grad
    g_values = g.clone()
    along = float(g_values @ hessian @ g_values.T / (g_values @ g_values.T))
    top = float(torch.linalg.eigvalsh(hessian).max())
    assert along < 0.9 * top  # the two differ here: the test tells them apart
    # the probe takes the module's buffers when it measures (a learner replaces them after building it)
    probe = SharpnessProbe(list(model.parameters()), module=model, every=1)
    model[1].running_mean = model[1].running_mean.clone()
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    value = probe.measure(closure)
    assert value == pytest.approx(along, rel=0.02)
    assert torch.equal(model[0].weight, w)
    assert model[0].weight.grad is g and torch.equal(g, g_values)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), stats, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)  # the user's random stream is untouched
    # a loss that bends down along its gradient reads as flat (the server's level: as high as staleness allows)
    concave = torch.nn.Linear(12, 1, bias=False)

    def down() -> torch.Tensor:
        loss = -(concave(x) ** 2).mean()
        loss.backward()
        return loss

    assert SharpnessProbe(list(concave.parameters()), every=1).measure(down) == FLAT > 0
    # due(): steps 1, 2, 4, ... below `every`, then every `every`-th
    p = SharpnessProbe(list(model.parameters()), every=6)
    assert [i + 1 for i in range(19) if p.due()] == [1, 2, 4, 6, 12, 18]
    assert not SharpnessProbe(list(model.parameters()), every=0).due()


def test_the_damping_of_staler_gradients_applies_only_near_an_edge():
    edge1 = gain.edges(0.9, 4)[-1]  # level 1's edge at staleness 4
    # unmeasured, no momentum, or staleness past MAX_TAU: all of the damping
    for bad in (math.nan, math.inf, -1.0, 0.0):
        assert gain.damping(bad, 0.9, 4.0) == 1.0
    assert gain.damping(0.01 * edge1, 0.0, 4.0) == 1.0
    assert gain.damping(0.01 * edge1, 0.9, gain.MAX_TAU + 1) == 1.0
    # no staleness yet: nothing to damp
    assert gain.damping(10.0, 0.9, 0.0) == 0.0
    # below DAMPING_GATE x level 1's edge none, past it all (the edge at the staleness rounded up)
    assert gain.damping(0.9 * gain.DAMPING_GATE * edge1, 0.9, 4.0) == 0.0
    assert gain.damping(1.1 * gain.DAMPING_GATE * edge1, 0.9, 4.0) == 1.0
    assert gain.damping(1.1 * gain.DAMPING_GATE * edge1, 0.9, 3.2) == 1.0


def test_nodes_that_exchange_often_take_the_jobs_staleness_and_rare_exchanges_their_own():
    assert gain.node_terms(1, 1, 1) == (1, 0.0)  # one node: nothing added
    assert gain.node_terms(2, 1, 1) == (2, 1.0)  # the default K = 1, D = 1: a node runs 2 updates past an exchange
    assert gain.node_terms(4, 1, 1) == (4, 3.0)
    assert gain.node_terms(4, 1, 0) == (4, 0.0)  # lockstep every update: one process with the combined batch
    assert gain.node_terms(2, 2, 0) == (2, 1.0)
    assert gain.node_terms(2, 100, 1) == (1, 0.0)  # local SGD: lag 199 > MAX_TAU, each node its own
    assert gain.node_terms(2, 100, 0) == (1, 0.0)
    assert gain.node_terms(2, 65, 0) == (2, 64.0) and gain.node_terms(2, 66, 0) == (1, 0.0)  # MAX_TAU: the last
    assert gain.node_staleness(1.5, 1, 0.0) == 1.5
    assert gain.node_staleness(1.5, 2, 1.0) == 4.0  # the other node's 1.5 updates meanwhile, and the lag
    assert gain.node_staleness(0.0, 2, 1.0) == 1.0  # a node's own learners may meet none: the others' still count
    for junk in (math.nan, -1.0, math.inf):  # the server writes it; the loop's reader checks it anyway
        assert gain.node_staleness(1.0, 2, junk) == 2.0
    # a larger staleness, a lower level for the same measured sharpness
    assert gain.level(0.05, 0.9, gain.node_staleness(1.0, 2, 1.0)) < gain.level(0.05, 0.9, 1.0)


def test_the_held_sharpness_halves_over_new_readings_not_over_time():
    hold = gain.SharpnessHold()
    assert hold.update({}) is None and hold.update({0: math.nan, 1: -1.0, 2: 1e300}) is None
    assert hold.update({0: 1.0, 1: 3.0}) == 2.0  # the median of the live learners' readings
    # the same readings again (no learner measured since): held as they are, however often the server looks
    for _ in range(100):
        assert hold.update({0: 1.0, 1: 3.0}) == 2.0
    # a sharp reading is held, halving over HALF_LIFE new readings (any learner's), never below the median
    assert hold.update({0: 100.0, 1: 100.0}) == 100.0
    last = {}
    for k in range(1, gain.HALF_LIFE // 2 + 1):
        last = {0: 0.1 + k, 1: 0.2 + k}
        assert hold.update(last) == pytest.approx(100.0 * 0.5 ** (2 * k / gain.HALF_LIFE))
    assert hold.value == pytest.approx(50.0)
    # junk in one slot counts for nothing: neither a reading nor a new one
    assert hold.update({**last, 2: math.inf}) == pytest.approx(50.0)
    for i in range(40):
        hold.update({0: 1.0 + i % 2, 1: 3.0 + i % 2})
    assert hold.value == pytest.approx(3.0)  # held down to the readings' median, no lower


def steer(ps, closure, until, timeout: float = 60.0, report=None) -> dict:
    """Train (a closure step each time) until the header satisfies ``until``; ``report``: a sharpness
    value to write over the learner's own each step (what a stray write could leave)."""
    deadline = time.monotonic() + timeout
    while True:
        loss = closure()
        ps.step(loss, 16, closure=closure)
        if report is not None:
            ps._arena.note_sharpness(ps.slot, report)
        h = arena_header(ps.job)
        if until(h):
            return h
        assert time.monotonic() < deadline, f"the gain level stayed {h['gain_level']} ({h['staleness_avg']=})"


def least_squares() -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """A Linear(8, 1) and torch.optim's closure of its least-squares loss on one fixed batch (seed 0): at lr
    0.001 far below any edge of stability."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    model = torch.nn.Linear(8, 1)

    def closure() -> torch.Tensor:
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return model, closure


def test_a_measurement_before_any_staleness_sets_the_level_at_the_learners_number(job, serve):
    """A learner measures at its first steps, before the update loop has met any staleness, where gain.level
    says 0; the server's next look is 0.1 s later, hundreds of updates in a small job, which ran them at
    level 0 (a third of the matrix's embeddings job). So with no staleness measured yet the server takes the
    level at the staleness its live learners bring in turn, one update each of the others': here 1 (two
    learners), far from any edge at lr 0.001, level > 0 while the mean staleness is still 0; and until that
    first level it looks every 5 ms, so the level comes within the job's first updates."""
    # --overlap off: a learner waits for its own update, so A alone (B attached, idle) meets no staleness
    served = serve(job, "--learners", "2", "--optimizer", "momentum", "--lr", "0.001", "--overlap", "off")
    model, closure = least_squares()
    with learner.attach(model, job=job) as ps, learner.attach(torch.nn.Linear(8, 1), job=job):
        h = steer(ps, closure, lambda h: h["gain_level"] > 0, timeout=30)
        assert h["staleness_avg"] == 0.0 and h["staleness_held"] == 0.0
        assert h["momentum_now"] == 0.9  # no staleness: the configured momentum, at any level
        # and at once: the server looks every 5 ms until the first level is measured (Server.next_poll_s), where
        # a look every 0.1 s set it at update 250-279 of this job (2-4 now)
        assert h["clock"] <= 100, f"the level came at update {h['clock']}"
    served.stop()


def test_a_server_keeps_the_gain_a_learners_measured_sharpness_allows_and_shrugs_off_junk(job, serve):
    # --overlap on: the one learner's gradients meet staleness (off, one learner meets none)
    served = serve(job, "--learners", "2", "--optimizer", "momentum", "--lr", "0.001", "--overlap", "on")
    model, closure = least_squares()
    with learner.attach(model, job=job) as ps:
        ps.sharpness.every = 5
        assert arena_header(job)["damping"] == 1.0  # all of it until the job is measured
        # lr 0.001 on this least-squares loss: far below any edge, so no damping of staler gradients either
        h = steer(ps, closure, lambda h: h["gain_level"] > 0 and h["staleness_avg"] > 0 and h["damping"] == 0.0)
        generation = h["generation"]
        # what the update loop applies is the rule at that level (native/optim.c against psd/gain.py)
        assert h["momentum_now"] == pytest.approx(gain.rule(0.9, h["staleness_avg"], h["gain_level"])[0], abs=0.05)
        # a learner's slot is its own to scribble on: no number it leaves there is trusted
        for junk in (math.nan, math.inf, -math.inf, -1.0, 0.0, 1e300):
            steer(ps, closure, lambda h: h["gain_level"] == 0.0 and h["damping"] == 1.0, report=junk)
        steer(ps, closure, lambda h: h["gain_level"] > 0 and h["damping"] == 0.0)  # measured again: the gain comes back
        # a real number, too sharp for any level: level 0, and the damping
        steer(ps, closure, lambda h: h["gain_level"] == 0.0 and h["damping"] == 1.0, report=1e6)
        assert arena_header(job)["generation"] == generation  # the server never went down
    served.stop()
