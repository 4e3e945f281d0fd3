"""Guard what was won: rerun `psd bench`'s key ratios and compare them with the committed results.

    python benchmarks/compare.py [--sizes N ...] [--learners K ...] [--reps 3] [--training] [--strict] [--json]

A performance change is won once and lost quietly. This script measures, with psd.bench, the figures
that say how psd stands against its peers on this machine: the round trip's psd/peer ratios (psd and,
where learner.attach has it, psd with pull="view", over Hogwild, Hogwild with a weights snapshot per
step and DDP's all_reduce over gloo), the update loop as a fraction of the bare kernel's limit (from
DRAM and in cache) and, with --training, samples/s over Hogwild's. Each is matched with the committed
benchmarks/results/bench.json by params, learners, threads and where, and printed as: metric, committed,
now, change %, the noise it is judged against, and a verdict: "moved" where the change exceeds the noise.

Ratios, not absolute figures: both sides of a ratio are measured in turns in one run, so a busier or
faster machine moves them less than it moves either figure. The noise is the spread of the reps, where
both runs kept it (``<figure>_min``/``_max`` of each measure, ``fraction_of_limit_min``/``_max``) and ran
at least two reps: a ratio's spread is bounded by its extremes (the numerator's least over the
denominator's most, and the other way round). Elsewhere --noise (default 25%) stands in. A spread is
never taken below --min-noise: three quiet reps do not make a machine quiet.

Exit status 0, whatever moved; with --strict, 1 when something got worse beyond its noise. A committed
file from before the DRAM/cache split (update-loop rows without ``where``) is matched where its params
and threads identify one row now; what cannot be matched is listed with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

COMMITTED = Path(__file__).resolve().parent / "results" / "bench.json"
DEFAULT_SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
DEFAULT_LEARNERS = (1, 2)


@dataclass(frozen=True)
class Metric:
    """One comparable figure of a run: where it sits (``key``), its value, and how far its reps spread
    (relative; None where the run did not keep the spread or ran a single rep)."""

    key: tuple
    label: str
    value: float
    spread: float | None
    fields: dict


def _spread(value: float, lo: float | None, hi: float | None) -> float | None:
    if lo is None or hi is None or value <= 0 or lo <= 0:
        return None
    return max(hi / value - 1, 1 - lo / value, 0.0)


def _measure_spread(num: dict, den: dict, key: str, ratio: float) -> float | None:
    """How far ``num[key] / den[key]`` could range over the reps: its extremes over its value."""
    try:
        if min(num["reps"], den["reps"]) < 2:
            return None
        lo = num[f"{key}_min"] / den[f"{key}_max"]
        hi = num[f"{key}_max"] / den[f"{key}_min"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return _spread(ratio, lo, hi)


def _ratios(row: dict, key: str) -> list[tuple[str, float, float | None]]:
    """Every ``<a>_over_<b>`` ratio in a round-trip or training row, with its spread."""
    out = []
    for name, value in row.items():
        if "_over_" not in name or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        num, den = name.split("_over_", 1)
        spread = (_measure_spread(row[num], row[den], key, value)
                  if isinstance(row.get(num), dict) and isinstance(row.get(den), dict) else None)
        out.append((name, float(value), spread))
    return out


def metrics(result: dict) -> dict[tuple, Metric]:
    """The comparable figures of a bench result (a run's JSON, of this format or an older one)."""
    out: dict[tuple, Metric] = {}
    # (kind, the figure its ratios divide, the field a row is told apart by, how that field reads)
    for kind, figure, by, title in (("round_trip", "updates_per_s", "params", "round trip {:,} params"),
                                    ("training", "samples_per_s", "batch", "training mini-batch {}")):
        for row in result.get(kind) or []:
            for name, value, spread in _ratios(row, figure):
                fields = {"kind": kind, by: row[by], "learners": row["learners"], "ratio": name}
                label = f"{title.format(row[by])} x{row['learners']}: {name.replace('_over_', ' / ')}"
                key = (kind, row[by], row["learners"], name)
                out[key] = Metric(key, label, value, spread, fields)
    for row in result.get("update_loop") or []:
        value = row.get("fraction_of_limit")
        if not isinstance(value, int | float) or not math.isfinite(value):
            continue
        where = row.get("where")
        spread = (_spread(value, row.get("fraction_of_limit_min"), row.get("fraction_of_limit_max"))
                  if row.get("reps", 0) >= 2 else None)
        fields = {"kind": "update_loop", "where": where, "params": row["params"], "threads": row["threads"],
                  "ratio": "fraction_of_limit"}
        label = (f"update loop {where or '(no where)'} {row['params']:,} params {row['threads']} thread(s): "
                 "fraction of limit")
        key = ("update_loop", where, row["params"], row["threads"])
        out[key] = Metric(key, label, float(value), spread, fields)
    return out


def _match(committed: dict[tuple, Metric], now: dict[tuple, Metric]) -> tuple[list, list, list]:
    """(committed, now) pairs; committed metrics that could not be matched, with the reason; metrics
    only the new run has."""
    pairs, unmatched, used = [], [], set()
    for key, c in committed.items():
        if key in now:
            pairs.append((c, now[key]))
            used.add(key)
            continue
        if key[0] == "update_loop" and key[1] is None:
            # An older file: the row was not placed in DRAM or the cache. Its params and threads may
            # still name one row now.
            cands = [k for k in now if k[0] == "update_loop" and k[2:] == key[2:]]
            if len(cands) == 1:
                pairs.append((c, now[cands[0]]))
                used.add(cands[0])
                continue
            reason = (f"older format (no 'where'), and {'several rows' if cands else 'no row'} now with "
                      f"params={key[2]:,} threads={key[3]}")
        elif key[0] == "update_loop":
            reason = f"no update-loop row now with where={key[1]} params={key[2]:,} threads={key[3]}"
        else:
            reason = f"not measured now (no {key[0].replace('_', ' ')} row for these sizes, learners or ratio)"
        unmatched.append({"metric": c.label, "committed": c.value, "reason": reason, **c.fields})
    new = [{"metric": m.label, "now": m.value, **m.fields} for k, m in now.items() if k not in used]
    return pairs, unmatched, new


def compare(committed: dict, now: dict, noise: float = 0.25, min_noise: float = 0.05) -> dict:
    """Every metric of ``now`` against ``committed``: the comparison ``--json`` prints."""
    pairs, unmatched, new = _match(metrics(committed), metrics(now))
    rows = []
    for c, n in pairs:
        if c.spread is not None and n.spread is not None:
            judged, source = max(c.spread, n.spread, min_noise), "reps"
        else:
            judged, source = noise, "default"
        change = n.value / c.value - 1 if c.value > 0 else None
        moved = change is not None and abs(change) > judged
        rows.append({"metric": n.label, **n.fields, "committed": c.value, "now": n.value,
                     "change_pct": None if change is None else 100 * change, "noise_pct": 100 * judged,
                     "noise_from": source, "verdict": "moved" if moved else "within noise",
                     "direction": None if not moved else ("better" if change > 0 else "worse")})
    return {"metrics": rows, "unmatched": unmatched, "new": new,
            "moved": sum(r["verdict"] == "moved" for r in rows),
            "worse": sum(r["direction"] == "worse" for r in rows)}


def measure(args: argparse.Namespace, log, server_threads: int = 1) -> dict:
    """The figures compare() needs, measured now with psd.bench (a bench result of the same format), the jobs'
    update loops at ``server_threads`` (the committed result's: results older than the field ran at 1)."""
    from psd import __version__
    from psd.bench import BenchConfig, round_trip, training
    from psd.bench.kernels import limits

    base = BenchConfig.quick() if args.quick else BenchConfig()
    cfg = dataclasses.replace(
        base, sizes=tuple(args.sizes), learners=tuple(args.learners), reps=args.reps, training=args.training,
        duration=args.duration or base.duration, batches=tuple(args.batches or base.batches),
        pull_modes=("copy",) if args.no_view else base.pull_modes, server_threads=server_threads)
    out: dict = {"psd_version": __version__, "cpus": len(os.sched_getaffinity(0)), "server_threads": server_threads}
    if not args.no_limits:
        out.update(limits(cfg, log))
    out["round_trip"] = round_trip(cfg, log)
    out["training"] = training(cfg, log) if args.training else []
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def text(report: dict) -> str:
    """The comparison as a table, then what could not be matched, grouped by reason."""
    rows = report["metrics"]
    width = max([len("metric")] + [len(r["metric"]) for r in rows])
    lines = [f"committed: {report['committed']} (psd {report.get('committed_psd_version')}); "
             f"now: psd {report.get('now_psd_version')}", "",
             f"{'metric':<{width}}  {'committed':>9}  {'now':>9}  {'change %':>8}  {'noise %':>7}  verdict"]
    for r in rows:
        verdict = r["verdict"] + (f" ({r['direction']})" if r["direction"] else "")
        noise = _fmt(r["noise_pct"], ".0f") + ("" if r["noise_from"] == "reps" else "*")
        lines.append(f"{r['metric']:<{width}}  {r['committed']:>9.3f}  {r['now']:>9.3f}  "
                     f"{_fmt(r['change_pct'], '+.1f'):>8}  {noise:>7}  {verdict}")
    lines += ["", f"{report['moved']} moved beyond the noise, {report['worse']} of them worse; "
              "* the default noise (no spread of reps on both sides)"]
    groups: dict[str, list[str]] = {}
    for u in report["unmatched"]:
        reason = u["reason"]
        if reason.startswith("not measured now"):
            reason = "not measured now"
        groups.setdefault(reason, []).append(u["metric"])
    for reason, names in groups.items():
        shown = "; ".join(names[:4]) + (f"; and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(f"committed, unmatched ({reason}): {len(names)}: {shown}")
    if report["new"]:
        names = [n["metric"] for n in report["new"]]
        lines.append(f"new (nothing committed to compare with): {len(names)}: " + "; ".join(names[:4])
                     + (f"; and {len(names) - 4} more" if len(names) > 4 else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--committed", type=Path, default=COMMITTED, help=f"the results to compare with ({COMMITTED})")
    p.add_argument("--now", type=Path, help="compare this bench.json instead of measuring")
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    p.add_argument("--learners", type=int, nargs="+", default=list(DEFAULT_LEARNERS))
    p.add_argument("--reps", type=int, default=3, help="reps of each measure (2 or more give the noise)")
    p.add_argument("--duration", type=float, help="seconds per round-trip measure (default: psd bench's)")
    p.add_argument("--training", action="store_true", help="also compare training samples/s over Hogwild's")
    p.add_argument("--batches", type=int, nargs="+", help="mini-batch sizes for --training")
    p.add_argument("--no-limits", action="store_true", help="skip the update loop's fractions of the limit")
    p.add_argument("--no-view", action="store_true", help='skip pull="view" (psd_view)')
    p.add_argument("--quick", action="store_true", help="psd bench --quick's limits and durations")
    p.add_argument("--noise", type=float, default=0.25, help="relative noise where the reps give none (0.25)")
    p.add_argument("--min-noise", type=float, default=0.05, help="the least noise a spread of reps gives (0.05)")
    p.add_argument("--strict", action="store_true", help="exit 1 when something got worse beyond its noise")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = p.parse_args(argv)
    try:
        committed = json.loads(args.committed.read_text())
    except (OSError, ValueError) as e:
        p.error(f"cannot read the committed results {args.committed}: {e}")

    def log(line: str) -> None:  # progress on stderr: stdout is the table, or strict JSON
        print(line, file=sys.stderr, flush=True)

    now = json.loads(args.now.read_text()) if args.now else measure(args, log, committed.get("server_threads", 1))
    report = {"committed": str(args.committed), "committed_psd_version": committed.get("psd_version"),
              "now_psd_version": now.get("psd_version"), "llc_bytes": now.get("llc_bytes"),
              "noise_default_pct": 100 * args.noise, "min_noise_pct": 100 * args.min_noise,
              **compare(committed, now, args.noise, args.min_noise)}
    print(json.dumps(report, indent=2, allow_nan=False) if args.json else text(report))
    return 1 if args.strict and report["worse"] else 0


if __name__ == "__main__":
    sys.exit(main())
