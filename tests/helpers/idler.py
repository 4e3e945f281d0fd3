"""A learner that attaches, pushes once, and then idles: its lease is renewed only by its native lease
thread. For liveness tests.

    idler.py JOB

Prints "ready slot S" after its first push; then, for each line on stdin, pushes once more and prints
"pushed N" (N: gradients pushed so far), or "lost" if its slot was taken back. Exits at end of input.
"""

import sys

import torch

from psd import learner
from psd.errors import SlotLost


def main() -> int:
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1, bias=False)
    with learner.attach(model, job=sys.argv[1], timeout=30) as ps:
        model.weight.grad = torch.ones(1, 4)
        ps.step()
        ps.flush()
        print(f"ready slot {ps.slot}", flush=True)
        for _ in sys.stdin:
            model.weight.grad = torch.ones(1, 4)
            try:
                ps.step()
                ps.flush()
            except SlotLost:
                print("lost", flush=True)
                return 1
            print(f"pushed {ps.pushed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
