"""How much of one process's momentum gain ``--async-momentum auto`` keeps: the gain level.

Under asynchrony a gradient is ``tau`` updates old when the server applies it. Heavy-ball momentum on a
delayed gradient has two ways to go (native/optim.c ``psd_async_rule``), and the level (0 to 1) mixes them:

- level 0, the staleness rule: momentum less asynchrony's implicit momentum ``tau / (1 + tau)``, the lr
  kept. Stable even where one process's lr sits near its edge of stability, but with a tenth of the gain
  ``lr / (1 - momentum)`` at momentum 0.9: a job at a small lr trains ten times slower along flat directions;
- level 1, the gain-keeping rule: a gradient's mean age stays one process's (``mu' / (1 - mu') = mu / (1 - mu)
  - tau``) and the lr rises to keep ``lr / (1 - mu)``. One process's gain, but stable only while the job's lr
  times the loss's sharpness (its curvature where the job moves: learner/sharpness.py) is small.

Where each is stable is exact on a quadratic (one coordinate of curvature ``h``): the delayed iteration is
linear, and converges while every root of its characteristic polynomial lies inside the unit circle
(``stable``; benchmarks/delay_stability.py tabulates the same edges from the companion matrix's eigenvalues).
So the server takes the largest level whose edge, in units of ``lr h``, is at least ``MARGIN`` times the lr
times the sharpness the learners measure (learner/sharpness.py: the loss's curvature along the mini-batch's
gradient, reported through their slots); without a measurement the level is 0. Screened on the
convergence matrix's workloads in benchmarks/delayed_momentum.py (rule ``curv``, ``--along grad``), then
through psd (benchmarks/matrix.py).

Several nodes that exchange every few updates (``--sync-every 1``, the default) train as one job, and the
staleness the rule and the level take is that job's (``node_terms``, ``node_staleness``; native/optim.c
``psd_node_staleness``).
"""

from __future__ import annotations

import functools
import math
import statistics

__all__ = ["DAMPING_GATE", "HALF_LIFE", "LEVELS", "MARGIN", "RISE", "SharpnessHold", "damping", "edge", "edges",
           "level", "node_staleness", "node_terms", "rule", "stable"]

LEVELS = 21  # the levels tried: 0, 0.05, ..., 1
MARGIN = 1.0  # the chosen level's edge is at least this times lr x sharpness
HALF_LIFE = 8  # readings: the server holds the largest reading, halving it over this many new ones (any learner's)
DAMPING_GATE = 2.0  # the damping of staler gradients applies while lr x sharpness is past this x level 1's edge
RISE = 0.01  # after the first measurement set it, the level rises by at most this an update; it falls at once
MAX_TAU = 64  # above this staleness, level 0 (keeping any gain there needs lr x sharpness below 0.0025)


def node_terms(nnodes: int, sync_every: int, max_node_lag: int) -> tuple[int, float]:
    """(nodes, node_lag) of the header's configuration (native/optim.c ``psd_node_staleness``) for a job of
    ``nnodes`` nodes that exchange every ``sync_every`` local updates and run up to ``max_node_lag``
    exchanges ahead.

    Nodes that exchange every few updates train as one job: a gradient a node applies was computed before
    the other nodes' updates of the meantime too, and those reach it an exchange later. So the staleness the
    rule takes is the job's, ``nodes x`` the node's own plus the exchange's lag, ``(nodes - 1) (K (D + 1) -
    1)``: for each other node, the local updates a node may run past the last exchange it adopted beyond the
    one it is making (the default K = 1, D = 1: 1; lockstep at K = 1, D = 0: none, the nodes then computing
    what one process does with their combined batch). Where that lag passes ``MAX_TAU`` the nodes train
    apart between exchanges (local SGD: each node's trajectory is its own for K updates, then they meet),
    and each node's rule takes its own staleness: (1, 0.0), as for one node. Measured:
    benchmarks/results/matrix/README.md, "Two nodes: an exchange every update"."""
    if nnodes <= 1:
        return 1, 0.0
    lag = float((nnodes - 1) * (sync_every * (max_node_lag + 1) - 1))
    return (nnodes, lag) if lag <= MAX_TAU else (1, 0.0)


def node_staleness(tau: float, nodes: int, node_lag: float) -> float:
    """The staleness the rule takes at a node whose own mean staleness is ``tau``: native/optim.c's
    ``psd_node_staleness`` (``tau`` itself for one node)."""
    if nodes <= 1:
        return tau
    lag = node_lag if 0 <= node_lag < 1e18 else 0.0
    return nodes * (tau if tau > 0 else 0.0) + lag


def rule(mu: float, tau: float, level: float) -> tuple[float, float]:
    """(momentum, lr factor) at mean staleness ``tau`` and gain ``level``: native/optim.c's psd_async_rule."""
    if not tau > 0:
        return mu, 1.0
    cut = max(0.0, mu - tau / (1 + tau))
    age = mu / (1 - mu) - tau if mu < 1 else 0.0
    keep = age / (1 + age) if age > 0 else 0.0
    keep_lr = (1 - keep) / (1 - mu) if mu < 1 else 1.0
    return (1 - level) * cut + level * keep, (1 - level) + level * keep_lr


def stable(lr_h: float, mu: float, tau: int) -> bool:
    """Whether heavy-ball momentum converges on one coordinate of curvature h whose gradient is ``tau >= 1``
    updates old: m_t = mu m_{t-1} + h w_{t-tau}, w_{t+1} = w_t - lr m_t. Its characteristic polynomial is
    (z - 1)(z - mu) z^(tau - 1) + lr h; it converges when every root lies inside the unit circle, which
    the Schur-Cohn test decides in O(tau^2) (no eigenvalues, no numerical library)."""
    c = [1.0, -(1.0 + mu), mu] + [0.0] * (tau - 1)
    c[-1] += lr_h
    while len(c) > 1:
        a0, an = c[0], c[-1]
        if abs(an) >= abs(a0):
            return False
        n = len(c) - 1
        c = [a0 * c[i] - an * c[n - i] for i in range(n)]
        top = max(abs(x) for x in c) or 1.0
        c = [x / top for x in c]
    return True


def edge(mu: float, lr_factor: float, tau: int, steps: int = 40) -> float:
    """The largest lr h (the job's lr, before the factor) at which the delayed iteration converges."""
    lo, hi = 0.0, 8.0
    if stable(hi * lr_factor, mu, tau):
        return hi
    for _ in range(steps):  # bisection: below the edge every smaller lr h converges too
        mid = (lo + hi) / 2
        if stable(mid * lr_factor, mu, tau):
            lo = mid
        else:
            hi = mid
    return lo


@functools.lru_cache(maxsize=512)
def edges(mu: float, tau: int) -> tuple[float, ...]:
    """For each of the LEVELS levels, the edge (in lr h) at staleness ``tau``; falls as the level rises."""
    return tuple(edge(*rule(mu, tau, i / (LEVELS - 1)), tau, steps=30) for i in range(LEVELS))


def _edges_for(lr_sharpness: float, mu: float, tau: float) -> tuple[float, ...] | None:
    """The edges at ``tau`` for a measurement that can choose a level (a positive finite ``lr_sharpness``,
    some staleness up to MAX_TAU, a momentum in (0, 1)); else None."""
    if not (math.isfinite(lr_sharpness) and lr_sharpness > 0) or not 0 < tau <= MAX_TAU or not 0 < mu < 1:
        return None
    return edges(round(mu, 6), math.ceil(tau))


def level(lr_sharpness: float, mu: float, tau: float, margin: float = MARGIN) -> float:
    """The gain level for a job at momentum ``mu``, mean staleness ``tau``, whose lr times the loss's
    measured sharpness is ``lr_sharpness`` (0 when it is not a positive finite number)."""
    table = _edges_for(lr_sharpness, mu, tau)
    ok = [i for i, e in enumerate(table or ()) if e >= margin * lr_sharpness]
    return max(ok) / (LEVELS - 1) if ok else 0.0


def damping(lr_sharpness: float, mu: float, tau: float) -> float:
    """How much of the damping of staler-than-mean gradients (native/optim.c ``psd_async_lr_factor``: a
    gradient ``s`` updates old at mean staleness ``tau`` scaled by ``(1 + tau) / (1 + s)``) the update loop
    applies: all of it (1) while the held lr x sharpness passes ``DAMPING_GATE`` times level 1's edge at
    the mean staleness, where a job runs near the edge of what its level can take and a late gradient can
    throw it off, or where nothing says otherwise (no measurement, more than ``MAX_TAU`` staleness); none
    (0) below, where the job is far from any edge and the damping only slows it (measured:
    benchmarks/results/matrix/README.md, the trials of the damping). Without staleness yet, none: nothing
    is staler than a mean of 0 but the first gradients, which the damping would halve for no reason."""
    if not (math.isfinite(lr_sharpness) and lr_sharpness > 0) or not 0 < mu < 1 or not tau <= MAX_TAU:
        return 1.0
    if not tau > 0:
        return 0.0
    return 1.0 if lr_sharpness > DAMPING_GATE * edges(round(mu, 6), math.ceil(tau))[-1] else 0.0


class SharpnessHold:
    """The sharpness the server steers the gain by: the median of the live learners' last readings, held as
    a maximum that halves over ``half_life`` new readings.

    One mini-batch's reading can dip far below the loss's sharpness (a BatchNorm network at its edge swings
    over two orders of magnitude from one reading to the next), and the level must not follow a dip up. The
    hold is counted in readings: each learner measures every 50th of its steps (densely at first), so once
    the job runs 8 readings come about every 400 updates at any learner count (the hold of layout 11, 50
    updates, was about one reading, and let the CNN at its edge forget a sharp reading before the next);
    at the start, where learners measure at steps 1, 2, 4, ..., 32, it forgets faster. Measured: the matrix
    README, "The gain rule with the wait".

    A reading is new when a slot's value differs from the one last seen there; a value that is not a
    positive finite number (none measured yet, or a stray write: the slot is learner-writable) counts for
    nothing.
    """

    def __init__(self, half_life: float = HALF_LIFE) -> None:
        self.half_life = half_life
        self.value = 0.0  # the held reading (lr not applied)
        self._last: dict[int, float] = {}  # slot -> the reading last seen there

    def update(self, readings: dict[int, float]) -> float | None:
        """Take each live slot's last reading (slot -> value); return the held value, or None when no live
        learner has a usable reading now."""
        seen = {i: x for i, x in readings.items() if math.isfinite(x) and 0 < x < 1e30}
        new = sum(1 for i, x in seen.items() if self._last.get(i) != x)
        self._last = dict(seen)
        if not seen:
            return None
        self.value = max(statistics.median(seen.values()), self.value * 0.5 ** (new / self.half_life))
        return self.value
