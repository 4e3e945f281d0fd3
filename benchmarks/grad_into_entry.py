"""Would backward writing its gradient straight into the ring entry save the push's copy?

torch's autograd (AccumulateGrad) either hands ``p.grad`` the tensor the backward op allocated (when
``p.grad`` is None: what psd's learners do, then ``psd_push_from`` copies it into the ring entry), or adds
the new gradient into an existing ``p.grad`` in place. So "backward straight into the entry" means
pointing ``p.grad`` at the entry, zeroed, before the backward pass: a memset and a read-add-write of the
entry in place of the copy. This measures both ways on one Linear layer, per step (forward, backward, and
the gradient in a float32 buffer that stands for the entry), median of several runs:

    python benchmarks/grad_into_entry.py [--features 256 1024] [--batch 4] [--steps 300] [--reps 5]

``copy``: grad None (what a psd learner leaves after each push, as ``zero_grad()`` does), backward,
then the copy into the entry. ``kept``: the same private ``p.grad`` zeroed each step
(``zero_grad(set_to_none=False)``), backward, then the copy. ``into``: zero the entry, ``p.grad`` = it,
backward.

grad_into_entry.json and grad_into_entry.md (with the machine, and the least and most of the runs) go
into --out (default benchmarks/results), replacing the old ones only once both are written.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from psd.bench.record import RESULTS, command_line, machine, machine_line, write_results


def measure(features: int, batch: int, steps: int, how: str) -> float:
    """The median step of ``how`` (copy, kept, into) in microseconds, the first tenth of the steps left out."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(features, features, bias=False)
    layer.weight.grad = torch.zeros_like(layer.weight)
    x = torch.randn(batch, features)
    entry = torch.empty_like(layer.weight)  # stands for the ring entry
    times = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        if how == "into":
            entry.zero_()
            layer.weight.grad = entry
            layer(x).sum().backward()
        elif how == "kept":  # zero_grad(set_to_none=False): the same private p.grad every step, then the copy
            layer.weight.grad.zero_()
            layer(x).sum().backward()
            entry.copy_(layer.weight.grad)
        else:
            layer.weight.grad = None
            layer(x).sum().backward()
            entry.copy_(layer.weight.grad)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times[steps // 10:]) / 1000


def markdown(r: dict) -> str:
    """Each size's three ways, and their time over the copy's, as the README quotes them."""
    lines = ["# Backward into the ring entry, against the push's copy", "",
             f"Machine: {machine_line(r.get('machine'))}.", "", f"Command: `{r['command']}`.", "",
             f"One Linear layer, batch {r['batch']}, median step over {r['reps']} runs of {r['steps']} steps "
             "(least-most):", "",
             "| params | copy us | kept us | into us | kept / copy | into / copy |",
             "| ---: | --- | --- | --- | ---: | ---: |"]
    for x in r["sizes"]:
        cells = [f"{statistics.median(x[h]):.1f} ({min(x[h]):.1f}-{max(x[h]):.1f})" for h in ("copy", "kept", "into")]
        lines.append(f"| {x['params']:,} | " + " | ".join(cells) + f" | {x['kept_over_copy']:.2f} | "
                     f"{x['into_over_copy']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=int, nargs="+", default=[256, 1024],
                   help="the Linear layer's width, one size each (params = features^2)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS,
                   help=f"where grad_into_entry.json/.md go (default: {RESULTS})")
    args = p.parse_args()
    torch.set_num_threads(1)
    host = machine()
    sizes = []
    for features in args.features:
        runs: dict[str, list[float]] = {"copy": [], "kept": [], "into": []}
        for _ in range(args.reps):
            for how in runs:
                runs[how].append(measure(features, args.batch, args.steps, how))
        n = features * features
        for how, r in runs.items():
            print(f"{how:5} {n:>11,} params  batch {args.batch}  step p50 {statistics.median(r):9.1f} us "
                  f"(runs {min(r):.1f}-{max(r):.1f})")
        ratios = {f"{how}_over_copy": statistics.median(runs[how]) / statistics.median(runs["copy"])
                  for how in ("kept", "into")}
        for key, v in ratios.items():
            print(f"{key.replace('_over_', ' / ')}: {v:.2f} of the time")
        sizes.append({"params": n, "features": features, **runs, **ratios})
    r = {"machine": host, "command": command_line(), "batch": args.batch, "steps": args.steps, "reps": args.reps,
         "sizes": sizes}
    write_results(args.out, "grad_into_entry", r, markdown(r))


if __name__ == "__main__":
    main()
