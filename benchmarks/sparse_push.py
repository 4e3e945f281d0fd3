"""Sparse against dense embedding gradients: bytes written into the ring per push and step time.

A 10^6 x 64 embedding table (256 MB of float32) with a mini-batch that touches
`--rows` words. With `nn.Embedding(sparse=True)` a push writes only the touched
rows (8 bytes of index and 256 bytes of values each); with a dense embedding it
writes the whole table. Both train through a real `psd serve` job (sgd).

    python benchmarks/sparse_push.py [--rows 256] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from psd import learner
from psd.arena import wait_for_job


class Table(torch.nn.Module):
    def __init__(self, rows: int, dim: int, sparse: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(rows, dim, sparse=sparse)
        self.out = torch.nn.Linear(dim, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).mean(1))


def measure(sparse: bool, table_rows: int, dim: int, touched: int, steps: int) -> dict:
    job = f"bench-sparse-{os.getpid()}-{int(sparse)}"
    server = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--job", job, "--learners", "1",
                               "--optimizer", "sgd", "--lr", "0.1", "--no-watchdog", "-q"])
    try:
        wait_for_job(job, 60, server.pid)
        model = Table(table_rows, dim, sparse)
        g = torch.Generator().manual_seed(0)
        push, step = [], []
        with learner.attach(model, job=job) as ps:
            for _ in range(steps):
                idx = torch.randint(table_rows, (touched // 8, 8), generator=g)
                t0 = time.perf_counter()
                model(idx).sum().backward()
                ps.step()
                step.append(time.perf_counter() - t0)
                push.append(ps.push_ns / 1e9)
            ps.flush()
        rows = len(torch.unique(idx))
        written = (8 + rows * (8 + 4 * dim)) if sparse else table_rows * dim * 4
        return {"sparse": sparse, "push_s_p50": statistics.median(push), "step_s_p50": statistics.median(step),
                "bytes_per_push": written + (dim * 2 + 2) * 4}
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table-rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rows", type=int, default=256, help="words per mini-batch")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    res = [measure(s, args.table_rows, args.dim, args.rows, args.steps) for s in (True, False)]
    print(json.dumps(res, indent=1))
    sp, de = res
    print(f"sparse / dense: bytes per push {sp['bytes_per_push'] / de['bytes_per_push']:.2e}, "
          f"push time {sp['push_s_p50'] / de['push_s_p50']:.3f}, step time {sp['step_s_p50'] / de['step_s_p50']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
