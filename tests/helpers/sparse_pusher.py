"""A learner with a sparse embedding table, for the rows-pull tests (tests/test_models.py).

    sparse_pusher.py JOB --rows LO HI --steps N --per-step R [--seed S]

Attaches ``Table()`` (a table with sparse gradients and a dense head; the same spec as the test's),
pushes N mini-batches each touching R rows drawn from [LO, HI), flushes (every push applied) and
prints "done N".
"""

import argparse

import torch

from psd import learner

ROWS, DIM = 20000, 16


class Table(torch.nn.Module):
    """An embedding table with sparse gradients and a small dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
        self.out = torch.nn.Linear(DIM, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).mean(1))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--rows", type=int, nargs=2, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--per-step", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    g = torch.Generator().manual_seed(a.seed)
    model = Table()
    with learner.attach(model, job=a.job) as ps:
        for _ in range(a.steps):
            idx = torch.randint(a.rows[0], a.rows[1], (1, a.per_step), generator=g)
            torch.nn.functional.cross_entropy(model(idx), torch.zeros(1, dtype=torch.long)).backward()
            ps.step()
        ps.flush()
    print(f"done {a.steps}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
