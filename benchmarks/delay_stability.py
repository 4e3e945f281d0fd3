"""Why no momentum rule of the measured staleness alone serves both ends (issue: convergence by default).

    python benchmarks/delay_stability.py      # a second; writes benchmarks/results/delay_stability.md

One coordinate of a quadratic, f(w) = h w^2 / 2, trained by heavy-ball momentum SGD whose gradient is
`tau` updates old (asynchrony: it was computed on the weights before the last `tau` updates):

    m_t = mu m_{t-1} + h w_{t-tau}        w_{t+1} = w_t - lr m_t

The iteration is linear, so it converges exactly when the spectral radius of its companion matrix is
below 1. For each rule of choosing (mu, lr) from the staleness, this finds the largest `lr h` (the
job's learning rate times the curvature of its sharpest direction) that still converges, and each rule's
gain on flat directions, lr / (1 - mu) relative to one process's. One process (tau 0) converges up to
lr h = 2 (1 + mu) = 3.8 at momentum 0.9, and training at one process's learning rate tends to sit near
that edge (Cohen et al. 2021, "Gradient descent on neural networks typically occurs at the edge of
stability"). The rules:

- off: mu and lr as given (`--async-momentum off`);
- auto: mu' = max(0, mu - tau / (1 + tau)), lr as given (`--async-momentum auto`, the default);
- age: mu' / (1 - mu') = max(0, mu / (1 - mu) - tau), lr' = lr (1 - mu') / (1 - mu) (keeps the gain; the
  trial in benchmarks/results/matrix/README.md);
- predict: mu and lr as given, the gradient computed on w_{t-tau} - lr tau m_{t-tau-1} (`--predict`);
- sgd: no momentum at all, lr as given.

A rule that keeps one process's gain on flat directions (off, age, predict) converges only for lr h
below about 0.1 at tau 1 and 0.03 at tau 4: a job near one process's edge diverges. A rule that keeps
the edge high (auto, sgd) has a tenth of the gain: a job at a small lr moves ten times slower along its
flat directions (under-trained). Only a gradient computed on, or corrected to, the weights it is applied
to (delay compensation with the curvature itself) escapes; `predict`'s linear extrapolation helps little.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "results"
MU = 0.9
TAUS = (0, 1, 2, 4, 8)
RULES = ("off", "auto", "age", "predict", "sgd")


def rule_params(rule: str, mu: float, tau: int) -> tuple[float, float, bool]:
    """(momentum, lr factor, extrapolate) of a rule at staleness tau."""
    if rule == "auto":
        return max(0.0, mu - tau / (1 + tau)), 1.0, False
    if rule == "age":
        a = max(0.0, mu / (1 - mu) - tau)
        m = a / (1 + a)
        return m, (1 - m) / (1 - mu), False
    if rule == "sgd":
        return 0.0, 1.0, False
    return mu, 1.0, rule == "predict"


def spectral_radius(lr_h: float, mu: float, tau: int, predict: bool) -> float:
    """Spectral radius of the delayed heavy-ball iteration on one coordinate (lr folded into m)."""
    n = 2 * (tau + 1)  # state: w_t .. w_{t-tau}, then m_{t-1} .. m_{t-1-tau}
    a = torch.zeros(n, n, dtype=torch.float64)
    g = torch.zeros(n, dtype=torch.float64)  # the gradient (times lr) as a function of the state
    g[tau] = lr_h
    if predict:
        g[2 * tau + 1] = -tau * lr_h
    m_new = g.clone()
    m_new[tau + 1] += mu
    a[0] = -m_new
    a[0, 0] += 1.0
    a[tau + 1] = m_new
    for k in range(1, tau + 1):
        a[k, k - 1] = 1.0
        a[tau + 1 + k, tau + k] = 1.0
    return float(torch.linalg.eigvals(a).abs().max())


def edge(mu: float, lr_factor: float, tau: int, predict: bool) -> float:
    """The largest lr h (the job's lr, before the rule's factor) at which the iteration converges."""
    lo, hi = 0.0, 8.0
    if spectral_radius(hi * lr_factor, mu, tau, predict) < 1.0:
        return hi
    for _ in range(60):  # bisection: below the edge every smaller lr h converges too
        mid = (lo + hi) / 2
        if spectral_radius(mid * lr_factor, mu, tau, predict) < 1.0 - 1e-12:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--momentum", type=float, default=MU)
    ap.add_argument("--out", type=Path, default=OUT / "delay_stability.md")
    args = ap.parse_args()
    mu = args.momentum
    rows = []
    for rule in RULES:
        cells_edge, cells_gain = [], []
        for tau in TAUS:
            m, f, pred = rule_params(rule, mu, tau)
            cells_edge.append(f"{edge(m, f, tau, pred):.3g}")
            cells_gain.append(f"{f * (1 - mu) / (1 - m):.2f}")
        rows.append((rule, cells_edge, cells_gain))
    head = "| rule | " + " | ".join(f"tau {t}" for t in TAUS) + " |"
    sep = "| --- " * (len(TAUS) + 1) + "|"
    lines = [
        "# Delayed momentum: where it converges, and how fast it moves along flat directions",
        "",
        f"Command: `python benchmarks/delay_stability.py --momentum {mu}` (exact: eigenvalues of the linear "
        "iteration; the model and the rules are in the script's docstring).",
        "",
        f"Largest lr x curvature at which momentum {mu} converges with gradients `tau` updates old (one process: "
        "tau 0):",
        "",
        head, sep,
        *[f"| {r} | " + " | ".join(e) + " |" for r, e, _ in rows],
        "",
        "Gain along flat directions, lr' / (1 - mu'), relative to one process's lr / (1 - mu):",
        "",
        head, sep,
        *[f"| {r} | " + " | ".join(g) + " |" for r, _, g in rows],
        "",
        "Read together: every rule that keeps the gain (off, age, predict) has its edge fall from 3.8 to about "
        "0.1 at tau 1; every rule that keeps a high edge (auto, sgd) has a fraction of the gain. A rule of the "
        "staleness alone picks one of the two; which one a job needs depends on how close to its own edge its "
        "lr is, which the server does not see.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
