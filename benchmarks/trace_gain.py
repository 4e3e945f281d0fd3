"""Trace the gain level of one convergence-matrix cell: what `--async-momentum auto` does over a run.

    python benchmarks/trace_gain.py --workload lm --optimizer momentum --learners 2 [--seed 0] [-- FLAGS...]

Runs the cell as benchmarks/matrix.py does (its server flags, its learners, which pass torch.optim's closure
so they measure the loss's sharpness) and prints, each time it changes, the update count, the gain level,
the momentum the update loop applies (`momentum_now`), the running mean staleness, the damping of
staler-than-mean gradients (`damping`) and each learner slot's
lr x sharpness (psd/gain.py), read from the arena's header as `psd inspect` reads it. Ends with the staleness
histogram (as `psd status` buckets it) and the learners' final metric. Nothing is written to benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import matrix

from psd import _native
from psd.arena import open_job
from psd.status import stale_bucket_label


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="lm", choices=tuple(matrix.WORKLOADS))
    p.add_argument("--optimizer", default="momentum")
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=float, default=0.2, help="seconds between readings of the header")
    p.add_argument("flags", nargs="*", help="server flags after --, e.g. -- --async-momentum off")
    args = p.parse_args()
    # stopped with SIGTERM (kill, timeout): exit through the finally blocks that stop the psd servers started
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    w = matrix.WORKLOADS[args.workload]
    if args.optimizer not in w["lr"]:
        p.error(f"{args.workload} has no lr for {args.optimizer}: one of {', '.join(w['lr'])}")
    lr = w["lr"][args.optimizer]
    job = f"trace-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="psd-trace-") as state:
        env = dict(os.environ, OMP_NUM_THREADS="1", XDG_STATE_HOME=state)
        with matrix.serving(job, args.workload, args.optimizer, args.learners, "asp", args.seed, args.flags, env,
                            server_stderr=None) as learners:
            arena = open_job(job, role="reader")
            last = None
            hist: list[int] = []
            while any(q.poll() is None for q in learners):
                h = arena.header()
                if h["state"] == _native.ARENA_READY:
                    arena.remap()
                    hist = h["staleness_hist"]
                    sharp = [arena.slot_info(i).get("sharpness", float("nan")) for i in range(h["n_slots"])]
                    row = (round(h["gain_level"], 2), round(h["momentum_now"], 3), round(h["staleness_avg"], 1),
                           h["damping"])
                    if row != last:
                        print(json.dumps({"clock": h["clock"], "gain_level": row[0], "momentum_now": row[1],
                                          "staleness_avg": row[2], "damping": row[3],
                                          "lr_sharpness": [round(lr * x, 4) for x in sharp]}), flush=True)
                        last = row
                time.sleep(args.every)
            buckets = {stale_bucket_label(i): n for i, n in enumerate(hist) if n}
            print(json.dumps({"staleness_hist": buckets}), flush=True)
            for q in learners:
                out, err = q.communicate()
                print(out.strip(), flush=True)
                if err.strip():
                    print(err.strip(), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
