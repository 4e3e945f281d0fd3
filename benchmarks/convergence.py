"""Convergence study: does asynchronous training through psd reach single-learner accuracy?

    python benchmarks/convergence.py            # the whole study (about 10 minutes on 2 cores)
    python benchmarks/convergence.py --quick    # a smoke run: fewer settings

Part 1 (grid): 1, 2, 4, 8 learners x mini-batch 1, 2, 4, 8, plain SGD in `asp`,
each learner on its shard, 3 epochs, against one process running SGD on the
same data, model, initial weights and mini-batch for the same epochs.

Part 2 (stress): a setting where plain `asp` loses accuracy (8 learners at mini-batch 8,
momentum SGD at a large learning rate: the stale momentum overshoots), run
again with each staleness control: --staleness-lr, ssp, --predict, bsp (each
with --async-momentum off, as measured before that default existed), and
with the default (--async-momentum auto).

The data ship with psd (psd.workloads: generated from a seed). Results go to
benchmarks/results/convergence.{json,md,png}; every figure is a test accuracy.

    python benchmarks/convergence.py --optimizers [--quick]   # only part 3 (about 15 minutes; --quick 3)

Part 3 (optimizers): momentum, nesterov and adam with psd's default flags
(asp, --async-momentum auto) against one process running torch.optim at the
same learning rate, mini-batch and epochs, x learners x mini-batch, on two
workloads: the MLP above and a BatchNorm CNN on scikit-learn's 8x8 digits
(benchmarks/convergence_learner.py; needs scikit-learn). psd is scored on the
job's final model as `psd export` gives it (weights and merged BatchNorm
statistics, loaded strictly). `--seeds K` averages each cell over K seeds, for
psd and one process alike; `--only mlp:momentum:4:2,cnn:*:4:8` keeps some cells.
Momentum runs again with --async-momentum off, to show what the default
changes. Results go to benchmarks/results/convergence_optimizers.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from psd import learner
from psd.arena import wait_for_job
from psd.bench.record import command_line, machine, machine_line, require_matplotlib, staged
from psd.workloads import evaluate, make_classification, make_mlp, train_single

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
EPOCHS = 3
LR = {1: 0.005, 2: 0.01, 4: 0.015, 8: 0.025}  # as tests/test_convergence.py: stable final iterates
STRESS = {"learners": 8, "batch": 8, "lr": 0.02, "momentum": 0.9}
OFF = ["--async-momentum", "off"]
STRESS_RUNS = [
    ("asp", OFF),
    ("asp --staleness-lr", [*OFF, "--staleness-lr"]),
    ("ssp:1", [*OFF, "--sync", "ssp:1"]),
    ("asp --predict", [*OFF, "--predict"]),
    ("ssp:1 --predict", [*OFF, "--sync", "ssp:1", "--predict"]),
    ("bsp", [*OFF, "--sync", "bsp"]),
    ("asp, default --async-momentum auto", []),
]
# Part 3: the learning rate one process uses, per workload, optimizer and mini-batch; epochs per workload.
OPT_EPOCHS = {"mlp": 3, "cnn": 5}
OPT_LR = {("mlp", "momentum"): {2: 0.005, 8: 0.02}, ("mlp", "nesterov"): {2: 0.005, 8: 0.02},
          ("mlp", "adam"): {2: 0.001, 8: 0.002}, ("cnn", "momentum"): {2: 0.02, 8: 0.05},
          ("cnn", "nesterov"): {2: 0.02, 8: 0.05}, ("cnn", "adam"): {2: 0.001, 8: 0.002}}


def train_psd(job: str, learners: int, batch: int, lr: float, flags: list[str], epochs: int = EPOCHS) -> dict:
    """One run: a server, `learners` processes of examples/train_mlp.py; the final weights' accuracy."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    server = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--no-watchdog", "--quiet", "--job", job,
                               "--learners", str(learners), "--lr", repr(lr), *flags], env=env)
    try:
        wait_for_job(job, timeout=30, server_pid=server.pid)
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, str(ROOT / "examples" / "train_mlp.py"), "--job", job, "--rank",
                                   str(r), "--world", str(learners), "--epochs", str(epochs), "--batch-size",
                                   str(batch)], stdout=subprocess.PIPE, text=True, env=env)
                 for r in range(learners)]
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"a learner failed (exit {p.returncode}):\n{out}")
        seconds = time.monotonic() - t0
        data = make_classification(0)
        model = make_mlp(data.dim, data.classes)
        model.load_state_dict(learner.pull_state_dict(job))
        from psd.status import job_status

        st = job_status(job)
        return {"accuracy": evaluate(model, data), "seconds": round(seconds, 2),
                "staleness_mean": round(st["staleness_mean"], 2), "staleness_max": st["staleness_max"],
                "updates": st["clock"]}
    finally:
        server.terminate()
        server.wait(timeout=60)


def run_learners(job: str, workload: str, learners: int, batch: int, epochs: int, lr: float, optimizer: str,
                 flags: list[str], seed: int = 0) -> dict:
    """One part-3 run: a server and `learners` processes of benchmarks/convergence_learner.py."""
    import statistics

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import convergence_learner as cl

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    server = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--no-watchdog", "--quiet", "--job", job,
                               "--learners", str(learners), "--lr", repr(lr), "--optimizer", optimizer, *flags],
                              env=env)
    try:
        wait_for_job(job, timeout=30, server_pid=server.pid)
        procs = [subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "convergence_learner.py"), "--job", job,
                                   "--rank", str(r), "--world", str(learners), "--workload", workload, "--epochs",
                                   str(epochs), "--batch-size", str(batch), "--seed", str(seed)],
                                  stdout=subprocess.PIPE, text=True, env=env) for r in range(learners)]
        accs = []
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"a learner failed (exit {p.returncode}):\n{out}")
            accs.append(json.loads(out.strip().splitlines()[-1])["accuracy"])
        from psd.status import job_status

        st = job_status(job)
        # The job's model as `psd export` gives it: weights and merged BatchNorm statistics, loaded strictly.
        data, model = cl.workload(workload, seed)
        model.load_state_dict(learner.pull_state_dict(job))
        acc = cl.accuracy(model, data)
        return {"accuracy": round(acc, 4), "learner_median": round(statistics.median(accs), 4),
                "learner_min": round(min(accs), 4),
                "staleness_mean": round(st["staleness_mean"], 2)}
    finally:
        server.terminate()
        server.wait(timeout=60)


def optimizer_table(quick: bool, seeds: int = 1, only: str | None = None) -> dict:
    """Part 3: psd's default against one process, optimizer x learners x mini-batch, on both workloads.

    Each cell is the mean over ``seeds`` seeds (data split, initial weights and shuffles) for psd and for
    one process alike: one process alone moves by a point or two from seed to seed on these small sets.
    ``only`` keeps the cells named ``workload:optimizer:learners:batch`` (comma-separated; ``*`` matches any).
    """
    import statistics

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import convergence_learner as cl

    optimizers = ["momentum"] if quick else ["momentum", "nesterov", "adam"]
    # (learners, mini-batch): 8 learners only at mini-batch 8, the slowest settings being too slow for 2 cores
    settings = [(4, 8)] if quick else [(4, 2), (2, 8), (4, 8), (8, 8)]
    wanted = [c.split(":") for c in only.split(",")] if only else None

    def selected(*cell: object) -> bool:
        return wanted is None or any(all(w in ("*", str(c)) for w, c in zip(pat, cell, strict=True))
                                     for pat in wanted)

    job = f"convergence-opt-{os.getpid()}"
    host = machine()  # as the runs start: the load average then
    rows = []
    for workload in ("mlp", "cnn"):
        epochs = OPT_EPOCHS[workload]
        for opt in optimizers:
            for n, b in settings:
                if not selected(workload, opt, n, b):
                    continue
                lr = OPT_LR[(workload, opt)][b]
                singles = [cl.train_single(workload, opt, lr, b, epochs, seed) for seed in range(seeds)]
                runs = [run_learners(job, workload, n, b, epochs, lr, opt, [], seed) for seed in range(seeds)]
                single, default = statistics.mean(singles), statistics.mean(r["accuracy"] for r in runs)
                row = {"workload": workload, "optimizer": opt, "learners": n, "batch": b, "lr": lr,
                       "epochs": epochs, "seeds": seeds, "single": round(single, 4),
                       "single_runs": [round(x, 4) for x in singles], "default": round(default, 4),
                       "default_runs": [r["accuracy"] for r in runs], "gap": round(default - single, 4),
                       "learner_min": min(r["learner_min"] for r in runs),
                       "staleness_mean": round(statistics.mean(r["staleness_mean"] for r in runs), 2)}
                if opt == "momentum":
                    off = statistics.mean(run_learners(job, workload, n, b, epochs, lr, opt, OFF, seed)["accuracy"]
                                          for seed in range(seeds))
                    row.update(off=round(off, 4), off_gap=round(off - single, 4))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"cpus": os.cpu_count(), "seeds": seeds, "only": only, "rows": rows, "machine": host}


def optimizer_tables(r: dict) -> str:
    """Part 3 as markdown: one row per cell, means over the seeds and their range."""
    lines = [f"# Convergence by optimizer: psd's default flags against one process ({r['cpus']} CPUs)", "",
             f"Machine: {machine_line(r.get('machine'))}.", "",
             "asp with `--async-momentum auto` (the default); one process runs torch.optim at the same lr, "
             f"mini-batch and epochs. Every figure is the mean test accuracy over {r.get('seeds', 1)} seed(s) "
             "(per-seed values in the JSON); psd's is the job's final model as `psd export` gives it (weights "
             "and, for the CNN, the merged BatchNorm statistics, loaded with strict=True). `off`: momentum with "
             "`--async-momentum off`. Command: `python benchmarks/convergence.py --optimizers --seeds "
             f"{r.get('seeds', 1)}" + (f" --only '{r['only']}'" if r.get("only") else "") + "`.", "",
             "| workload | optimizer | mini-batch | lr | learners | one process | psd default | vs one process "
             "| off | staleness mean | one process, seeds | psd default, seeds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        off = f"{x['off']:.4f} ({x['off_gap']:+.4f})" if "off" in x else ""
        lines.append(f"| {x['workload']} ({x['epochs']} epochs) | {x['optimizer']} | {x['batch']} | {x['lr']} | "
                     f"{x['learners']} | {x['single']:.4f} | {x['default']:.4f} | {x['gap']:+.4f} | {off} | "
                     f"{x['staleness_mean']:.1f} | {_range(x.get('single_runs'))} | {_range(x.get('default_runs'))} |")
    return "\n".join(lines) + "\n"


def _range(runs: list[float] | None) -> str:
    """The least and most of a cell's per-seed figures ("0.9556-0.9889"), or "" where not recorded."""
    return f"{min(runs):.4f}-{max(runs):.4f}" if runs else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="learners 1 and 4, mini-batch 1 and 4, one stress run each")
    p.add_argument("--optimizers", action="store_true", help="only part 3, the optimizer table")
    p.add_argument("--seeds", type=int, default=1, help="part 3: seeds averaged per cell (psd and one process)")
    p.add_argument("--only", help="part 3: cells workload:optimizer:learners:batch, comma-separated, * for any")
    p.add_argument("--out", type=Path, default=OUT, help=f"the results directory (default: {OUT})")
    p.add_argument("--no-plots", action="store_true", help="parts 1-2: no convergence.png (no matplotlib needed)")
    args = p.parse_args()
    torch.set_num_threads(1)
    command = command_line()
    if args.optimizers:
        r = {**optimizer_table(args.quick, args.seeds, args.only), "command": command}
        with staged(args.out) as out:  # the committed files are replaced only once both are written
            out.write_text("convergence_optimizers.json", json.dumps(r, indent=1) + "\n")
            out.write_text("convergence_optimizers.md", optimizer_tables(r))
        print(optimizer_tables(r))
        return 0
    if not args.no_plots:  # its plot: checked before 10 minutes of runs
        require_matplotlib("benchmarks/convergence.py (or pass --no-plots)", args.out)
    learners_set, batches = ([1, 4], [1, 4]) if args.quick else ([1, 2, 4, 8], [1, 2, 4, 8])
    data = make_classification(0)
    job = f"convergence-{os.getpid()}"
    result = {"epochs": EPOCHS, "cpus": os.cpu_count(), "machine": machine(), "command": command, "grid": [],
              "stress": {"setting": STRESS, "runs": []}}

    for b in batches:
        single = evaluate(train_single(data, EPOCHS, b, LR[b]), data)
        for n in learners_set:
            r = train_psd(job, n, b, LR[b], [])
            row = {"learners": n, "batch": b, "lr": LR[b], "single": round(single, 4),
                   "psd": round(r["accuracy"], 4), "gap": round(r["accuracy"] - single, 4), **r}
            result["grid"].append(row)
            print(json.dumps(row), flush=True)

    s = STRESS
    single = evaluate(train_single(data, EPOCHS, s["batch"], s["lr"], momentum=s["momentum"]), data)
    result["stress"]["single"] = round(single, 4)
    print(json.dumps({"stress single": single}), flush=True)
    for name, flags in STRESS_RUNS[:2] if args.quick else STRESS_RUNS:
        r = train_psd(job, s["learners"], s["batch"], s["lr"],
                      ["--optimizer", "momentum", "--momentum", str(s["momentum"]), *flags])
        row = {"mode": name, "gap": round(r["accuracy"] - single, 4), **r}
        result["stress"]["runs"].append(row)
        print(json.dumps(row), flush=True)

    with staged(args.out) as out:  # the committed files are replaced only once all three are written
        out.write_text("convergence.json", json.dumps(result, indent=1) + "\n")
        out.write_text("convergence.md", tables(result))
        if not args.no_plots:
            plot(result, out.path("convergence.png"))
    print(tables(result))
    return 0


def tables(r: dict) -> str:
    """Parts 1 and 2 as markdown."""
    lines = [f"# Convergence: test accuracy after {r['epochs']} epochs ({r['cpus']} CPUs)", "",
             f"Machine: {machine_line(r.get('machine'))}.", "",
             *([f"Command: `{r['command']}`.", ""] if r.get("command") else []),
             "## asp (plain SGD) against one process at the same mini-batch and learning rate", "",
             "| mini-batch | lr | one process | " + " | ".join(
                 f"{n} learner{'s' * (n > 1)}" for n in sorted({g['learners'] for g in r["grid"]})) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in {g["learners"] for g in r["grid"]}) + " |"]
    for b in sorted({g["batch"] for g in r["grid"]}):
        rows = sorted((g for g in r["grid"] if g["batch"] == b), key=lambda g: g["learners"])
        lines.append(f"| {b} | {rows[0]['lr']} | {rows[0]['single']:.4f} | " + " | ".join(
            f"{g['psd']:.4f} ({g['gap']:+.4f}, staleness {g['staleness_mean']:.1f})" for g in rows) + " |")
    s = r["stress"]
    st = s["setting"]
    lines += ["", f"## Stress: {st['learners']} learners, mini-batch {st['batch']}, momentum {st['momentum']}, "
                  f"lr {st['lr']}", "", f"One process (momentum SGD): {s['single']:.4f}", "",
              "| mode | accuracy | vs one process | staleness mean / max | seconds |",
              "| --- | --- | --- | --- | --- |"]
    for x in s["runs"]:
        lines.append(f"| {x['mode']} | {x['accuracy']:.4f} | {x['gap']:+.4f} | {x['staleness_mean']:.1f} / "
                     f"{x['staleness_max']} | {x['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    """Parts 1 and 2 as one figure (main() checked for matplotlib before the runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({g["batch"] for g in r["grid"]}):
        rows = sorted((g for g in r["grid"] if g["batch"] == batch), key=lambda g: g["learners"])
        a.plot([g["learners"] for g in rows], [g["gap"] * 100 for g in rows], marker="o", label=f"mini-batch {batch}")
    a.axhline(0, color="grey", lw=0.8)
    a.set_xscale("log", base=2)
    a.set_xlabel("learners (asp)")
    a.set_ylabel("accuracy - one process (points)")
    a.set_title(f"asp vs one process, {r['epochs']} epochs")
    a.legend()
    s = r["stress"]
    names = [x["mode"] for x in s["runs"]]
    b.bar(range(len(names)), [x["accuracy"] * 100 for x in s["runs"]], color="tab:blue")
    b.axhline(s["single"] * 100, color="tab:red", lw=1.2, label="one process")
    b.set_xticks(range(len(names)), names, rotation=30, ha="right")
    lo = min([x["accuracy"] for x in s["runs"]] + [s["single"]]) * 100
    b.set_ylim(max(0, lo - 5), 100)
    b.set_ylabel("test accuracy (%)")
    b.set_title(f"stress: {s['setting']['learners']} learners, momentum, lr {s['setting']['lr']}")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
