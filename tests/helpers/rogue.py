"""A learner that scribbles over the memory it can write, through its own mapping, as a stray pointer would.

    rogue.py JOB [--rank R] [--pushes N]

Attaches a Linear(8, 2) model, pushes N honest gradients of ones, waits until they are applied, and prints
"ready SLOT". Then it takes commands on stdin, one a line, and answers each with one line:

    fuzz SEED WRITES   WRITES random writes (1-64 bytes each: zeros, all-ones, huge, negative, NaN, inf or
                       random bytes) at uniformly random offsets of every range `learner_writable` lists for
                       its slot (psd inspect's contract), a push between every few; answers "fuzzed K E" (K
                       pushes made, E pushes refused because the server took the slot away)
    attach             attach a second time; answers "attached SLOT" or "refused CLASS"
    close              closes its learner (unmapping the arena); answers "closed"
    exit               exits 0

Every write goes through the learner's own mapping (its protections are the real ones: a write outside
them would kill this process with SIGSEGV).
"""

import argparse
import ctypes
import sys

import numpy as np
import torch

from psd import learner
from psd.arena import learner_writable
from psd.errors import Error

PALETTE = [b"\x00", b"\xff", b"\x7f\xff\xff\xff\xff\xff\xff\x7f", b"\x00\x00\x80\xff",  # 0, ones, huge, -inf
           b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xbf", b"\x01\x00\x00\x00\x00\x00\x00\x80"]
# (NaN, +inf, -1.0f, the most negative int64 + 1)


def scribble(base: int, ranges: list[dict], rng: np.random.Generator) -> None:
    """One random write of 1-64 bytes at a uniformly random offset of the ranges (clipped to the range)."""
    sizes = np.array([r["length"] for r in ranges], dtype=np.float64)
    r = ranges[rng.choice(len(ranges), p=sizes / sizes.sum())]
    off = int(rng.integers(0, r["length"]))
    n = min(int(rng.integers(1, 65)), r["length"] - off)
    kind = int(rng.integers(0, len(PALETTE) + 1))
    if kind == len(PALETTE):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    else:
        pattern = PALETTE[kind]
        data = (pattern * (n // len(pattern) + 1))[:n]
    ctypes.memmove(base + r["offset"] + off, data, n)


def make_model(batchnorm: bool) -> torch.nn.Module:
    linear = torch.nn.Linear(8, 2, bias=False)
    return torch.nn.Sequential(linear, torch.nn.BatchNorm1d(2)) if batchnorm else linear


def ones_grad(model: torch.nn.Module) -> None:
    for q in model.parameters():
        q.grad = torch.ones_like(q)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--batchnorm", action="store_true", help="the model has a BatchNorm1d(2) after the Linear")
    a = p.parse_args()
    torch.set_num_threads(1)
    model = make_model(a.batchnorm)
    ps = learner.attach(model, job=a.job, timeout=30, rank=a.rank)
    for _ in range(a.pushes):
        ones_grad(model)
        ps.step()
    ps.flush()
    print(f"ready {ps.slot}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "fuzz":
            rng = np.random.default_rng(int(cmd[1]))
            h = ps._arena.header()
            ranges = learner_writable(a.job, h, ps.slot)
            base = torch.frombuffer(ps._arena, dtype=torch.uint8).data_ptr()
            pushes = refused = 0
            for i in range(int(cmd[2])):
                scribble(base, ranges, rng)
                if i % 8 == 7:
                    ones_grad(model)
                    try:
                        ps.step()
                        pushes += 1
                    except Exception:
                        refused += 1
            print(f"fuzzed {pushes} {refused}", flush=True)
        elif cmd[0] == "attach":
            try:
                again = learner.attach(make_model(a.batchnorm), job=a.job, timeout=10)
            except Error as e:
                print(f"refused {type(e).__name__}", flush=True)
            else:
                print(f"attached {again.slot}", flush=True)
                again.close(flush=False)
        elif cmd[0] == "close":
            try:
                ps.close(flush=False)
            except Error:
                pass  # an evicted learner has no slot to give back
            print("closed", flush=True)
        elif cmd[0] == "exit":
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
