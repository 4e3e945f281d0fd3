"""A learner that computes on a GPU: the model stays on the device.

`learner.attach` sees the model's device. On a GPU, gradients leave the device
on a side CUDA stream straight into the learner's ring in shared memory (which
is registered as pinned memory), and fresh weights come back on another stream
into a second device buffer that `ps.step()` swaps in: computation never waits
for a copy (GaDei's on-device double buffering). Without a GPU the same script
trains on the CPU.

    psd serve --job gpu --learners 2 --lr 0.03 &
    python examples/gpu_learner.py --job gpu

or several learners over the GPUs present (more learners than GPUs share them):

    psd run --job gpu --learners 8 --gpus 0,1 --lr 0.03 -- python examples/gpu_learner.py
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
    # `psd run --gpus` hands each learner its GPU in PSD_DEVICE.
    p.add_argument("--device", default=os.environ.get("PSD_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    data = make_classification(0)
    x, y = (t.to(dev) for t in shard(data, args.rank, args.world))
    model = make_mlp(data.dim, data.classes)
    g = torch.Generator().manual_seed(args.rank)
    with learner.attach(model, job=args.job, rank=args.rank, device=dev) as ps:
        for _ in range(args.epochs):
            order = torch.randperm(len(x), generator=g).to(dev)
            for i in range(0, len(order), args.batch_size):
                idx = order[i:i + args.batch_size]
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                ps.step(loss.detach(), batch_size=len(idx))  # a tensor: no sync with the GPU here
        ps.flush()
        ps.pull()
    model.cpu()
    print(f"learner {args.rank} on {dev}: accuracy {evaluate(model, data):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
