"""One psd learner: trains the generated classification workload through a psd job.

Run it once per learner against a running server:

    psd serve --job demo --learners 8 --lr 0.05 &
    for r in 0 1 2 3 4 5 6 7; do python examples/train_mlp.py --job demo --rank $r --world 8 & done

or let `psd run` start, watch and restart them:

    psd run --job demo --learners 8 --lr 0.03 -- python examples/train_mlp.py

Each learner trains on its own shard (rank::world) of the data. The psd lines
are `learner.attach(...)`, `ps.step(...)` where `optimizer.step()` was, and
the `resume_step` skip that lets a restarted learner go on where it stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from psd import learner
from psd.workloads import evaluate, make_classification, make_mlp, shard


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("PSD_JOB", "demo"))
    p.add_argument("--rank", type=int, default=int(os.environ.get("PSD_RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("PSD_WORLD", 1)))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="data set seed (same for every learner)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per learner")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    data = make_classification(args.seed)
    # Under `psd run --nnodes N`, the shards are the whole job's: node R's learners take their own.
    node, nnodes = int(os.environ.get("PSD_NODE_RANK", 0)), int(os.environ.get("PSD_NNODES", 1))
    x, y = shard(data, node * args.world + args.rank, nnodes * args.world)
    model = make_mlp(data.dim, data.classes, seed=args.seed)
    g = torch.Generator().manual_seed(1000 + node * args.world + args.rank)
    steps_per_epoch = -(-len(x) // args.batch_size)
    t0 = time.monotonic()
    with learner.attach(model, job=args.job, rank=args.rank) as ps:
        # A restarted learner (psd run restarts the ones that die) skips what it already pushed:
        # resume_step counts this rank's gradients that the server applied.
        done = ps.resume_step
        if done:
            print(f"learner {args.rank}: resuming at step {done} of {args.epochs * steps_per_epoch}", flush=True)
        for epoch in range(args.epochs):
            order = torch.randperm(len(x), generator=g)  # drawn even when skipped: same order as before
            total, seen = 0.0, 0
            for step in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
                if step < done:
                    continue
                i = (step - epoch * steps_per_epoch) * args.batch_size
                idx = order[i:i + args.batch_size]
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                ps.step(loss, batch_size=len(idx))
                total += loss.item() * len(idx)
                seen += len(idx)
            if seen:
                print(f"learner {args.rank}: epoch {epoch + 1}/{args.epochs} loss {total / seen:.4f} "
                      f"clock {ps.clock}", flush=True)
        ps.flush()
        ps.pull()
        acc = evaluate(model, data)
        print(f"learner {args.rank}: done, {ps.pushed} gradients pushed in {time.monotonic() - t0:.1f} s, "
              f"accuracy {acc:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
