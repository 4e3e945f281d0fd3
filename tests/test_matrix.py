"""A fast slice of the convergence matrix (benchmarks/matrix.py): the MLP at one process's hyper-parameters
and psd's default flags, 2 seeds (sgd and adam at 4 learners), against one process with torch.optim
at the same lr, mini-batch, passes over the data and seed; and the language model on 2 nodes x 2 learners.
The band is the matrix's: the worst seed at most 1 point below (2% of loss). The whole matrix is a benchmark
(`python benchmarks/matrix.py`, hours on 2 cores), not a test.

Momentum at the matrix's small lr was the gap `--async-momentum auto`'s staleness rule left (a tenth of one
process's gain: -7.75 points at 4 learners); its cell here holds the gain level (psd/gain.py) to the band,
from the sharpness the learners measure with torch.optim's closure (benchmarks/convergence_learner.py).

Last, the matrix's reference of one process on the learners' own mini-batches (what their data order alone
does, apart from their staleness) and the report's use of it.
"""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import convergence_learner as cl
import forked
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
        # Each learner forked with torch imported (tests/forked.py): the same script, a process of its own.
        run = matrix.run_psd("mlp", opt, learners, "asp", 1, seed, [], start=forked.start)
        gaps.append((run["metric"] - baseline(opt, seed), seed, run))
    return min(g for g, _, _ in gaps), gaps


# One learner against one process is tests/test_convergence.py's (sgd); here the asynchronous cells
# (sgd and adam at 2 seeds; momentum below).
@pytest.mark.parametrize("opt, learners", [("sgd", 4), ("adam", 4)])
def test_mlp_cells_are_in_band_at_default_flags(opt, learners):
    worst, gaps = worst_gap(opt, learners)
    assert worst >= matrix.BAND["accuracy"], f"{opt} x {learners} learners: {gaps}"


def test_mlp_momentum_cell_keeps_one_process_gain_at_default_flags():
    worst, gaps = worst_gap("momentum", 4)
    assert worst >= matrix.BAND["accuracy"], gaps


def test_two_nodes_train_as_one_node_of_all_their_learners_at_default_flags():
    """2 nodes x 2 learners (two `psd run` jobs meeting on 127.0.0.1), the language model with sgd at default
    flags, against one process: within the matrix's band (2% of loss). The cell that tells how often nodes
    exchange: under --sync-every 100, the default before, it lost 7% of loss at this seed, 3.5% at K = 10
    (benchmarks/results/matrix/README.md, "Two nodes: an exchange every update"). One seed: the gap of a
    large K shows at every seed, and each run of this cell is two whole jobs."""
    w = matrix.WORKLOADS["lm"]
    curve = cl.train_single_curve("lm", "sgd", w["lr"]["sgd"], w["batch"], w["epochs"], 0)
    assert curve[-1] < curve[-2], f"one process does not improve in its last epoch: {curve}"
    run = matrix.run_psd("lm", "sgd", 2, "asp", 2, 0, [])
    gap = matrix._gap("loss", run["metric"], curve[-1])
    assert gap <= matrix.BAND["loss"], f"2 nodes x 2 learners: {run['metric']:.4f} against {curve[-1]:.4f} ({gap:+.1%})"


def test_the_learners_order_is_the_batches_the_learners_draw_and_one_learners_is_the_baseline():
    """The matrix's reference of one process on the learners' own mini-batches: every batch a learner draws
    (``learner_batches``, what convergence_learner's learners train on), as indices of the whole training set,
    each once, taken in turn; for one learner exactly the one-process baseline's order."""
    import torch

    from psd.workloads import Dataset, epoch_batches, shard

    n, batch, epochs, seed = 103, 4, 3, 5
    g = torch.Generator().manual_seed(1000 + seed)
    baseline_order = [b for _ in range(epochs) for b in epoch_batches(n, batch, 1, g)]
    one = [b for ep in cl.learners_order(n, 1, batch, epochs, seed) for b in ep]
    assert len(one) == len(baseline_order) and all(torch.equal(a, b) for a, b in zip(one, baseline_order, strict=True))
    world = 3
    order = cl.learners_order(n, world, batch, epochs, seed)
    assert len(order) == epochs
    flat = [b for ep in order for b in ep]
    ids = Dataset(torch.arange(n), torch.zeros(n), torch.arange(1), torch.zeros(1), 1)  # each sample its index
    draws = [[shard(ids, rank, world)[0][b] for b in cl.learner_batches(n, rank, world, batch, epochs, seed)]
             for rank in range(world)]  # what a learner trains on: its batches of its shard
    assert sorted(map(tuple, (b.tolist() for b in flat))) == sorted(tuple(b.tolist()) for d in draws for b in d)
    assert [b.tolist() for b in flat[:world]] == [d[0].tolist() for d in draws]  # in turn: each learner's first
    assert sorted(torch.cat(flat).tolist()) == sorted(list(range(n)) * epochs)  # every sample once an epoch


def test_the_report_sets_psd_against_one_process_on_the_learners_batches():
    """summarize: psd's gap to the learners'-order run at the same seed, beside both gaps to the baseline."""
    runs = [{"label": "baseline", "kind": "baseline", "workload": "mlp", "optimizer": "sgd", "seed": s,
             "untrained": 0.1, "curve": [0.80, 0.90]} for s in (0, 1)]
    runs += [{"label": "baseline", "kind": "order", "workload": "mlp", "optimizer": "sgd", "learners": 4, "seed": s,
              "curve": [0.7, v]} for s, v in ((0, 0.86), (1, 0.91))]
    runs += [{"label": "x", "kind": "psd", "workload": "mlp", "optimizer": "sgd", "learners": 4, "sync": "asp",
              "nodes": 1, "seed": s, "metric": v} for s, v in ((0, 0.855), (1, 0.88))]
    (row,) = matrix.summarize(runs, "x")
    assert row["gap_worst"] == pytest.approx(-0.045) and not row["in_band"]
    assert row["order_worst"] == pytest.approx(-0.04)
    assert row["against_order_worst"] == pytest.approx(-0.03) and not row["against_order_in_band"]
    runs[-1]["metric"] = 0.905  # seed 1 now 0.5 points under its learners' order, as seed 0 is
    (row,) = matrix.summarize(runs, "x")
    assert row["against_order_worst"] == pytest.approx(-0.005) and row["against_order_in_band"]
    assert not row["in_band"]  # still 4.5 points under the baseline at seed 0
    assert "| -0.50 pt | yes |" in matrix.table([row], "x", "")


def test_the_calibration_counts_one_process_out_of_its_own_band_over_every_order():
    """calibration: every recorded order of one process against the baseline at its seed, beside psd's runs with
    several learners under the label (a diverged one out of band, a refused one not counted); the noise floor
    of summarize stays the first order's."""
    runs = [{"label": "baseline", "kind": "baseline", "workload": "mlp", "optimizer": "sgd", "seed": s,
             "untrained": 0.1, "curve": [0.80, 0.90]} for s in (0, 1)]
    runs += [{"label": "baseline", "kind": "reorder", "workload": "mlp", "optimizer": "sgd", "seed": s, "order": o,
              "curve": [0.8, v]} for s, o, v in ((0, 1, 0.895), (1, 1, 0.90), (0, 2, 0.88), (1, 2, 0.905))]
    psd = {"kind": "psd", "workload": "mlp", "optimizer": "sgd", "sync": "asp", "nodes": 1}
    runs += [{**psd, "label": "x", "learners": n, "seed": s, "metric": v}
             for n, s, v in ((1, 0, 0.70), (4, 0, 0.85), (4, 1, 0.899), (8, 1, float("nan")))]
    runs += [{**psd, "label": "x", "learners": 2, "seed": 0, "metric": float("nan"), "error": "refused"},  # not counted
             {**psd, "label": "other", "learners": 4, "seed": 0, "metric": 0.5}]  # another label's
    assert len({matrix._key(r) for r in runs}) == len(runs)  # each order its own run: none taken for done
    old = {k: v for k, v in runs[2].items() if k != "order"}  # a log's reorder line from before orders: order 1
    assert matrix._key(old) == matrix._key(runs[2])
    (row,) = matrix.calibration(runs, "x")
    assert row["runs"] == 4 and row["seeds"] == 2 and row["out_share"] == pytest.approx(0.25)  # order 2, seed 0
    assert row["gap_worst"] == pytest.approx(-0.02)
    assert row["cell_out"] == pytest.approx(0.5)  # seed 0 in band at 1 order of 2, seed 1 at both
    assert row["psd_runs"] == 3 and row["psd_out_share"] == pytest.approx(2 / 3)  # 0.85 and the diverged run
    noise = {r["learners"]: r["noise_worst"] for r in matrix.summarize(runs, "x")}
    assert noise[4] == pytest.approx(-0.005)  # the first order's, not the second's -0.02
    assert "| mlp (accuracy) | sgd | 4 | 2 | -0.25 pt | -2.00 pt | 25% | 50% | 3 | 67% |" in \
        matrix.calibration_table([row])
    # a loss: higher is worse, the band +2%
    lm = [{"label": "baseline", "kind": "baseline", "workload": "lm", "optimizer": "adam", "seed": 0,
           "untrained": 4.0, "curve": [2.2, 2.0]},
          *({"label": "baseline", "kind": "reorder", "workload": "lm", "optimizer": "adam", "seed": 0, "order": o,
             "curve": [2.2, v]} for o, v in ((1, 2.03), (2, 2.05)))]
    (row,) = matrix.calibration(lm, "x")
    assert row["out_share"] == pytest.approx(0.5) and row["gap_worst"] == pytest.approx(0.025)
    assert row["psd_out_share"] is None


def test_a_scheduled_workload_anneals_over_the_updates_the_job_makes():
    """``cnn_cos`` anneals its lr to 0 over the run, one process over its own steps (torch's
    CosineAnnealingLR) and psd over the job's updates (``--schedule cosine --t-max``, from
    ``matrix.job_updates``): the count the server is told is the count it makes, and its last update is at
    an lr near 0 (a schedule cut short, or run past its end, would leave one side training at another lr)."""
    assert matrix._server_flags("cnn_cos", "sgd", 2, "kasync:2", 1, 0, [])[-2:] == [
        "--t-max", str(matrix.job_updates("cnn_cos", 2, "asp", 1, 0) // 2)]
    run = matrix.run_psd("cnn_cos", "sgd", 2, "asp", 1, 0, [], start=forked.start)
    assert run["updates"] == matrix.job_updates("cnn_cos", 2, "asp", 1, 0)
    lr = matrix.WORKLOADS["cnn_cos"]["lr"]["sgd"]
    assert 0 <= run["lr_now"] < lr * 1e-4, run
