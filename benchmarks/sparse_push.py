"""Sparse against dense embedding gradients: bytes written into the ring per push, pulled back, step time.

A 10^6 x 64 embedding table (256 MB of float32) with a mini-batch that touches
`--rows` words. With `nn.Embedding(sparse=True)` a push writes only the touched
rows (8 bytes of index and 256 bytes of values each), and a pull (the default
pull="copy") copies back only the rows and tensors the updates since changed
(the server's rows log); with a dense embedding a push writes the whole table
and a pull copies it back. The sparse model runs with pull="view" too (nothing
copied). All train through a real `psd serve` job (sgd).

    python benchmarks/sparse_push.py [--rows 256] [--steps 20] [--out benchmarks/results]

Each figure is the median over the steps, with their least and most; sparse_push.json and sparse_push.md
(with the machine) go into --out, replacing the old ones only once both are written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from psd import learner
from psd.arena import wait_for_job
from psd.bench.record import RESULTS, command_line, machine, machine_line, write_results


class Table(torch.nn.Module):
    """An embedding table (sparse or dense gradients) and a small linear head."""

    def __init__(self, rows: int, dim: int, sparse: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(rows, dim, sparse=sparse)
        self.out = torch.nn.Linear(dim, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).mean(1))


def measure(sparse: bool, table_rows: int, dim: int, touched: int, steps: int, pull: str = "copy") -> dict:
    """``steps`` steps of one learner against a bare server; push and step times in seconds, bytes pulled."""
    job = f"bench-sparse-{os.getpid()}-{int(sparse)}-{pull}"
    server = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--job", job, "--learners", "1",
                               "--optimizer", "sgd", "--lr", "0.1", "--no-watchdog", "-q"])
    try:
        wait_for_job(job, 60, server.pid)
        model = Table(table_rows, dim, sparse)
        g = torch.Generator().manual_seed(0)
        push, step = [], []
        with learner.attach(model, job=job, pull=pull) as ps:
            pulled = ps.pulled_bytes
            for _ in range(steps):
                idx = torch.randint(table_rows, (touched // 8, 8), generator=g)
                t0 = time.perf_counter()
                model(idx).sum().backward()
                ps.step()
                step.append(time.perf_counter() - t0)
                push.append(ps.push_ns / 1e9)
            pulled = ps.pulled_bytes - pulled
            ps.flush()
        rows = len(torch.unique(idx))
        written = (8 + rows * (8 + 4 * dim)) if sparse else table_rows * dim * 4
        return {"sparse": sparse, "pull": pull, "bytes_pulled_per_step": pulled / steps,
                "push_s_p50": statistics.median(push), "push_s_min": min(push),
                "push_s_max": max(push), "step_s_p50": statistics.median(step), "step_s_min": min(step),
                "step_s_max": max(step), "steps": steps, "bytes_per_push": written + (dim * 2 + 2) * 4}
    finally:
        server.terminate()
        server.wait(30)


def markdown(r: dict) -> str:
    """The two set-ups side by side, as the README quotes them."""
    lines = ["# Sparse against dense embedding gradients", "", f"Machine: {machine_line(r.get('machine'))}.", "",
             f"Command: `{r['command']}`.", "",
             f"A {r['table_rows']:,} x {r['dim']} table, {r['rows']} words a mini-batch, sgd, one learner; "
             f"median of {r['steps']} steps (least-most).", "",
             "| gradient | pull | bytes per push | bytes pulled per step | push | step (forward, backward, push, "
             "pull) |", "| --- | --- | ---: | ---: | --- | --- |"]
    for x in r["runs"]:
        lines.append(f"| {'sparse' if x['sparse'] else 'dense'} | {x['pull']} | {x['bytes_per_push']:,} | "
                     f"{x['bytes_pulled_per_step']:,.0f} | "
                     f"{x['push_s_p50'] * 1e3:.3f} ms ({x['push_s_min'] * 1e3:.3f}-{x['push_s_max'] * 1e3:.3f}) | "
                     f"{x['step_s_p50'] * 1e3:.2f} ms ({x['step_s_min'] * 1e3:.2f}-{x['step_s_max'] * 1e3:.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table-rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rows", type=int, default=256, help="words per mini-batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS, help=f"where sparse_push.json/.md go (default: {RESULTS})")
    args = p.parse_args()
    torch.set_num_threads(1)
    host = machine()
    res = [measure(s, args.table_rows, args.dim, args.rows, args.steps, pull)
           for s, pull in ((True, "copy"), (True, "view"), (False, "copy"))]
    print(json.dumps(res, indent=1))
    sp, _, de = res
    print(f"sparse / dense: bytes per push {sp['bytes_per_push'] / de['bytes_per_push']:.2e}, "
          f"push time {sp['push_s_p50'] / de['push_s_p50']:.3f}, step time {sp['step_s_p50'] / de['step_s_p50']:.3f}")
    r = {"machine": host, "command": command_line(), "table_rows": args.table_rows, "dim": args.dim,
         "rows": args.rows, "steps": args.steps, "runs": res}
    print(markdown(r))
    write_results(args.out, "sparse_push", r, markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
