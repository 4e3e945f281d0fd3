"""A learner for the sync-mode tests: `sync_learner.py MODE --job J ...`.

Modes:
  bsp    one shard of the exact (dyadic) regression problem; prints the final weights as a list (any sync mode;
         --pause-at S --pause P: pause P seconds before step S, --timeout: attach's)
  pace   a tiny model stepping every --delay seconds; prints "started", then "done"
  drift  a constant gradient (loss = g . w) with --steps steps; records, for every gradient, the
         weights it was computed on, the clock they were pulled at and the clock the gradient met,
         and prints the mean distance to the weights at that clock (replayed: every gradient is the
         same), and what it would have been on the pulled weights themselves

--then-job J2: once done with --job, the same again (detached, attached anew) with job J2: one process, so
one import of torch (seconds of CPU), for two jobs' runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from psd import learner


def exact_problem():
    """Regression whose float32 arithmetic is exact: small integers, a power-of-two lr and batch."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-1, 2, (8, 4), generator=g).float()
    y = torch.randint(-2, 3, (8, 1), generator=g).float()
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model, x, y


def fixed_grad(node: int, step: int) -> torch.Tensor:
    """The gradient node ``node``'s learner pushes at ``step`` under node_learner.py --fixed-grad (4 weights)."""
    scale = (node + 1) * (step + 1) / 4
    return torch.tensor([[1.0, -2.0, 0.5, 3.0]]) * scale + torch.tensor([[0.0, 1.0, -1.0, 0.25]]) * node


def run_bsp(args) -> None:
    model, x, y = exact_problem()
    xs, ys = x[args.rank * 4:(args.rank + 1) * 4], y[args.rank * 4:(args.rank + 1) * 4]
    with learner.attach(model, job=args.job, timeout=args.timeout) as ps:
        ps.wait_for_peers(args.world)
        for step in range(args.steps):
            if step == args.pause_at:
                time.sleep(args.pause)  # an evaluation or a save on this rank alone, not synchronisation
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            ps.step()
        ps.flush()
        ps.pull()
        print(json.dumps(model.weight.detach().reshape(-1).tolist()), flush=True)


def run_pace(args) -> None:
    model = torch.nn.Linear(8, 2)
    x = torch.randn(4, 8)
    with learner.attach(model, job=args.job) as ps:
        ps.wait_for_peers(args.world)
        print("started", flush=True)
        for _ in range(args.steps):
            model(x).sum().backward()
            ps.step()
            if args.delay:
                time.sleep(args.delay)  # stands in for a slower mini-batch, not for synchronisation
        print("done", flush=True)


def run_drift(args) -> None:
    n = 16
    g = torch.linspace(-1, 1, n)
    w = torch.nn.Parameter(torch.ones(n))
    model = torch.nn.Module()
    model.w = w
    lr, mu = args.lr, args.momentum
    records = []  # (weights computed on, clock they were pulled at)
    scratch = torch.randn(64, 64)
    distances = []
    with learner.attach(model, job=args.job) as ps:
        ps.wait_for_peers(args.world)
        a, k = ps._arena, ps._k

        def collect(seq):
            meta = a.entry_meta(ps.slot, seq)
            assert meta is not None, f"entry {seq} was overwritten before it was read"
            return meta["applied_clock"]

        met = {}
        for seq in range(args.steps):
            if seq >= k:
                met[seq - k] = collect(seq - k)  # its entry is reused by this push
            records.append((w.detach().clone(), ps.clock))
            busy_until = time.thread_time() + args.compute_ms / 1000  # CPU time: a mini-batch's compute
            while time.thread_time() < busy_until:
                torch.mm(scratch, scratch)
            (w * g).sum().backward()
            ps.step()
        ps.flush()
        for seq in range(max(0, args.steps - k), args.steps):
            met[seq] = collect(seq)
        clocks = max(met.values()) + 1
    # The weights after c updates, replayed with the server's arithmetic (momentum SGD, constant gradient).
    ws, cur, buf = [torch.ones(n)], torch.ones(n), None
    for _ in range(clocks):
        buf = g.clone() if buf is None else buf * mu + g
        cur = cur + (-lr) * buf
        ws.append(cur.clone())
    stale, plain, shifted = [], [], []
    for seq, (computed, clock) in enumerate(records):
        distances.append((computed - ws[met[seq]]).norm().item())
        plain.append((ws[clock] - ws[met[seq]]).norm().item())  # had it trained on the pulled weights
        shifted.append((computed - ws[clock]).norm().item())  # how far prediction moved them
        stale.append(met[seq] - clock)
    n = len(records)
    print(json.dumps({"mean_distance": sum(distances) / n, "mean_distance_unpredicted": sum(plain) / n,
                      "mean_shift": sum(shifted) / n, "mean_staleness": sum(stale) / n,
                      "predicted_staleness": ps.predicted_staleness}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["bsp", "pace", "drift"])
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--compute-ms", type=float, default=0.0, help="drift: CPU time each step spends computing")
    p.add_argument("--then-job", help="then do it all again with this job")
    p.add_argument("--timeout", type=float, default=60.0, help="bsp: attach's timeout (each wait's)")
    p.add_argument("--pause-at", type=int, default=-1, help="bsp: before this step, pause --pause seconds")
    p.add_argument("--pause", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    run = {"bsp": run_bsp, "pace": run_pace, "drift": run_drift}[args.mode]
    run(args)
    if args.then_job:
        args.job = args.then_job
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
