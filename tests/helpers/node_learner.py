"""A learner for the several-node tests, started by `psd run` (PSD_RANK, PSD_NODE_RANK, PSD_NNODES).

Learner g = node_rank * learners + rank trains on its own rows of sync_learner's exact problem; it
waits until its node link has formed (so no step is taken on weights the nodes have not agreed on),
then takes --steps steps and prints its final weights as JSON. --forever: train until killed. --step-s S: each
step's gradient takes S seconds more to compute (a slow model's), so its node link waits that long for the clock.
--fixed-grad: each step pushes fixed_grad(node, step) instead of the loss's gradient, whatever weights it holds
(a test of the optimizer state the exchange combines: its arithmetic then depends on no timing).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from sync_learner import exact_problem, fixed_grad

from psd import learner
from psd.nodelink import read_state

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=4)
p.add_argument("--forever", action="store_true")
p.add_argument("--step-s", type=float, default=0.0)
p.add_argument("--fixed-grad", action="store_true")
args = p.parse_args()
job, rank = os.environ["PSD_JOB"], int(os.environ["PSD_RANK"])
world, node, nnodes = int(os.environ["PSD_WORLD"]), int(os.environ["PSD_NODE_RANK"]), int(os.environ["PSD_NNODES"])
model, x, y = exact_problem()
g, total = node * world + rank, world * nnodes
rows = len(x) // total
xs, ys = x[g * rows:(g + 1) * rows], y[g * rows:(g + 1) * rows]
with learner.attach(model, job=job) as ps:
    deadline = time.monotonic() + 60
    while (read_state(job) or {}).get("state") != "running":
        if time.monotonic() > deadline:
            sys.exit("the node link did not form within 60 s")
        time.sleep(0.02)  # the link announces itself only in its state file
    # One write per line: a node's learners share the stdout file, and an unbuffered print() writes the
    # text and its newline separately, so two learners' lines could interleave.
    os.write(1, b"started\n")
    step = 0
    while args.forever or step < args.steps:
        if args.fixed_grad:
            model.weight.grad = fixed_grad(node, step)
        else:
            torch.nn.functional.mse_loss(model(xs), ys).backward()
        if args.step_s:
            time.sleep(args.step_s)  # the compute of a slower model, not synchronisation
        ps.step()
        step += 1
    os.write(1, (json.dumps(model.weight.detach().reshape(-1).tolist()) + "\n").encode())
