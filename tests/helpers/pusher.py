"""A learner process with a flat model, for protocol and kill tests.

    pusher.py JOB --count M [--index I | --fill] [--ready-after R] [--forever] [--half-write]

Each gradient is 1.0 at index I (or everywhere with --fill), so with lr 1 the
shared weights count exactly how many gradients were applied. Prints "ready"
after R pushes (0: right after attaching) and "done N" when finished.
--half-write writes part of a gradient, prints "ready" and blocks until killed.
"""

import argparse
import signal
import sys

import torch

from psd import learner


class Flat(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))
        self.b = torch.nn.Parameter(torch.zeros(3))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--fill", action="store_true")
    p.add_argument("--ready-after", type=int, default=0)
    p.add_argument("--forever", action="store_true")
    p.add_argument("--half-write", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    model = Flat(a.n)
    with learner.attach(model, job=a.job) as ps:
        if a.half_write:
            # Die halfway through writing a gradient into the ring entry at the tail (what a kill
            # during push_from's copy leaves behind).
            entry = torch.frombuffer(ps._arena, dtype=torch.float32, count=a.n // 2,
                                     offset=ps._arena.grad_offset(ps.slot, ps._tail % ps._k))
            entry.fill_(1.0)
            print("ready", flush=True)
            signal.pause()  # until the test kills us (SIGKILL): never returns on its own
            return 1
        i = 0
        while a.forever or i < a.count:
            if i == a.ready_after:
                print("ready", flush=True)
            with torch.no_grad():
                if a.fill:
                    model.w.grad = torch.ones_like(model.w)
                    model.b.grad = torch.ones_like(model.b)
                else:
                    model.w.grad = torch.zeros_like(model.w)
                    model.w.grad[a.index] = 1.0
            ps.step(batch_size=1)
            i += 1
        ps.flush()
        print(f"done {ps.pushed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
