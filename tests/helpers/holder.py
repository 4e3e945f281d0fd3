"""A learner that gets itself killed at an awkward moment, for the dead-owner tests.

    holder.py JOB --hold admission        take the admission mutex (learners' claims), print "ready", block
    holder.py JOB --idle                  attach, print "ready", block (a victim for psd chaos)
    holder.py JOB --fill-ring             push until the ring is full and wait on its condition
                                          variable (the test pauses the server first)
"""

import argparse
import signal
import sys

import torch

from psd import learner


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--hold", choices=["admission"])
    p.add_argument("--fill-ring", action="store_true")
    p.add_argument("--idle", action="store_true")
    a = p.parse_args()
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(64))
    ps = learner.attach(m, job=a.job)
    if a.hold or a.idle:
        if a.hold:
            ps._arena.hold_mutex(a.hold)
        print("ready", flush=True)
        signal.pause()  # until the test kills us (SIGKILL): never returns on its own
        return 1
    print("ready", flush=True)
    while True:  # blocks in step() once the ring is full: the test kills us there
        m.w.grad = torch.ones_like(m.w)
        ps.step()


if __name__ == "__main__":
    sys.exit(main())
