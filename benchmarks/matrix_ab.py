"""One convergence-matrix cell run by the psd of this script's tree, at seeds 0-2: its gap per seed.

    for t in /work/a /work/b; do $t/.venv/bin/python $t/benchmarks/matrix_ab.py embed momentum 2; done

Two builds of psd compared in turn, round after round on the same machine (an A/B): the matrix's runs of
one build spread by several points between runs (the LM, the embeddings), and runs taken hours apart at
another load read differently, so a change is judged on interleaved rounds, not on a matrix run against an
old one. Run each tree's script with that tree's own interpreter (its virtual environment): the server starts
in the script's tree (benchmarks/matrix.py), the learners import the interpreter's psd. Each line printed is
JSON: the tree, the cell, the server flags, the gaps (points of accuracy, or % of loss for the LM) against the
baselines recorded in benchmarks/results/matrix/matrix.jsonl, and their mean.

Two settings of one build compare the same way: `--flags "--async-momentum off"` against none, or a trial's
switch read from the environment in a worktree of its own (the server and the learners inherit it), one
arm with it set and one without, in turn:

    for e in 0 1; do PSD_TRIAL_X=$e $T/.venv/bin/python $T/benchmarks/matrix_ab.py lm nesterov 8; done
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import matrix


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", choices=sorted(matrix.WORKLOADS))
    p.add_argument("optimizer", choices=matrix.OPTIMIZERS)
    p.add_argument("learners", type=int)
    p.add_argument("--sync", default="asp")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--flags", default="", help='server flags for every run, e.g. "--async-momentum off"')
    p.add_argument("--log", type=Path, default=matrix.OUT / "matrix" / "matrix.jsonl")
    args = p.parse_args()
    base = {(r["workload"], r["optimizer"], r["seed"]): r for r in matrix.load(args.log) if r["kind"] == "baseline"}
    gaps = []
    for seed in range(args.seeds):
        b = base.get((args.workload, args.optimizer, seed))
        if b is None:
            p.error(f"no baseline for {args.workload} {args.optimizer} seed {seed} in {args.log}: run "
                    f"benchmarks/matrix.py --references-only --workloads {args.workload} --optimizers {args.optimizer}")
        r = matrix.run_psd(args.workload, args.optimizer, args.learners, args.sync, args.nodes, seed,
                           args.flags.split())
        gaps.append(round(100 * matrix._gap(matrix.cl.METRIC[args.workload], r["metric"], b["curve"][-1]), 2))
    cell = [args.workload, args.optimizer, args.learners, args.sync, args.nodes]
    print(json.dumps({"tree": str(matrix.ROOT), "cell": cell, "flags": args.flags, "gaps": gaps,
                      "mean": round(sum(gaps) / len(gaps), 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
