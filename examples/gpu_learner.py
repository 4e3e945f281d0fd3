"""A learner that computes on a GPU, attached to psd through a CPU copy of its model.

psd's learner client attaches CPU models. Until it drives CUDA streams itself
(GaDei's on-device double buffering), a GPU learner keeps a CPU "shadow" of
its model attached to the job: after each backward pass the gradients go
device -> shadow (straight into the ring entry the shadow's .grad points at),
`ps.step()` pushes them, and the fresher weights go shadow -> device. Those
copies are synchronous, so they do not overlap the computation. Without a GPU
the same script runs on the CPU.

    psd serve --job gpu --learners 2 --lr 0.03 &
    python examples/gpu_learner.py --job gpu
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from psd import learner
from psd.workloads import evaluate, make_classification, make_mlp, shard


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("PSD_JOB", "gpu"))
    p.add_argument("--rank", type=int, default=int(os.environ.get("PSD_RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("PSD_WORLD", 1)))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    data = make_classification(0)
    x, y = (t.to(dev) for t in shard(data, args.rank, args.world))
    shadow = make_mlp(data.dim, data.classes)           # on the CPU, attached to psd
    model = make_mlp(data.dim, data.classes).to(dev)    # where the computation happens
    pairs = list(zip(shadow.parameters(), model.parameters(), strict=True))
    g = torch.Generator().manual_seed(args.rank)
    with learner.attach(shadow, job=args.job, rank=args.rank) as ps:
        with torch.no_grad():
            for s, m in pairs:
                m.copy_(s)
        for _ in range(args.epochs):
            order = torch.randperm(len(x), generator=g).to(dev)
            for i in range(0, len(order), args.batch_size):
                idx = order[i:i + args.batch_size]
                model.zero_grad(set_to_none=False)
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                with torch.no_grad():
                    for s, m in pairs:
                        s.grad.copy_(m.grad)    # device -> the ring entry
                ps.step(loss, batch_size=len(idx))
                with torch.no_grad():
                    for s, m in pairs:
                        m.copy_(s)              # the weights psd swapped in -> device
        ps.flush()
        ps.pull()
    print(f"learner {args.rank} on {dev}: accuracy {evaluate(shadow, data):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
