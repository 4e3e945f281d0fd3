"""Run `psd bench` with its peers and write the results into benchmarks/results/.

    pip install -e '.[bench]'      # matplotlib, for the plots
    python benchmarks/run_all.py [--quick]

Writes bench.json (every figure), bench.md (the tables, psd/peer ratios) and
two plots: round_trip.png (updates/s against model size, psd, psd with
pull="view" and with --grad-dtype bf16 beside Hogwild, Hogwild with a weights snapshot per step, and DDP's
all_reduce over gloo) and training.png (samples/s against learners). All
figures come from one run on one machine (bench.json's "machine" says which, and
bench.md's heading): compare ratios, not absolute numbers, across machines
(benchmarks/compare.py reruns the key ratios against bench.json).

Nothing in benchmarks/results/ changes until the run and its plots are done: the
files are written beside them first and moved over them at the end, and a
missing matplotlib stops the script before it measures anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from psd.bench import BenchConfig, run
from psd.bench.record import command_line, machine_line, require_matplotlib, staged

OUT = Path(__file__).resolve().parent / "results"
PEERS = ("hogwild", "hogwild_snapshot", "ddp_gloo")
PEER_TITLES = {"hogwild": "Hogwild", "hogwild_snapshot": "Hogwild+snapshot", "ddp_gloo": "DDP gloo", "psd": "psd"}
# psd's set-ups as psd bench names them (BenchConfig.variants), and their short titles in the ratio tables.
VARIANTS = {"psd": "psd", "psd_view": "view", "psd_bf16": "bf16", "psd_view_bf16": "view+bf16"}
VARIANT_OVER = ("hogwild", "hogwild_snapshot", "psd")
LIMIT_TITLES = {"dram": "from DRAM (each vector {llcs:g} or more LLCs)",
                "cache": "in cache (the update loop's working set within half the LLC)",
                None: "(an older run's rows: not placed in DRAM or the cache)"}


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _limit_tables(r: dict) -> list[str]:
    """One table per place (DRAM, cache): the bare kernel's limit and the update loop at the same size."""
    llc = r.get("llc_bytes")
    heading = f"{llc / (1 << 20):g} MiB last-level cache" if llc else "last-level cache unknown"
    if r.get("llc_fallback"):
        heading += f", a default: {r.get('llc_source', '')}"
    lines = []
    places = dict.fromkeys(row.get("where") for row in r["limit"])
    for place in places:
        pairs = [(lim, loop) for lim, loop in zip(r["limit"], r["update_loop"], strict=True)
                 if lim.get("where") == place]
        title = LIMIT_TITLES.get(place, str(place)).format(llcs=4)
        lines += ["", f"## Limit and update loop {title}: w -= lr*g, 3 streams per element; {heading}", "",
                  "| params | MB per vector | threads | kernel GB/s | update loop GB/s | loop / kernel | as labelled |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for lim, loop in pairs:
            honest = {True: "yes", False: "**no**"}.get(lim.get("honest"), "-")
            lines.append(f"| {lim['params']:,} | {lim['params'] * 4 / 1e6:.1f} | {lim['threads']} | {lim['gbs']:.1f} | "
                         f"{_f(loop['gbs'])} | {_f(loop['fraction_of_limit'], '.2f')} | {honest} |")
        if any(lim.get("honest") is False for lim, _ in pairs):
            lines += ["", f"Not a {place} figure: the vectors are not where the heading says (a --quick run, or a "
                      f"--loop-sizes size between the two)."]
        skipped = {loop["skipped"] for _, loop in pairs if loop.get("skipped")}
        lines += [f"Update loop skipped: {why}." for why in sorted(skipped)]
    return lines


def _variants(rows: list[dict]) -> list[str]:
    """The psd set-ups measured in these rows, in VARIANTS order."""
    return [v for v in VARIANTS if any(row.get(v) for row in rows)]


def _ranged(p: dict, key: str) -> str:
    """``p[key]`` of the median run, and the least and most over the reps where the run kept them."""
    lo, hi = p.get(f"{key}_min"), p.get(f"{key}_max")
    spread = f" ({lo:.1f}-{hi:.1f})" if lo is not None and hi is not None and p.get("reps", 1) > 1 else ""
    return _f(p.get(key)) + spread


def _round_trip_table(r: dict) -> list[str]:
    """The round trip's figures (psd, and psd_view, psd_bf16, psd_view_bf16 where measured), then its
    ratios, as two tables."""
    names = _variants(r["round_trip"])
    ratios = [f"psd_over_{p}" for p in PEERS] + [f"{v}_over_{o}" for v in names[1:] for o in VARIANT_OVER]
    head = ["params", "learners"]
    for name in names:
        head += [f"{name} upd/s", f"{name} GB/s", f"{name} pulls/upd", f"{name} push p50 us", f"{name} step p50 us",
                 f"{name} step p99 us"]
    lines = ["", "## Round trip: null learners, push + pull per update", "",
             "GB/s counts the pulls made (a gradient in per update, the weights out per pull); step p50: the median "
             "run's, with the least and most over the reps where there were several"
             + ("; psd_view's parameters are views of the shared weights (pull=\"view\"): no pull at all"
                if "psd_view" in names else "")
             + ("; psd_bf16 pushes bfloat16 gradients (--grad-dtype bf16): 2 bytes a parameter in"
                if "psd_bf16" in names else "") + ".", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in r["round_trip"]:
        cells = [f"{row['params']:,}", str(row["learners"])]
        for name in names:
            p = row.get(name) or {}
            cells += [_f(p.get("updates_per_s"), ",.0f"), _f(p.get("model_gbs"), ".2f"),
                      _f(p.get("pulls_per_update"), ".2f"), _f(p.get("push_p50_us")), _ranged(p, "step_p50_us"),
                      _f(p.get("step_p99_us"))]
        lines.append("| " + " | ".join(cells) + " |")
    head = ["params", "learners"] + [_ratio_title(key) for key in ratios]
    lines += ["", "### Round trip: updates/s over the peers' (view: psd with pull=\"view\"; bf16: --grad-dtype bf16)",
              "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in r["round_trip"]:
        lines.append("| " + " | ".join([f"{row['params']:,}", str(row["learners"])]
                                       + [_f(row.get(key), ".2f") for key in ratios]) + " |")
    return lines


def _ratio_title(key: str) -> str:
    """"psd_view_over_hogwild_snapshot" as "view / Hogwild+snapshot"."""
    num, den = key.split("_over_", 1)
    return f"{VARIANTS.get(num, num)} / {PEER_TITLES.get(den, den)}"


def _training_table(r: dict) -> list[str]:
    variants = _variants(r["training"])
    names = [*variants, "hogwild"] if any(row.get("hogwild") for row in r["training"]) else variants
    ratios = [f"{v}_over_hogwild" for v in variants] if "hogwild" in names else []
    head = ["mini-batch", "learners"] + [f"{PEER_TITLES.get(n, VARIANTS.get(n, n))} {x}" for n in names
                                         for x in ("samples/s", "accuracy")]
    head += [_ratio_title(key) for key in ratios]
    lines = ["", "## Training: the shipped MLP workload, as many epochs as the mini-batch size", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in r["training"]:
        cells = [str(row["batch"]), str(row["learners"])]
        for name in names:
            m = row.get(name) or {}
            cells += [_f(m.get("samples_per_s"), ",.0f"), _f(m.get("accuracy"), ".4f")]
        cells += [_f(row.get(key), ".2f") for key in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tables(r: dict) -> str:
    """The run as markdown: the machine and command, the limits, the kernels, the round trip, training."""
    lines = [f"# psd bench: {r['cpus']} CPUs, psd {r['psd_version']}", "",
             f"Machine: {machine_line(r.get('machine'))}."]
    if r.get("command"):
        lines += ["", f"Command: `{r['command']}`."]
    lines += _limit_tables(r)
    lines += ["", "## The update written four ways (one thread; see native/update.c)", "",
              "| params | " + " | ".join(f"{k} GB/s" for k in dict.fromkeys(x["kernel"] for x in r["kernels"])) + " |",
              "| --- |" + " --- |" * len(dict.fromkeys(x["kernel"] for x in r["kernels"]))]
    for size in dict.fromkeys(x["params"] for x in r["kernels"]):
        lines.append(f"| {size:,} | " + " | ".join(f"{x['gbs']:.1f}" for x in r["kernels"] if x["params"] == size)
                     + " |")
    lines += ["", f"Idle server: {r['idle_server_cpu']:.2%} of a core."]
    lines += _round_trip_table(r)
    lines += _training_table(r)
    return "\n".join(lines) + "\n"


def plots(r: dict, round_trip_png: Path, training_png: Path) -> None:
    """Draw the round trip (updates/s against model size) and training (samples/s against learners)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    learners = sorted({row["learners"] for row in r["round_trip"]})
    fig, axes = plt.subplots(1, len(learners), figsize=(4.5 * len(learners), 4), squeeze=False)
    for ax, k in zip(axes[0], learners, strict=True):
        rows = [row for row in r["round_trip"] if row["learners"] == k]
        sizes = [row["params"] for row in rows]
        ax.plot(sizes, [row["psd"]["updates_per_s"] for row in rows], "o-", label="psd")
        for v in _variants(rows)[1:]:
            pts = [(row["params"], row[v]["updates_per_s"]) for row in rows if row.get(v)]
            ax.plot(*zip(*pts, strict=True), "o-", label=f"psd, {VARIANTS[v]}")
        for peer in PEERS:
            pts = [(row["params"], row[peer]["updates_per_s"]) for row in rows if row.get(peer)]
            if pts:
                ax.plot(*zip(*pts, strict=True), "s--", label=peer.replace("_", " "))
        ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="updates/s", title=f"{k} learner(s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("round trip: push + pull per update")
    fig.tight_layout()
    fig.savefig(round_trip_png, dpi=110)
    batches = sorted({row["batch"] for row in r["training"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    for b in batches:
        rows = [row for row in r["training"] if row["batch"] == b]
        ax.plot([row["learners"] for row in rows], [row["psd"]["samples_per_s"] for row in rows], "o-",
                label=f"psd, mini-batch {b}")
        for v in _variants(rows)[1:]:
            ax.plot([row["learners"] for row in rows], [row[v]["samples_per_s"] for row in rows], "^-",
                    label=f"psd {VARIANTS[v]}, mini-batch {b}")
        if rows and rows[0].get("hogwild"):
            ax.plot([row["learners"] for row in rows], [row["hogwild"]["samples_per_s"] for row in rows], "s--",
                    label=f"Hogwild, mini-batch {b}")
    ax.set(xlabel="learners", ylabel="samples/s", title="training throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(training_png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", type=int, nargs="+")
    p.add_argument("--learners", type=int, nargs="+")
    p.add_argument("--reps", type=int)
    p.add_argument("--loop-sizes", type=int, nargs="+",
                   help="also measure the update loop (and the limit) at these sizes; 1e8 floats is 3.6 GB of arena")
    p.add_argument("--pull-modes", nargs="+", choices=("copy", "view"),
                   help="copy (always measured) and view (pull=\"view\": the psd_view figures)")
    p.add_argument("--grad-dtypes", nargs="+", choices=("float32", "bf16"),
                   help="float32 (always measured) and bf16 (--grad-dtype bf16: the psd_bf16 figures)")
    p.add_argument("--batches", type=int, nargs="+", help="training mini-batch sizes")
    p.add_argument("--name", default="bench",
                   help="write NAME.json and NAME.md (and the plots as NAME_round_trip.png, NAME_training.png "
                        "unless NAME is bench)")
    p.add_argument("--no-training", action="store_true")
    p.add_argument("--no-peers", action="store_true", help="psd alone (no Hogwild, no DDP)")
    p.add_argument("--duration", type=float, help="seconds per round-trip measurement")
    p.add_argument("--no-plots", action="store_true",
                   help="write NAME.json and NAME.md only (matplotlib is then not needed)")
    p.add_argument("--out", type=Path, default=OUT, help=f"the results directory (default: {OUT})")
    args = p.parse_args(argv)
    if not args.no_plots:
        require_matplotlib("benchmarks/run_all.py (or pass --no-plots)", args.out)
    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    if args.sizes:
        cfg = dataclasses.replace(cfg, sizes=tuple(args.sizes))
    if args.learners:
        cfg = dataclasses.replace(cfg, learners=tuple(args.learners))
    if args.reps:
        cfg = dataclasses.replace(cfg, reps=args.reps)
    if args.loop_sizes:
        cfg = dataclasses.replace(cfg, loop_sizes=tuple(args.loop_sizes))
    if args.pull_modes:
        cfg = dataclasses.replace(cfg, pull_modes=tuple(args.pull_modes))
    if args.grad_dtypes:
        cfg = dataclasses.replace(cfg, grad_dtypes=tuple(args.grad_dtypes))
    if args.batches:
        cfg = dataclasses.replace(cfg, batches=tuple(args.batches))
    if args.no_training:
        cfg = dataclasses.replace(cfg, training=False)
    if args.no_peers:
        cfg = dataclasses.replace(cfg, peers=False)
    if args.duration:
        cfg = dataclasses.replace(cfg, duration=args.duration)
    r = run(cfg, log=lambda line: print(line, flush=True))
    r["command"] = command_line(["benchmarks/run_all.py", *(sys.argv[1:] if argv is None else argv)])
    prefix = "" if args.name == "bench" else f"{args.name}_"
    with staged(args.out) as out:  # moved over the committed files only once all four are written
        out.write_text(f"{args.name}.json", json.dumps(r, indent=2, allow_nan=False))
        out.write_text(f"{args.name}.md", tables(r))
        if not args.no_plots:
            plots(r, out.path(f"{prefix}round_trip.png"), out.path(f"{prefix}training.png"))
    wrote = [f"{args.name}.json", f"{args.name}.md"]
    wrote += [] if args.no_plots else [f"{prefix}round_trip.png", f"{prefix}training.png"]
    print(f"wrote {', '.join(str(args.out / w) for w in wrote)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
