"""A BatchNorm CNN (small ResNet) on real 8x8 digit images, trained through psd with momentum.

BatchNorm's running statistics are part of the job: every learner pushes how far
its statistics moved with each gradient, the server adds that to the job's
buffers, and every pull brings the merged values back. So the exported model
(`psd export`) loads with `load_state_dict(..., strict=True)` and evaluates as
trained. Needs scikit-learn for the data (`pip install 'psd[examples]'`).

    psd run --job digits --learners 4 --optimizer momentum --lr 0.05 -- python examples/resnet_digits.py
    psd export --job digits --out digits.pt      # while it runs, or from its checkpoint after

Each learner trains on its own shard of the training images and prints the
accuracy of the job's model (weights and merged BatchNorm statistics) at the end;
`--export PATH` makes rank 0 also write the job's state_dict there and check it
loads strictly into a fresh model.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from psd import learner
from psd.workloads import epoch_batches, evaluate, load_digits, make_resnet


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("PSD_JOB", "digits"))
    p.add_argument("--rank", type=int, default=int(os.environ.get("PSD_RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("PSD_WORLD", 1)))
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--export", help="rank 0: write the job's state_dict here at the end")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    data = load_digits()
    x, y = data.x_train[args.rank::args.world], data.y_train[args.rank::args.world]
    model = make_resnet()
    g = torch.Generator().manual_seed(100 + args.rank)
    with learner.attach(model, job=args.job, rank=args.rank) as ps:
        # A restarted learner skips the mini-batches it already pushed.
        for idx in epoch_batches(len(x), args.batch_size, args.epochs, g, skip=ps.resume_step):
            if len(idx) < 2:
                continue  # BatchNorm needs two samples to train on
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            ps.step(loss, batch_size=len(idx))
        ps.flush()
        ps.pull()  # the job's weights and merged BatchNorm statistics
        model.eval()
        acc = evaluate(model, data)
        if args.export and args.rank == 0:
            state = learner.pull_state_dict(args.job)
            torch.save(state, args.export)
            fresh = make_resnet(seed=1)
            fresh.load_state_dict(torch.load(args.export))  # strict
            fresh.eval()
            print(f"learner 0: exported {args.export}; its accuracy {evaluate(fresh, data):.4f}", flush=True)
    print(f"learner {args.rank}: digits accuracy {acc:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
