"""psd's optimizer kernels against torch's fused CPU optimizers (and DeepSpeed's CPU Adam where installed).

    python benchmarks/optim_kernels.py [--sizes 1e6,1e7,1e8] [--threads 1,all] [--reps 7] [--rounds 3]
                                       [--no-plot] [--out benchmarks/results]

For every size, thread count and server optimizer: ms per update of psd's kernel and of each peer in the
same run at the same thread count, the GB/s of the bytes the update must move, and that as a fraction of
the stream limit measured beside it (psd/bench/optim.py). Each cell is the median over --rounds rounds
(each itself a median of --reps updates), with the least and most. Writes optim_kernels.json, .md and
(unless --no-plot) optim_kernels.png, with the machine, into --out once the run and the plot succeeded.
DeepSpeed: `pip install deepspeed --no-build-isolation` (its CPU Adam JIT-builds on first use).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from psd.bench.optim import OPTIMIZERS, measure
from psd.bench.record import RESULTS, command_line, machine, machine_line, require_matplotlib, staged


def _sizes(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def _threads(text: str) -> list[int]:
    cores = len(os.sched_getaffinity(0))
    return sorted({cores if x == "all" else int(x) for x in text.split(",") if x})


def _cell(vals: list[float | None]) -> dict:
    got = [v for v in vals if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(got), "min": min(got), "max": max(got)}


def combine(rounds: list[list[dict]]) -> list[dict]:
    """Per (optimizer, params, threads): the median, least and most of each figure over the rounds."""
    out = []
    for rows in zip(*rounds, strict=True):
        first = rows[0]
        row = {k: first[k] for k in ("optimizer", "params", "threads")}
        for k in ("stream_gbs", "psd_ms", "psd_roofline", "torch_fused_ms", "deepspeed_ms", "vs_torch_fused",
                  "vs_deepspeed"):
            row[k] = _cell([r[k] for r in rows])
        out.append(row)
    return out


def _f(c: dict, spec: str) -> str:
    if c["median"] is None:
        return "-"
    return f"{format(c['median'], spec)} ({format(c['min'], spec)}-{format(c['max'], spec)})"


def markdown(r: dict) -> str:
    lines = ["# Optimizer kernels: psd against torch fused (and DeepSpeed CPU Adam)", "",
             f"{machine_line(r['machine'])}", "", f"Command: `{r['command']}`", "",
             f"Median over {r['rounds']} rounds (least-most). ms per update; roofline: the GB/s the update must "
             f"move over the stream limit (w -= lr*g) measured at the same size and threads; vs torch: torch "
             f"fused ms / psd ms (> 1: psd faster). Targets: vs torch >= 1.0, roofline >= 0.8 at 10^7 and above.", "",
             "| optimizer | params | threads | stream GB/s | psd ms | torch fused ms | DeepSpeed ms | vs torch | "
             "vs DeepSpeed | psd roofline |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        cells = [_f(row["stream_gbs"], ".1f"), _f(row["psd_ms"], ".2f"), _f(row["torch_fused_ms"], ".2f"),
                 _f(row["deepspeed_ms"], ".2f"), _f(row["vs_torch_fused"], ".2f"), _f(row["vs_deepspeed"], ".2f"),
                 _f(row["psd_roofline"], ".2f")]
        lines.append(f"| {row['optimizer']} | {row['params']:,} | {row['threads']} | " + " | ".join(cells) + " |")
    worst = min((row for row in r["rows"] if row["vs_torch_fused"]["median"] is not None),
                key=lambda x: x["vs_torch_fused"]["median"], default=None)
    if worst:
        lines += ["", f"Worst cell against torch fused: {worst['optimizer']} at {worst['params']:,} params, "
                      f"{worst['threads']} thread(s): {worst['vs_torch_fused']['median']:.2f}x."]
    return "\n".join(lines) + "\n"


def plot(r: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({row["threads"] for row in r["rows"]})
    fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4.5), squeeze=False)
    for ax, th in zip(axes[0], threads, strict=True):
        for name in r["optimizers"]:
            rows = [x for x in r["rows"] if x["optimizer"] == name and x["threads"] == th]
            xs = [x["params"] for x in rows]
            ax.plot(xs, [x["vs_torch_fused"]["median"] for x in rows], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("torch fused ms / psd ms")
        ax.set_title(f"{th} thread(s)")
        ax.legend(fontsize=8)
    fig.suptitle("psd's optimizer kernels against torch's fused CPU optimizers (> 1: psd faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1e6,1e7,1e8")
    p.add_argument("--threads", default="1,all", help="thread counts, 'all': this process's cores")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if not args.no_plot:
        require_matplotlib("benchmarks/optim_kernels.py", args.out)
    optimizers = tuple(x for x in args.optimizers.split(",") if x)
    bad = [o for o in optimizers if o not in OPTIMIZERS]
    if bad:
        raise SystemExit(f"optim_kernels.py: no optimizer {', '.join(bad)}; choose from {', '.join(OPTIMIZERS)}")
    rounds = []
    for k in range(args.rounds):
        print(f"round {k + 1}/{args.rounds}", flush=True)
        rows = []
        for n in _sizes(args.sizes):
            for th in _threads(args.threads):
                rows += measure(n, th, optimizers, args.reps)
        rounds.append(rows)
    r = {"machine": machine(), "command": command_line(), "rounds": args.rounds, "optimizers": list(optimizers),
         "rows": combine(rounds)}
    md = markdown(r)
    import json

    with staged(args.out) as s:
        s.write_text("optim_kernels.json", json.dumps(r, indent=1, allow_nan=False) + "\n")
        s.write_text("optim_kernels.md", md)
        if not args.no_plot:
            plot(r, s.path("optim_kernels.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
