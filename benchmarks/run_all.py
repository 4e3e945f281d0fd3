"""Run `psd bench` with its peers and write the results into benchmarks/results/.

    pip install matplotlib
    python benchmarks/run_all.py [--quick]

Writes bench.json (every figure), bench.md (the tables, psd/peer ratios) and
two plots: round_trip.png (updates/s against model size, psd beside Hogwild,
Hogwild with a weights snapshot per step, and DDP's all_reduce over gloo) and
training.png (samples/s against learners). All figures come from one run on
one machine: compare ratios, not absolute numbers, across machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from psd.bench import BenchConfig, run

OUT = Path(__file__).resolve().parent / "results"
PEERS = ("hogwild", "hogwild_snapshot", "ddp_gloo")


def tables(r: dict) -> str:
    lines = [f"# psd bench: {r['cpus']} CPUs, psd {r['psd_version']}", "",
             "## Limit and update loop (w -= lr*g, 3 streams per element)", "",
             "| params | threads | kernel GB/s | update loop GB/s | loop / kernel |", "| --- | --- | --- | --- | --- |"]
    for lim, loop in zip(r["limit"], r["update_loop"], strict=True):
        lines.append(f"| {lim['params']:,} | {lim['threads']} | {lim['gbs']:.1f} | {loop['gbs']:.1f} | "
                     f"{loop['fraction_of_limit']:.2f} |")
    lines += ["", "## The update written four ways (one thread; see native/update.c)", "",
              "| params | " + " | ".join(f"{k} GB/s" for k in dict.fromkeys(x["kernel"] for x in r["kernels"])) + " |",
              "| --- |" + " --- |" * len(dict.fromkeys(x["kernel"] for x in r["kernels"]))]
    for size in dict.fromkeys(x["params"] for x in r["kernels"]):
        lines.append(f"| {size:,} | " + " | ".join(f"{x['gbs']:.1f}" for x in r["kernels"] if x["params"] == size)
                     + " |")
    lines += ["", f"Idle server: {r['idle_server_cpu']:.2%} of a core.", "",
              "## Round trip: null learners, push + pull per update", "",
              "| params | learners | psd upd/s | psd GB/s | push p50 us | step p50 us | step p99 us | "
              "psd / Hogwild | psd / Hogwild+snapshot | psd / DDP gloo |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["round_trip"]:
        p = row["psd"]
        ratios = [f"{row[f'psd_over_{peer}']:.2f}" if row.get(peer) else "-" for peer in PEERS]
        lines.append(f"| {row['params']:,} | {row['learners']} | {p['updates_per_s']:,.0f} | {p['model_gbs']:.2f} | "
                     f"{p['push_p50_us']:.1f} | {p['step_p50_us']:.1f} | {p['step_p99_us']:.1f} | "
                     + " | ".join(ratios) + " |")
    lines += ["", "## Training: the shipped MLP workload, as many epochs as the mini-batch size", "",
              "| mini-batch | learners | psd samples/s | psd accuracy | Hogwild samples/s | Hogwild accuracy | "
              "psd / Hogwild |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["training"]:
        h = row.get("hogwild") or {}
        lines.append(f"| {row['batch']} | {row['learners']} | {row['psd']['samples_per_s']:,.0f} | "
                     f"{row['psd']['accuracy']:.4f} | {h.get('samples_per_s', 0):,.0f} | {h.get('accuracy', 0):.4f} | "
                     f"{row.get('psd_over_hogwild', 0):.2f} |")
    return "\n".join(lines) + "\n"


def plots(r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    learners = sorted({row["learners"] for row in r["round_trip"]})
    fig, axes = plt.subplots(1, len(learners), figsize=(4.5 * len(learners), 4), squeeze=False)
    for ax, k in zip(axes[0], learners, strict=True):
        rows = [row for row in r["round_trip"] if row["learners"] == k]
        sizes = [row["params"] for row in rows]
        ax.plot(sizes, [row["psd"]["updates_per_s"] for row in rows], "o-", label="psd")
        for peer in PEERS:
            pts = [(row["params"], row[peer]["updates_per_s"]) for row in rows if row.get(peer)]
            if pts:
                ax.plot(*zip(*pts, strict=True), "s--", label=peer.replace("_", " "))
        ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="updates/s", title=f"{k} learner(s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("round trip: push + pull per update")
    fig.tight_layout()
    fig.savefig(OUT / "round_trip.png", dpi=110)
    batches = sorted({row["batch"] for row in r["training"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    for b in batches:
        rows = [row for row in r["training"] if row["batch"] == b]
        ax.plot([row["learners"] for row in rows], [row["psd"]["samples_per_s"] for row in rows], "o-",
                label=f"psd, mini-batch {b}")
        if rows and rows[0].get("hogwild"):
            ax.plot([row["learners"] for row in rows], [row["hogwild"]["samples_per_s"] for row in rows], "s--",
                    label=f"Hogwild, mini-batch {b}")
    ax.set(xlabel="learners", ylabel="samples/s", title="training throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "training.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", type=int, nargs="+")
    p.add_argument("--learners", type=int, nargs="+")
    p.add_argument("--reps", type=int)
    args = p.parse_args(argv)
    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    if args.sizes:
        cfg = dataclasses.replace(cfg, sizes=tuple(args.sizes))
    if args.learners:
        cfg = dataclasses.replace(cfg, learners=tuple(args.learners))
    if args.reps:
        cfg = dataclasses.replace(cfg, reps=args.reps)
    r = run(cfg, log=lambda line: print(line, flush=True))
    OUT.mkdir(exist_ok=True)
    (OUT / "bench.json").write_text(json.dumps(r, indent=2))
    (OUT / "bench.md").write_text(tables(r))
    plots(r)
    print(f"wrote {OUT}/bench.json, bench.md, round_trip.png, training.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
