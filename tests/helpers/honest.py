"""An honest learner for the fuzz test: pushes known gradients and says how many were applied.

    honest.py JOB RANK PUSHES

Attaches a Linear(8, 2) model with PSD_RANK-like `rank`, prints "ready", pushes PUSHES gradients of ones,
waits until every one is applied, and prints "done PUSHED APPLIED" (APPLIED: its rank's count as the
server keeps it).
"""

import sys

import torch

from psd import learner


def main() -> int:
    job, rank, pushes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 2, bias=False)
    with learner.attach(model, job=job, timeout=60, rank=rank) as ps:
        print("ready", flush=True)
        for _ in range(pushes):
            model.weight.grad = torch.ones(2, 8)
            ps.step()
        ps.flush(timeout=60)
        print(f"done {ps.pushed} {ps._arena.ranks()[rank]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
