"""Momentum rules under a delayed gradient, on the matrix's real workloads, in one process (seconds a run).

    python benchmarks/delayed_momentum.py                    # the sweep: benchmarks/results/delayed_momentum.{md,json}
    python benchmarks/delayed_momentum.py --only cnn_edge:keep:4 --trace 1   # one run, its loss every update

benchmarks/delay_stability.py shows on a quadratic why no rule of the staleness alone serves both a small
lr and one near the edge of stability. This screens the mechanisms that might escape, on two of
benchmarks/matrix.py's workloads (the MLP at its small momentum lr, the BatchNorm CNN at the edge, lr 0.05),
before any of them goes into the server: one process trains with heavy-ball momentum 0.9 (torch.optim's
SGD arithmetic), each gradient computed on the weights of ``tau`` updates before (a fixed delay, what a job
of about tau + 1 learners measures; BatchNorm statistics carried on), at one process's lr, mini-batch,
epochs and seed. Rules (``momentum'``, ``lr'`` from ``tau``):

- ``off``: momentum and lr as given (``--async-momentum off``);
- ``auto``: momentum' = max(0, mu - tau / (1 + tau)) (psd's staleness rule: ``--async-momentum auto`` at
  gain level 0);
- ``keep``: momentum' / (1 - momentum') = max(0, mu / (1 - mu) - tau), lr' = lr (1 - momentum') / (1 - mu):
  a gradient's mean age and whole step stay one process's;
- ``watch``: ``keep`` after 64 updates of ``auto``, and ``auto`` for good once the fast running mean of the
  gradients' mean square (over 4 updates) passes 4 times its slow one (up over 128 updates, down over 8);
- ``probe``: from ``auto``, the gain raised toward ``keep``'s over 200 updates (level 0 to 1), halved
  (and the ramp slowed by 2) whenever the same watch fires (AIMD: hover below the edge);
- ``predict``: ``off``, the gradient taken on the weights moved on by ``tau`` momentum steps (``--predict``);
- ``local``: ``tau + 1`` learners in turn, each with its own momentum buffer, pushing ``lr * buffer`` to plain
  sgd (learner-side momentum);
- ``curv``: psd/gain.py's level between ``auto`` and ``keep``, from the sharpness measured here every
  ``--every`` updates, margin ``--margin``: the Hessian's largest eigenvalue (8 power iterations on
  autograd's Hessian-vector products; ``--along top``) or the curvature along the mini-batch's gradient
  (one product; ``--along grad``, what psd's learners measure now), or along the update (the momentum
  buffer; ``--along update``, screened and dropped: benchmarks/results/matrix/README.md), held as a maximum halving over
  ``--half-life`` updates (0: each reading as it comes);
- ``curvp``: ``curv`` with ``predict``'s extrapolation along the step the rule makes now (lr x its factor);
  ``curvpl``: the same extrapolation times the gain level (none at level 0, the staleness rule's);
- ``dc``: ``keep`` with DC-ASGD's delay compensation (Zheng et al. 2017), g + 2 g * g * (w_now - w_then);
  ``--dc LAMBDA`` adds the same compensation, g + LAMBDA g * g * (w_now - w_then), to any rule.

The metric is the matrix's (test accuracy); ``tau`` 0 with ``off`` is one process, the baseline.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import convergence_learner as cl  # noqa: E402
from matrix import WORKLOADS  # noqa: E402

from psd import gain  # noqa: E402
from psd.workloads import epoch_batches  # noqa: E402

RULES = ("off", "auto", "keep", "watch", "probe", "dc", "predict", "local", "curv", "curvp", "curvpl")
MU = 0.9


def auto_rule(tau: int) -> tuple[float, float]:
    return gain.rule(MU, tau, 0.0)  # the staleness rule (the server's level 0)


def keep_rule(tau: int) -> tuple[float, float]:
    return gain.rule(MU, tau, 1.0)  # the gain-keeping rule (level 1)


class Watch:
    """A signal's fast running mean (over 4 updates) against its slow one (64), both of its logarithm (a
    mini-batch's gradient spreads over decades: the mean of the logs is not thrown by one outlier); fires
    when the fast one passes ``ratio`` times the slow one, once 32 updates have set the slow one."""

    def __init__(self, ratio: float = 4.0) -> None:
        self.fast = self.slow = 0.0
        self.seen = 0
        self.log_ratio = math.log(ratio)

    @property
    def warm(self) -> bool:
        return self.seen > 32

    def fires(self, x: float) -> bool:
        lx = math.log(max(x, 1e-30))
        self.seen += 1
        if self.seen <= 32:
            self.slow += (lx - self.slow) / self.seen
            self.fast = self.first = self.slow
            return False
        self.fast += (lx - self.fast) / 4
        self.slow += (lx - self.slow) / 64
        return self.fast - self.slow > self.log_ratio


def sharpness(model: torch.nn.Module, loss: torch.Tensor, iters: int = 8, update: list | None = None) -> float:
    """The largest eigenvalue of the mini-batch loss's Hessian (power iteration on autograd's
    Hessian-vector products); with ``OPTS["along"]`` "grad", the curvature along the mini-batch's
    gradient instead (its Rayleigh quotient g.Hg / g.g: one product)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True)
    if OPTS["along"] == "grad":
        iters = 1
        v = [g.detach() for g in grads]
    elif OPTS["along"] == "update":  # along the update the optimizer makes: its momentum buffer
        iters = 1
        v = [u.to_dense() if u.is_sparse else u.clone() for u in update]
        if not sum(float((x * x).sum()) for x in v) > 0:
            return math.nan
    else:
        v = [torch.randn_like(p) for p in params]
    lam = 0.0
    for _ in range(iters):
        norm = math.sqrt(sum(float((x * x).sum()) for x in v))
        v = [x / norm for x in v]
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
        lam = sum(float((a * b).sum()) for a, b in zip(hv, v, strict=True))
        v = [h.detach() for h in hv]
    if OPTS["along"] in ("grad", "update"):
        return lam if lam > 0 else math.nan  # no curvature up along the gradient: no reading
    return abs(lam)


OPTS = {"ratio": 4.0, "angular": False, "signal": "grad", "progress": 0.0, "cut": 0.5, "slow_down": 0.5,
        "cap": 0.0, "margin": 1.5, "every": 20, "along": "top", "half_life": 0}


def run(workload: str, rule: str, tau: int, seed: int = 0, trace: int = 0) -> dict:
    """One training run; its metric, and where the watch fired."""
    w = WORKLOADS[workload]
    lr, batch, epochs = w["lr"]["momentum"], w["batch"], w["epochs"]
    torch.manual_seed(seed)
    data, model = cl.workload(workload, seed)
    worker = cl.workload(workload, seed)[1]
    params = list(model.parameters())
    bufs = [torch.zeros_like(p) for p in params]
    local = [[torch.zeros_like(p) for p in params] for _ in range(tau + 1)]
    history: collections.deque = collections.deque(maxlen=tau + 1)
    watch, cuts, level, rate = Watch(OPTS["ratio"]), [], 0.0, 1 / 200
    turn = Watch(OPTS["ratio"])  # the angular step |dw|^2 / |w|^2 (BatchNorm's scale-invariant weights)

    lam_lr = [0.0]

    def rule_now(t: int) -> tuple[float, float]:
        if rule in ("curv", "curvp", "curvpl") and tau:  # psd/gain.py's level, from this run's own measurement
            return gain.rule(MU, tau, gain.level(lam_lr[0], MU, tau, margin=OPTS["margin"]))
        if rule in ("off", "predict", "local") or tau == 0:
            return MU, 1.0
        if rule == "auto" or (rule == "watch" and (t < 64 or cuts)):
            return auto_rule(tau)
        if rule == "probe":
            mu, f = gain.rule(MU, tau, level)
            return mu, min(f, OPTS["cap"]) if OPTS["cap"] else f
        return keep_rule(tau)

    gen = torch.Generator().manual_seed(seed)
    t = 0
    for idx in epoch_batches(len(data.x_train), batch, epochs, gen):
        history.append([p.detach().clone() for p in params] + [b.clone() for b in bufs])
        with torch.no_grad():
            then = history[0]
            for q, old, ob in zip(worker.parameters(), then[:len(params)], then[len(params):], strict=True):
                q.copy_(old)
                if rule == "predict" and t:  # PipeOptim: along the momentum step, by the gradient's age
                    q.add_(ob, alpha=-lr * (len(history) - 1))
                elif rule == "curvp" and t:  # the same, along the step the gain rule makes now
                    q.add_(ob, alpha=-lr * rule_now(t)[1] * (len(history) - 1))
                elif rule == "curvpl" and t:  # ... as far as the gain level says: none at level 0
                    lvl = gain.level(lam_lr[0], MU, tau, margin=OPTS["margin"])
                    q.add_(ob, alpha=-lr * rule_now(t)[1] * (len(history) - 1) * lvl)
            for wb, mb in zip(worker.buffers(), model.buffers(), strict=True):
                wb.copy_(mb)
        if rule in ("curv", "curvp", "curvpl") and tau and t % OPTS["every"] == 0:
            model.train()
            saved = [b.clone() for b in model.buffers()]  # the measurement leaves BatchNorm's statistics
            now = lr * sharpness(model, cl.loss_of(workload, model, data.x_train[idx], data.y_train[idx]),
                                 update=bufs)
            if OPTS["half_life"]:  # the server's decaying maximum of the readings
                held = lam_lr[0] * 0.5 ** (OPTS["every"] / OPTS["half_life"])
                lam_lr[0] = max(now, held) if math.isfinite(now) else held
            elif math.isfinite(now):
                lam_lr[0] = now
            with torch.no_grad():
                for b, old in zip(model.buffers(), saved, strict=True):
                    b.copy_(old)
            model.zero_grad()
            if trace:
                print(f"  t {t} lr x sharpness {lam_lr[0]:.3f}", flush=True)
        worker.train()
        worker.zero_grad()
        loss = cl.loss_of(workload, worker, data.x_train[idx], data.y_train[idx])
        loss.backward()
        mu, f = rule_now(t)
        with torch.no_grad():
            for mb, wb in zip(model.buffers(), worker.buffers(), strict=True):
                mb.copy_(wb)
            grads = [q.grad.to_dense() if q.grad.is_sparse else q.grad for q in worker.parameters()]
            lam = OPTS.get("dc") or (2.0 if rule == "dc" else 0.0)
            if lam:
                grads = [g + lam * g * g * (p - q)
                         for g, p, q in zip(grads, params, worker.parameters(), strict=True)]
            ms = sum(float((g * g).sum()) for g in grads) / sum(p.numel() for p in params)
            dw2 = w2 = 0.0
            if rule == "local":  # each of tau + 1 learners its own momentum, pushed as its step
                own = local[t % (tau + 1)]
                for p, g, b in zip(params, grads, own, strict=True):
                    b.mul_(MU).add_(g)
                    p.add_(b, alpha=-lr)
            for p, g, b in zip(params, grads, bufs, strict=True):
                if rule == "local":
                    break
                if t == 0:
                    b.copy_(g)
                else:
                    b.mul_(mu).add_(g)
                p.add_(b, alpha=-lr * f)
                dw2 += float((b * b).sum()) * (lr * f) ** 2
                w2 += float((p * p).sum())
        t += 1
        if rule in ("watch", "probe") and tau and (rule == "probe" or (t >= 64 and not cuts)):
            fired = watch.fires(float(loss) if OPTS["signal"] == "loss" else ms)
            if OPTS["angular"]:
                fired = turn.fires(dw2 / w2) or fired
            if fired:
                cuts.append(t)
                if rule == "probe":
                    level, rate = level * OPTS["cut"], rate * OPTS["slow_down"]
                    watch.slow, turn.slow = watch.fast, turn.fast  # the lower level's own baselines
            elif rule == "probe" and watch.warm and watch.fast <= watch.slow and (
                    not OPTS["progress"] or watch.fast <= watch.first - OPTS["progress"]):
                # raised only while calm (and with --progress, once the signal fell below its first values)
                level = min(1.0, level + rate)
        if trace and t % trace == 0:
            print(f"  t {t} loss {float(loss):.3f} mean square {ms:.2e} momentum {mu:.3f} lr x {f:.2f}", flush=True)
    model.eval()
    metric = cl.score(workload, model, data)
    return {"workload": workload, "rule": rule, "tau": tau, "seed": seed, "metric": metric, "cuts": cuts[:8],
            "updates": t}


def table(rows: list[dict], argv: str) -> str:
    base = {(r["workload"], r["seed"]): r["metric"] for r in rows if r["tau"] == 0}
    taus = sorted({r["tau"] for r in rows if r["tau"]})
    lines = ["# Momentum rules under a delayed gradient (one process, benchmarks/delayed_momentum.py)", "",
             f"Command: `python benchmarks/delayed_momentum.py{' ' + argv if argv else ''}`. "
             "Test accuracy, the worst seed, and its gap to one process (tau 0) at the same seed in points; "
             "`cut at`: the updates where the watch fired (first seed).", ""]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        one = [base[k] for k in base if k[0] == wl]
        lines += [f"## {wl} (lr {WORKLOADS[wl]['lr']['momentum']}, momentum 0.9; one process "
                  f"{min(one):.4f}-{max(one):.4f})", "",
                  "| rule | " + " | ".join(f"tau {t}" for t in taus) + " |",
                  "| --- |" + " --- |" * len(taus)]
        for rule in [r for r in RULES if any(x["rule"] == r and x["workload"] == wl and x["tau"] for x in rows)]:
            cells = []
            for t in taus:
                rs = [r for r in rows if (r["workload"], r["rule"], r["tau"]) == (wl, rule, t)]
                if not rs:
                    cells.append("")
                    continue
                worst = min(rs, key=lambda r: r["metric"] - base[(wl, r["seed"])])
                gap = 100 * (worst["metric"] - base[(wl, worst["seed"])])
                cut = f", cut at {','.join(map(str, rs[0]['cuts'][:3]))}" if rs[0]["cuts"] else ""
                cells.append(f"{worst['metric']:.4f} ({gap:+.2f}{cut})")
            lines.append(f"| {rule} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="mlp,cnn_edge")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--taus", default="1,2,4,8")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--only", help="one run, workload:rule:tau")
    p.add_argument("--trace", type=int, default=0, help="print the loss every N updates")
    p.add_argument("--ratio", type=float, default=4.0, help="the watch fires at its fast mean this x its slow one")
    p.add_argument("--angular", action="store_true", help="the watch also follows the angular step |dw|^2 / |w|^2")
    p.add_argument("--cut", type=float, default=0.5, help="the probe's level times this when the watch fires")
    p.add_argument("--slow-down", type=float, default=0.5, help="the probe's ramp times this when the watch fires")
    p.add_argument("--cap", type=float, default=0.0, help="the probe's lr factor at most this (0: keep's)")
    p.add_argument("--margin", type=float, default=1.5, help="curv: the edge at least this x lr x sharpness")
    p.add_argument("--every", type=int, default=20, help="curv: the sharpness measured every N updates")
    p.add_argument("--along", choices=("top", "grad", "update"), default="top",
                   help="curv: the curvature measured: the Hessian's largest eigenvalue, along the gradient, or "
                        "along the update (the momentum buffer)")
    p.add_argument("--half-life", type=float, default=0,
                   help="curv: hold the largest reading, halving over this many updates (0: each as it comes)")
    p.add_argument("--progress", type=float, default=0.0,
                   help="the probe raises the gain only once the signal's log is this far below its first 32's")
    p.add_argument("--signal", choices=("grad", "loss"), default="grad",
                   help="what the watch follows: the gradients' mean square, or the mini-batch loss")
    p.add_argument("--dc", type=float, default=0.0,
                   help="add DC-ASGD's compensation with this lambda to any rule (0: none)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default="delayed_momentum", help="the results' file name (.md, .json)")
    args = p.parse_args()
    torch.set_num_threads(1)
    OPTS.update(ratio=args.ratio, angular=args.angular, signal=args.signal, progress=args.progress, cut=args.cut,
                slow_down=args.slow_down, cap=args.cap,
                margin=args.margin, every=args.every, along=args.along, half_life=args.half_life, dc=args.dc)
    if args.only:
        wl, rule, tau = args.only.split(":")
        print(json.dumps(run(wl, rule, int(tau), trace=args.trace)))
        return 0
    rows = []
    for wl in args.workloads.split(","):
        for seed in range(args.seeds):
            todo = [("off", 0)] + [(r, int(t)) for r in args.rules.split(",") for t in args.taus.split(",")]
            for rule, tau in todo:
                t0 = time.monotonic()
                r = run(wl, rule, tau, seed)
                r["seconds"] = round(time.monotonic() - t0, 1)
                rows.append(r)
                print(json.dumps(r), flush=True)
    md = table(rows, " ".join(sys.argv[1:]))
    (args.out / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
