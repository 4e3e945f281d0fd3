"""A fast slice of the convergence matrix (benchmarks/matrix.py): the MLP at one process's hyper-parameters
and psd's default flags, 2 seeds (sgd and adam at 4 learners), against one process with torch.optim
at the same lr, mini-batch, passes over the data and seed. The band is the matrix's: the worst seed at most
1 point below. The whole matrix is a benchmark (`python benchmarks/matrix.py`, hours on 2 cores), not a test.

Momentum at the matrix's small lr is the known gap (`--async-momentum auto` cuts the momentum without its
gain; benchmarks/results/matrix/README.md): its one-learner cell is a strict xfail, so a change that closes
it shows as an unexpected pass.
"""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import convergence_learner as cl
import matrix

SEEDS = (0, 1)
_BASELINES: dict[tuple[str, int], float] = {}


def baseline(opt: str, seed: int) -> float:
    """One process's final accuracy (and a check that the workload does not saturate)."""
    if (opt, seed) not in _BASELINES:
        w = matrix.WORKLOADS["mlp"]
        curve = cl.train_single_curve("mlp", opt, w["lr"][opt], w["batch"], w["epochs"], seed)
        assert curve[-1] > curve[0], f"one process does not improve after its first epoch: {curve}"
        _BASELINES[(opt, seed)] = curve[-1]
    return _BASELINES[(opt, seed)]


def worst_gap(opt: str, learners: int, seeds: tuple[int, ...] = SEEDS) -> tuple[float, list]:
    gaps = []
    for seed in seeds:
        run = matrix.run_psd("mlp", opt, learners, "asp", 1, seed, [])
        gaps.append((run["metric"] - baseline(opt, seed), seed, run))
    return min(g for g, _, _ in gaps), gaps


# One learner against one process is tests/test_convergence.py's (sgd); here the asynchronous cells.
@pytest.mark.parametrize("opt, learners", [("sgd", 4), ("adam", 4)])
def test_mlp_cells_are_in_band_at_default_flags(opt, learners):
    worst, gaps = worst_gap(opt, learners)
    assert worst >= matrix.BAND["accuracy"], f"{opt} x {learners} learners: {gaps}"


@pytest.mark.xfail(strict=True, reason="known gap: --async-momentum auto under-trains momentum at a small lr "
                                       "(benchmarks/results/matrix/README.md)")
def test_mlp_momentum_one_learner_is_in_band_at_default_flags():
    worst, gaps = worst_gap("momentum", 1, seeds=(0,))  # -7 points at each seed measured: one is enough
    assert worst >= matrix.BAND["accuracy"], gaps
