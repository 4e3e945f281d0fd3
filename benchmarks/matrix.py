"""The convergence matrix: psd at one process's hyper-parameters and default flags, against one process.

    python benchmarks/matrix.py                       # the whole matrix (hours on 2 cores; resumable)
    python benchmarks/matrix.py --workloads mlp --seeds 2 --plan learners   # one slice
    python benchmarks/matrix.py --report              # tables and plot from what has been run

Axes: five workloads of different kinds (benchmarks/convergence_learner.py: an MLP, a BatchNorm CNN on
real digits, a logistic model, a character-level LSTM language model on real text, a bag of sparse
embeddings), every server optimizer torch.optim has a counterpart for (sgd, momentum, nesterov, adam, adamw,
adagrad; the sparse workload: those torch.optim takes sparse gradients in), and these set-ups (``--plan``):

- ``learners``: 1, 2, 4 and 8 learners, asp (the default);
- ``sync``: 4 learners with --sync ssp:2 and kasync:2;
- ``nodes``: 2 nodes x 2 learners (psd run --nnodes 2, the node link's defaults).

Each set-up runs at ``--seeds`` seeds (data split, initial weights and shuffles). The baseline is one
process with torch.optim at the same lr, mini-batch and passes over the data, at the same seeds; its
metric after every epoch is kept, to show the workload does not saturate (the baseline still improves in
its last epoch). A cell's gap is per seed, psd's final model (as `psd export` gives it; the nodes set-up:
the mean of its learners' models after their last pull) against the baseline at that seed: points of
accuracy, or relative test loss for the language model. The band: -1 point, +2% loss; a run whose
metric is not finite, or no better than the untrained model, has diverged. The worst seed is the cell's
figure.

The noise floor: at each seed one process also trains with its mini-batches drawn in another order (same
split, initial weights, lr; ``kind`` "reorder"), and each cell shows that run's gap to the baseline, worst
over the cell's seeds, beside psd's. A cell whose psd gap is no worse than one process's against itself is
"within noise": on the small test sets (360 digits, 500 embedding samples: a point is 3.6 and 5 samples) the
band can be narrower than the spread of one process's own final model. ``--orders K`` trains one process in
K other orders at each seed (the first is the noise floor's); the report's last table, the calibration, counts
how often those runs leave the band of the baseline at their seed, beside the share of psd's runs with several
learners that do: where one process leaves its own band often, a cell out of band says little of asynchrony.

The learners' order: at each seed and learner count (every node's learners counted) one process also trains
on exactly the mini-batches the learners draw, taken in turn (``kind`` "order";
``convergence_learner.learners_order``): the learners' data order without their staleness. Each cell
shows that run's gap to the baseline and psd's gap to it at the same seed ("psd against the learners'
order", worst seed): what asynchrony itself costs, apart from which samples came last. A cell of one
learner has no such run (its order is the baseline's).

Every run is appended to ``<out>/matrix.jsonl`` as it ends, and a run already there is not run again:
an interrupted matrix goes on where it stopped (``--fresh`` starts over). ``--flags`` adds server flags to
every psd run (a mechanism under trial), recorded under ``--label`` (one flag alone: ``--flags=--predict``,
or argparse takes it for an option of its own). Results: ``<out>/matrix-LABEL.{json,md,png}``,
written beside the old ones and moved over them only once all three are done; every run line records the
machine it ran on (``machine``), and the report lists them. ``--fresh`` writes its runs into a new log that
replaces ``matrix.jsonl`` only when the whole matrix has run: an interrupted ``--fresh`` leaves the old log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
import convergence_learner as cl  # noqa: E402

from psd.bench.record import command_line, machine, machine_line, require_matplotlib, staged  # noqa: E402

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "adagrad")
# Per workload: epochs, mini-batch, and one process's learning rate per optimizer. Sized so that the
# baseline still improves in its last epoch (the matrix checks it) and a run takes seconds.
WORKLOADS: dict[str, dict] = {
    "mlp": {"epochs": 3, "batch": 4, "lr": {"sgd": 0.008, "momentum": 0.001, "nesterov": 0.001, "adam": 0.0004,
                                             "adamw": 0.0004, "adagrad": 0.008}},
    "cnn": {"epochs": 3, "batch": 8, "lr": {"sgd": 0.02, "momentum": 0.004, "nesterov": 0.004, "adam": 0.0005,
                                             "adamw": 0.0005, "adagrad": 0.003}},
    # The same CNN at one process's large learning rate (the README's optimizer table): not sized to keep
    # improving, but near the edge of stability, where a delayed gradient with full momentum diverges
    # (benchmarks/delay_stability.py).
    "cnn_edge": {"epochs": 5, "batch": 8, "lr": {"momentum": 0.05, "nesterov": 0.05}},
    # The same CNN at the same learning rates, annealed to 0 over the run (convergence_learner.SCHEDULE): one
    # process's last weights settle, where at a constant lr its final accuracy swings by points from one data
    # order to the next (the README, "The band against one process itself").
    "cnn_cos": {"epochs": 3, "batch": 8, "lr": {"sgd": 0.02, "momentum": 0.004, "nesterov": 0.004, "adam": 0.0005,
                                                 "adamw": 0.0005, "adagrad": 0.003}},
    "logistic": {"epochs": 3, "batch": 4, "lr": {"sgd": 0.0015, "momentum": 0.00015, "nesterov": 0.00015,
                                                  "adam": 0.0003, "adamw": 0.0003, "adagrad": 0.006}},
    "lm": {"epochs": 3, "batch": 8, "lr": {"sgd": 0.5, "momentum": 0.05, "nesterov": 0.05, "adam": 0.003,
                                            "adamw": 0.003, "adagrad": 0.05}},
    # torch.optim takes sparse gradients in SGD (with or without momentum) and Adagrad, not in Adam(W)
    "embed": {"epochs": 2, "batch": 4, "lr": {"sgd": 0.5, "momentum": 0.05, "nesterov": 0.05, "adagrad": 0.05}},
}
PLANS = {"learners": [(1, "asp", 1), (2, "asp", 1), (4, "asp", 1), (8, "asp", 1)],
         "sync": [(4, "ssp:2", 1), (4, "kasync:2", 1)],
         "nodes": [(2, "asp", 2)]}  # (learners a node, --sync, nodes)
BAND = {"accuracy": -0.01, "loss": 0.02}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _learner_cmd(workload: str, seed: int, w: dict) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / "convergence_learner.py"), "--workload", workload,
            "--epochs", str(w["epochs"]), "--batch-size", str(w["batch"]), "--seed", str(seed)]


def job_updates(workload: str, learners: int, sync: str, nodes: int, seed: int, node: int = 0) -> int:
    """The updates node ``node``'s server makes in a cell: its learners' mini-batches (every node's learners
    share the data; node n's are ranks n x learners + r), one update per gradient, or per K of them under
    kasync:K. A schedule's ``--t-max``: what one process's steps are to its own schedule."""
    w = WORKLOADS[workload]
    n_train = len(cl.workload(workload, seed)[0].x_train)
    world = learners * nodes
    grads = sum(len(cl.learner_batches(n_train, node * learners + r, world, w["batch"], w["epochs"], seed))
                for r in range(learners))
    k = int(sync.split(":")[1]) if sync.startswith("kasync:") else 1
    return grads // k


def _server_flags(workload: str, opt: str, learners: int, sync: str, nodes: int, seed: int,
                  flags: list[str], node: int = 0) -> list[str]:
    schedule = cl.SCHEDULE.get(workload)
    return ["--lr", repr(WORKLOADS[workload]["lr"][opt]), "--optimizer", opt,
            *(["--sync", sync] if sync != "asp" else []),
            *(["--schedule", schedule, "--t-max", str(job_updates(workload, learners, sync, nodes, seed, node))]
              if schedule else []), *flags]


def _popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_psd(workload: str, opt: str, learners: int, sync: str, nodes: int, seed: int, flags: list[str],
            start=_popen) -> dict:
    """One psd run of a cell; its final metric and what the server measured. ``start(cmd, env)`` starts each
    learner (``cmd``: ``python benchmarks/convergence_learner.py ...``) and returns what answers
    ``communicate`` and ``returncode`` as a ``subprocess.Popen`` with text pipes does (the single-node set-ups;
    tests/test_matrix.py forks them from a process that has imported torch)."""
    from psd import learner
    from psd.status import job_status

    w = WORKLOADS[workload]
    job = f"matrix-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as state:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", XDG_STATE_HOME=state)
        if nodes > 1:
            port = _port()
            procs = [subprocess.Popen(
                [sys.executable, "-m", "psd.cli", "run", "--job", f"{job}-{r}", "--learners", str(learners),
                 "--nnodes", str(nodes), "--node-rank", str(r), "--master-port", str(port), "--checkpoint-every",
                 "0", "-q", *_server_flags(workload, opt, learners, sync, nodes, seed, flags, r),
                 "--", *_learner_cmd(workload, seed, w)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for r in range(nodes)]
            outs = []
            for p in procs:
                out, err = p.communicate(timeout=3600)
                if p.returncode != 0:
                    raise RuntimeError(f"psd run exited {p.returncode}:\n{err[-3000:]}")
                outs += [json.loads(line[line.index("{"):]) for line in out.splitlines() if '"metric"' in line]
            if len(outs) != nodes * learners:
                raise RuntimeError(f"{len(outs)} of {nodes * learners} learners reported")
            return {"metric": statistics.mean(o["metric"] for o in outs), "seconds": round(time.monotonic() - t0, 1),
                    "scored": "learners' mean"}
        with serving(job, workload, opt, learners, sync, seed, flags, env, start) as procs:
            for p in procs:
                out, err = p.communicate(timeout=3600)
                if p.returncode != 0:
                    raise RuntimeError(f"a learner exited {p.returncode}:\n{err[-3000:]}")
            st = job_status(job)
            data, model = cl.workload(workload, seed)
            model.load_state_dict(learner.pull_state_dict(job))  # the job's model, as `psd export` gives it
            return {"metric": cl.score(workload, model, data), "seconds": round(time.monotonic() - t0, 1),
                    "scored": "job's model", "staleness_mean": round(st["staleness_mean"], 2),
                    "updates": st["clock"], "lr_now": st["lr_now"]}


@contextlib.contextmanager
def serving(job: str, workload: str, opt: str, learners: int, sync: str, seed: int, flags: list[str],
            env: dict[str, str], start=_popen, server_stderr=subprocess.PIPE) -> Iterator[list]:
    """A one-node cell running: ``psd serve`` for ``job`` with the cell's server flags, and its learners started
    with ``start`` (see ``run_psd``), which it yields; the server is stopped on the way out. benchmarks/
    trace_gain.py runs its cell with it too."""
    from psd.arena import wait_for_job

    w = WORKLOADS[workload]
    # In this tree: `python -m` puts the working directory first on the path, and a server started from
    # another checkout would run that checkout's psd (benchmarks/matrix_ab.py compares two trees)
    server = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--quiet", "--job", job, "--learners",
                               str(learners), *_server_flags(workload, opt, learners, sync, 1, seed, flags)], env=env,
                              stderr=server_stderr, text=True, cwd=ROOT)
    try:
        wait_for_job(job, timeout=60, server_pid=server.pid)
        yield [start([*_learner_cmd(workload, seed, w), "--job", job, "--rank", str(r), "--world", str(learners)],
                     env) for r in range(learners)]
    finally:
        server.terminate()
        server.wait(timeout=120)


def cells(workloads: list[str], optimizers: list[str], plans: list[str]) -> list[tuple]:
    out = []
    for wl in workloads:
        for opt in optimizers:
            if opt not in WORKLOADS[wl]["lr"]:
                continue
            for plan in plans:
                for learners, sync, nodes in PLANS[plan]:
                    out.append((wl, opt, learners, sync, nodes))
    return out


def _order(r: dict) -> int | None:
    """A reorder run's order (a log's line from before orders: 1); None for any other run."""
    return r.get("order", 1) if r["kind"] == "reorder" else None


def _key(r: dict) -> tuple:
    return (r["label"], r["kind"], r["workload"], r["optimizer"], r.get("learners"), r.get("sync"), r.get("nodes"),
            r["seed"], _order(r))


def _baselines(runs: list[dict]) -> dict[tuple, dict]:
    """The baseline run of each (workload, optimizer, seed)."""
    return {(r["workload"], r["optimizer"], r["seed"]): r for r in runs if r["kind"] == "baseline"}


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def diverged(metric_kind: str, value: float, untrained: float) -> bool:
    if not math.isfinite(value):
        return True
    return value <= untrained + 0.02 if metric_kind == "accuracy" else value >= untrained


def summarize(runs: list[dict], label: str) -> list[dict]:
    """One row per cell: the psd metric's median and worst over seeds, the gap per seed, the band."""
    base = _baselines(runs)
    reorder = {(r["workload"], r["optimizer"], r["seed"]): r for r in runs if _order(r) == 1}
    own_order = {(r["workload"], r["optimizer"], r["learners"], r["seed"]): r for r in runs if r["kind"] == "order"}
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["kind"] == "psd" and r["label"] == label:
            groups.setdefault((r["workload"], r["optimizer"], r["learners"], r["sync"], r["nodes"]), []).append(r)
    rows = []
    for (wl, opt, n, sync, nodes), rs in groups.items():
        kind = cl.METRIC[wl]
        gaps, noise, b_vals, worst_div = [], [], [], False
        order_gaps, against_order = [], []  # the learners' order against the baseline; psd against it
        # A run psd refused (an error, no metric) is no divergence: the cell names the refusal instead.
        refused = next((r["error"].strip().splitlines()[-1] for r in rs if r.get("error")), None)
        for r in rs:
            b = base.get((wl, opt, r["seed"]))
            if b is None:
                continue
            b_vals.append(b["curve"][-1])
            worst_div |= diverged(kind, r["metric"], b["untrained"])
            gaps.append(_gap(kind, r["metric"], b["curve"][-1]))
            o = reorder.get((wl, opt, r["seed"]))
            if o is not None:
                noise.append(_gap(kind, o["curve"][-1], b["curve"][-1]))
            # one learner's order is the baseline's own; several: one process on their batches
            lo = b if n * nodes == 1 else own_order.get((wl, opt, n * nodes, r["seed"]))
            if lo is not None:
                order_gaps.append(_gap(kind, lo["curve"][-1], b["curve"][-1]))
                against_order.append(_gap(kind, r["metric"], lo["curve"][-1]))
        if not gaps:
            continue
        pick = min if kind == "accuracy" else max  # the worst of some gaps
        worst = pick(gaps)
        noise_worst = pick(noise) if len(noise) == len(gaps) else None
        in_band = not worst_div and not refused and _within(kind, worst, BAND[kind])
        whole = len(against_order) == len(gaps)
        order_worst, against_worst = (pick(order_gaps), pick(against_order)) if whole else (None, None)
        vals = [r["metric"] for r in rs]
        improving = [b["curve"][-1] > b["curve"][-2] if kind == "accuracy" else b["curve"][-1] < b["curve"][-2]
                     for b in (base[(wl, opt, r["seed"])] for r in rs if (wl, opt, r["seed"]) in base)
                     if len(b["curve"]) > 1]
        rows.append({"workload": wl, "metric": kind, "optimizer": opt, "learners": n, "sync": sync, "nodes": nodes,
                     "seeds": len(gaps), "baseline_median": statistics.median(b_vals),
                     "psd_median": statistics.median(vals),
                     "psd_worst": min(vals) if kind == "accuracy" else max(vals), "gap_median": statistics.median(gaps),
                     "gap_worst": worst, "diverged": worst_div and not refused, "refused": refused,
                     "in_band": in_band, "noise_worst": noise_worst,
                     "order_worst": order_worst, "against_order_worst": against_worst,
                     "against_order_in_band": against_worst is not None and not worst_div and not refused
                     and _within(kind, against_worst, BAND[kind]),
                     "within_noise": in_band or (noise_worst is not None and not worst_div and not refused
                                                 and _within(kind, worst, noise_worst)),
                     "baseline_still_improving": f"{sum(improving)}/{len(improving)}",
                     "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in rs)})
    order = {k: i for i, k in enumerate(WORKLOADS)}
    rows.sort(key=lambda x: (order[x["workload"]], OPTIMIZERS.index(x["optimizer"]), x["nodes"], x["sync"],
                             x["learners"]))
    return rows


def calibration(runs: list[dict], label: str) -> list[dict]:
    """The band against one process itself, per workload and optimizer: of one process's runs with its
    mini-batches in other orders (``kind`` "reorder", every order recorded), how many fall out of the band
    of the baseline at their seed, and the chance that a cell of one such run at each seed would (1 minus the
    product over the seeds of each seed's share in band: a seed whose baseline is a lucky draw weighs as it
    does in a cell); beside it, the same share of psd's runs under ``label`` with several learners (every
    set-up pooled; a diverged run is out of band, a refused one counts for nothing), each against the
    baseline at its seed. A workload whose one process leaves its own band often measures
    the spread of its final model as much as asynchrony."""
    base = _baselines(runs)
    out: dict[tuple, dict] = {}
    for r in runs:
        one = r["kind"] == "reorder"
        several = r["kind"] == "psd" and r["label"] == label and r["learners"] * r["nodes"] > 1
        b = base.get((r["workload"], r["optimizer"], r["seed"]))
        if not (one or several) or b is None or (several and (r.get("error") or "metric" not in r)):
            continue
        kind = cl.METRIC[r["workload"]]
        value = r["curve"][-1] if one else r["metric"]
        c = out.setdefault((r["workload"], r["optimizer"]), {"one": [], "psd": [], "kind": kind, "seeds": {}})
        gap = _gap(kind, value, b["curve"][-1])  # NaN or inf where the run diverged: out of band below
        c["one" if one else "psd"].append(gap)
        if one:
            c["seeds"].setdefault(r["seed"], []).append(_within(kind, gap, BAND[kind]))
    rows = []
    order = {k: i for i, k in enumerate(WORKLOADS)}
    for (wl, opt), c in sorted(out.items(), key=lambda kv: (order[kv[0][0]], OPTIMIZERS.index(kv[0][1]))):
        if not c["one"]:
            continue
        kind, pick = c["kind"], (min if c["kind"] == "accuracy" else max)
        share = sum(not x for ins in c["seeds"].values() for x in ins) / len(c["one"])
        cell_in = math.prod(sum(ins) / len(ins) for ins in c["seeds"].values())
        psd_share = (sum(not _within(kind, g, BAND[kind]) for g in c["psd"]) / len(c["psd"])) if c["psd"] else None
        rows.append({"workload": wl, "metric": kind, "optimizer": opt, "runs": len(c["one"]),
                     "gap_median": statistics.median(c["one"]), "gap_worst": pick(c["one"]), "out_share": share,
                     "seeds": len(c["seeds"]), "cell_out": 1 - cell_in, "psd_runs": len(c["psd"]),
                     "psd_out_share": psd_share})
    return rows


def calibration_table(rows: list[dict]) -> str:
    """``calibration``'s rows as markdown."""
    out = ["## The band against one process itself", "",
           "One process with its mini-batches in other orders (same split, initial weights and lr), each run against "
           "the baseline at its seed: how often it leaves the band, and the chance that a cell of one such run at "
           "each seed would (from each seed's share); beside it, the share of psd's runs with several learners "
           "(every set-up) out of the band.", "",
           "| workload | optimizer | runs of one process | seeds | gap median | gap worst | out of band | a cell of "
           "them out | psd runs | psd out of band |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in rows:
        psd = "-" if x["psd_out_share"] is None else f"{100 * x['psd_out_share']:.0f}%"
        out.append(f"| {x['workload']} ({x['metric']}) | {x['optimizer']} | {x['runs']} | {x['seeds']} | "
                   f"{_fmt_gap(x, x['gap_median'])} | {_fmt_gap(x, x['gap_worst'])} | {100 * x['out_share']:.0f}% | "
                   f"{100 * x['cell_out']:.0f}% | {x['psd_runs']} | {psd} |")
    return "\n".join(out) + "\n"


def _within(kind: str, gap: float, limit: float) -> bool:
    """A gap no worse than ``limit`` (a band or a floor), up to float32's rounding of the scores: one test sample
    of 500 is 0.2 points, which float32 reads as 0.2000000x."""
    return gap >= limit - 1e-6 if kind == "accuracy" else gap <= limit + 1e-6


def _gap(kind: str, value: float, baseline: float) -> float:
    """A run's gap to the baseline: accuracy points (as a fraction), or relative loss (inf: not finite)."""
    if kind == "accuracy":
        return value - baseline
    return value / baseline - 1 if math.isfinite(value) else math.inf


def _why(x: dict) -> str:
    if x.get("refused"):
        return f" (refused: {x['refused'][:160]})"
    return " (diverged)" if x["diverged"] else ""


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _fmt_gap(x: dict, g: float) -> str:
    return f"{g * 100:+.2f} pt" if x["metric"] == "accuracy" else f"{g * 100:+.1f}%"


def machines(runs: list[dict], label: str) -> list[str]:
    """The machines the runs under ``label`` (and their baselines) ran on, one line each, oldest first."""
    seen = [machine_line(r.get("machine")) for r in runs if r.get("label") in (label, "baseline")]
    return list(dict.fromkeys(seen))


def table(rows: list[dict], label: str, flags: str, hosts: list[str] | None = None, command: str | None = None) -> str:
    """The matrix under ``label`` as markdown, one row per cell, headed by the machines its runs ran on and
    the command that wrote it (the runs may come from several commands: the log keeps each)."""
    command = command or "python benchmarks/matrix.py" + (f" --label {label} --flags '{flags}'" if flags else "")
    out = [f"# Convergence matrix: `{label}`" + (f" (server flags `{flags}`)" if flags else " (default flags)"), "",
           *(["Machines: " + "; ".join(hosts) + ".", ""] if hosts else []),
           f"Command: `{command}`. "
           "Gap per seed against one process with torch.optim at the same lr, mini-batch and passes over the "
           "data: accuracy points, or relative test loss (lm). Band: -1 pt, +2% loss; the worst seed counts. "
           "Noise floor: one process against itself with its mini-batches in another order, worst over the same "
           "seeds; within noise: in band, or no worse than that. The learners' order: one process on the "
           "mini-batches the learners draw, taken in turn, its gap to the baseline (worst seed); psd against "
           "it: psd's gap to that run at the same seed (worst seed), what asynchrony costs apart from the data "
           "order, and whether that is within the band.", ""]
    bad = [x for x in rows if not x["in_band"]]
    if rows:
        worst_acc = min((x for x in rows if x["metric"] == "accuracy"), key=lambda x: x["gap_worst"], default=None)
        worst_lm = max((x for x in rows if x["metric"] == "loss"), key=lambda x: x["gap_worst"], default=None)
        out.append(f"{len(rows)} cells, {len(rows) - len(bad)} in band, "
                   f"{sum(x.get('within_noise', False) for x in rows)} within noise, "
                   f"{sum(x.get('against_order_in_band', False) for x in rows)} within the band of one process on "
                   f"the learners' own batches, "
                   f"{sum(x['diverged'] for x in rows)} with a diverged seed, "
                   f"{sum(bool(x.get('refused')) for x in rows)} refused by psd.")
        for w in (worst_acc, worst_lm):
            if w:
                out.append(f"Worst {w['metric']} cell: {w['workload']} {w['optimizer']} {w['nodes']}x{w['learners']} "
                           f"{w['sync']}: {_fmt_gap(w, w['gap_worst'])}.")
        out.append("")
    out += ["| workload | optimizer | nodes x learners | sync | seeds | one process | psd median | psd worst | "
            "gap median | gap worst | noise floor | in band | within noise | learners' order | "
            "psd against it | in band against it | baseline improving in last epoch | staleness |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
            "| --- |"]
    for x in rows:
        out.append(f"| {x['workload']} ({x['metric']}) | {x['optimizer']} | {x['nodes']}x{x['learners']} | "
                   f"{x['sync']} | {x['seeds']} | {x['baseline_median']:.4f} | {x['psd_median']:.4f} | "
                   f"{x['psd_worst']:.4f} | {_fmt_gap(x, x['gap_median'])} | {_fmt_gap(x, x['gap_worst'])} | "
                   f"{'-' if x.get('noise_worst') is None else _fmt_gap(x, x['noise_worst'])} | "
                   f"{'yes' if x['in_band'] else '**no**' + _why(x)} | "
                   f"{_yes(x.get('within_noise', False))} | "
                   f"{'-' if x.get('order_worst') is None else _fmt_gap(x, x['order_worst'])} | "
                   f"{'-' if x.get('against_order_worst') is None else _fmt_gap(x, x['against_order_worst'])} | "
                   f"{'-' if x.get('against_order_worst') is None else _yes(x['against_order_in_band'])} | "
                   f"{x['baseline_still_improving']} | {x['staleness_mean']:.1f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path, label: str) -> None:
    """The worst seed of every cell as a bar (main() checked for matplotlib before the runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.22), 4.5))
    ys = [(x["gap_worst"] * 100) if x["metric"] == "accuracy" else -x["gap_worst"] * 100 for x in rows]
    ax.bar(range(len(rows)), [max(-20, y) for y in ys],
           color=["tab:blue" if x["in_band"] else "tab:red" for x in rows])
    noise = [(i, (x["noise_worst"] * 100) if x["metric"] == "accuracy" else -x["noise_worst"] * 100)
             for i, x in enumerate(rows) if x.get("noise_worst") is not None]
    if noise:
        ax.scatter([i for i, _ in noise], [max(-20, y) for _, y in noise], marker="_", s=60, color="black",
                   label="one process, another order (worst seed)", zorder=3)
    own = [(i, (x["order_worst"] * 100) if x["metric"] == "accuracy" else -x["order_worst"] * 100)
           for i, x in enumerate(rows) if x.get("order_worst") is not None]
    if own:
        ax.scatter([i for i, _ in own], [max(-20, y) for _, y in own], marker=".", s=14, color="tab:green",
                   label="one process on the learners' batches (worst seed)", zorder=3)
    if noise or own:
        ax.legend(fontsize=7, loc="lower left")
    ax.axhline(-1, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)), [f"{x['workload']} {x['optimizer']} {x['nodes']}x{x['learners']} {x['sync']}"
                                     for x in rows], rotation=90, fontsize=6)
    ax.set_ylabel("worst seed vs one process\n(accuracy points; lm: -% loss)")
    ax.set_title(f"convergence matrix ({label}); red: out of band; floor -20")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--plan", default=",".join(PLANS), help=f"set-ups: {', '.join(PLANS)}")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--flags", default="", help="server flags added to every psd run (a mechanism under trial)")
    p.add_argument("--label", default="default", help="the name the runs are recorded under")
    p.add_argument("--out", type=Path, default=OUT / "matrix")
    p.add_argument("--report", action="store_true", help="only write the tables and plot from the runs recorded")
    p.add_argument("--references-only", action="store_true",
                   help="run only the one-process references of the cells asked for (baseline, another order, "
                        "the learners' order), not psd")
    p.add_argument("--orders", type=int, default=1,
                   help="one process's runs in other orders of its mini-batches at each seed: the first is the "
                        "noise floor, all of them the calibration of the band (how often one process fails it)")
    p.add_argument("--fresh", action="store_true", help="forget the runs recorded under --out")
    p.add_argument("--no-plots", action="store_true", help="write the report's JSON and table only (no matplotlib)")
    args = p.parse_args()
    # stopped with SIGTERM (kill, timeout): exit through the finally blocks that stop the psd servers started
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.orders < 1:
        p.error(f"--orders must be 1 or more, not {args.orders}")
    if args.fresh and args.report:
        p.error("--fresh forgets the runs that --report would report: give one of them")
    if not args.no_plots:  # the report's plot: checked before hours of runs
        require_matplotlib("benchmarks/matrix.py (or pass --no-plots)", args.out)
    import torch

    from psd.cli import finite_json

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    committed_log = args.out / "matrix.jsonl"
    # --fresh: the runs go into a log of their own, which replaces the committed one once the matrix is done.
    log = args.out / f".matrix.jsonl.fresh-{os.getpid()}" if args.fresh else committed_log
    runs = [] if args.fresh else load(log)
    done = {_key(r) for r in runs}
    flags = args.flags.split()
    host = machine()

    def record(r: dict) -> None:
        r = {**r, "machine": host}
        runs.append(r)
        done.add(_key(r))
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")  # NaN, for a diverged run, is read back by load()
        print(json.dumps(r), flush=True)

    try:
        _run_matrix(args, record, done, flags)
    except BaseException:
        if args.fresh:
            log.unlink(missing_ok=True)
        raise
    if args.fresh and log.exists():
        os.replace(log, committed_log)
    rows = summarize(runs, args.label)
    calib = calibration(runs, args.label)
    hosts = machines(runs, args.label)
    result = {"label": args.label, "flags": args.flags, "cpus": os.cpu_count(), "machine": host,
              "machines": hosts, "command": command_line(), "rows": rows, "calibration": calib}
    report = table(rows, args.label, args.flags, hosts, result["command"]) + "\n" + calibration_table(calib)
    with staged(args.out) as out:  # the report's three files replace the old ones together
        out.write_text(f"matrix-{args.label}.json", json.dumps(finite_json(result), indent=1, allow_nan=False) + "\n")
        out.write_text(f"matrix-{args.label}.md", report)
        if not args.no_plots:
            plot(rows, out.path(f"matrix-{args.label}.png"), args.label)
    print(report)
    return 0


def _run_matrix(args: argparse.Namespace, record, done: set, flags: list[str]) -> None:
    """Every run ``args`` asks for that ``done`` does not hold, each passed to ``record`` as it ends."""
    if not args.report:
        todo = cells(args.workloads.split(","), args.optimizers.split(","), args.plan.split(","))
        for wl, opt in dict.fromkeys((c[0], c[1]) for c in todo):
            w = WORKLOADS[wl]
            for seed in range(args.seeds):
                b = {"label": "baseline", "kind": "baseline", "workload": wl, "optimizer": opt, "seed": seed}
                if _key(b) not in done:
                    data, model = cl.workload(wl, seed)
                    untrained = cl.score(wl, model, data)
                    curve = cl.train_single_curve(wl, opt, w["lr"][opt], w["batch"], w["epochs"], seed)
                    record({**b, "lr": w["lr"][opt], "untrained": untrained, "curve": curve})
                for order in range(1, args.orders + 1):  # one process, its mini-batches in other orders
                    o = {**b, "kind": "reorder", "order": order}
                    if _key(o) not in done:
                        curve = cl.train_single_curve(wl, opt, w["lr"][opt], w["batch"], w["epochs"], seed, order=order)
                        record({**o, "lr": w["lr"][opt], "curve": curve})
        for wl, opt, world in dict.fromkeys((c[0], c[1], c[2] * c[4]) for c in todo if c[2] * c[4] > 1):
            w = WORKLOADS[wl]
            for seed in range(args.seeds):  # the learners' order: one process on their batches
                o = {"label": "baseline", "kind": "order", "workload": wl, "optimizer": opt, "learners": world,
                     "seed": seed}
                if _key(o) not in done:
                    curve = cl.train_single_curve(wl, opt, w["lr"][opt], w["batch"], w["epochs"], seed, world=world)
                    record({**o, "lr": w["lr"][opt], "curve": curve})
        for wl, opt, n, sync, nodes in [] if args.references_only else todo:
            for seed in range(args.seeds):
                r = {"label": args.label, "kind": "psd", "workload": wl, "optimizer": opt, "learners": n,
                     "sync": sync, "nodes": nodes, "seed": seed}
                if _key(r) in done:
                    continue
                try:
                    out = run_psd(wl, opt, n, sync, nodes, seed, flags)
                except RuntimeError as e:
                    out = {"metric": math.nan, "error": str(e)[-2000:]}
                record({**r, "flags": args.flags, **out})


if __name__ == "__main__":
    sys.exit(main())
