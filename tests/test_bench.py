"""`psd bench` runs and reports every figure (the figures themselves are measured, not asserted), and
benchmarks/compare.py matches a run with committed results and says what moved."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT, child_env, strict_json
from psd.bench.kernels import DEFAULT_LLC_BYTES, cache_params, last_level_cache, parse_cache_size
from psd.server import auto_threads


@pytest.mark.timeout(120)
def test_bench_runs_the_jobs_at_the_server_threads_asked_and_skips_the_limits():
    """--server-threads reaches the round trips' servers (their header says so, read by the learners), and
    --no-limits leaves out the limits, the update loop and the kernels (minutes on a large cache)."""
    r = subprocess.run([sys.executable, "-m", "psd.cli", "bench", "--json", "--no-limits", "--no-peers",
                        "--no-training", "--sizes", "100000", "--learners", "1", "--duration", "0.3", "--reps", "1",
                        "--pull-modes", "copy", "--grad-dtypes", "float32", "--server-threads", "2"],
                       capture_output=True, text=True, env=child_env(), timeout=110)
    assert r.returncode == 0, r.stderr
    out = strict_json(r.stdout)
    assert out["server_threads"] == 2 and not {"limit", "update_loop", "kernels"} & set(out)
    (row,) = out["round_trip"]
    assert row["psd"]["server_threads"] == 2 and row["psd"]["updates_per_s"] > 0
    bad = subprocess.run([sys.executable, "-m", "psd.cli", "bench", "--server-threads", "-1"], capture_output=True,
                         text=True, env=child_env(), timeout=60)
    assert bad.returncode == 2 and "--server-threads must be 0 or more, not -1" in bad.stderr, bad.stderr


def _compare_module():
    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "benchmarks" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(300)
def test_bench_json_has_every_field():
    r = subprocess.run([sys.executable, "-m", "psd.cli", "bench", "--quick", "--json", "--sizes", "10000",
                        "--learners", "2", "--batches", "4", "--duration", "0.3", "--grad-dtypes", "float32"],
                       capture_output=True, text=True, env=child_env(), timeout=600)
    assert r.returncode == 0, r.stderr
    out = strict_json(r.stdout)
    assert out["server_threads"] == auto_threads() and out["round_trip"][0]["psd"]["server_threads"] == auto_threads()
    assert {"psd_version", "cpus", "llc_bytes", "llc_source", "llc_fallback", "limit", "kernels", "update_loop",
            "idle_server_cpu", "pull_modes", "grad_dtypes", "round_trip", "training", "optimizer_kernels"} <= set(out)
    # Every server optimizer against torch's fused one, at one thread and at every core.
    ok = out["optimizer_kernels"]
    assert {(x["optimizer"], x["threads"]) for x in ok} == {(o, t) for o in ("sgd", "momentum", "nesterov", "adam",
                                                                             "adamw", "adagrad")
                                                            for t in {1, out["cpus"]}}
    for x in ok:
        assert x["psd_ms"] > 0 and x["torch_fused_ms"] > 0 and x["vs_torch_fused"] > 0 and x["stream_gbs"] > 0
    assert out["llc_bytes"] > 0 and out["llc_source"]
    assert {x["kernel"] for x in out["kernels"]} == {"scalar", "vectorised", "unrolled x4", "unrolled x8"}
    assert all(x["gbs"] > 0 for x in out["kernels"])
    # Both limits, 1 and N threads, and the update loop at the same sizes as a fraction of each.
    assert {x["where"] for x in out["limit"]} == {x["where"] for x in out["update_loop"]} == {"dram", "cache"}
    assert [(x["where"], x["params"], x["threads"]) for x in out["limit"]] == \
        [(x["where"], x["params"], x["threads"]) for x in out["update_loop"]]
    for x in out["limit"] + out["update_loop"]:
        assert x["params"] > 0 and x["threads"] >= 1 and x["gbs"] > 0 and x["gbs_min"] <= x["gbs"] <= x["gbs_max"]
    for x in out["update_loop"]:
        assert x["fraction_of_limit"] > 0
        assert x["fraction_of_limit_min"] <= x["fraction_of_limit"] <= x["fraction_of_limit_max"]
    (cache_row, *_) = [x for x in out["limit"] if x["where"] == "cache"]
    assert cache_row["honest"] and cache_row["params"] == cache_params(out["llc_bytes"])
    assert not any(x["honest"] for x in out["limit"] if x["where"] == "dram")  # --quick says its DRAM is not one

    # bf16 gradients are the same measurement at another --grad-dtype (psd bench runs them by default);
    # the suite leaves them out for time (test_the_default_bench_measures_every_variant checks they are asked for).
    assert out["pull_modes"] == ["copy", "view"] and out["grad_dtypes"] == ["float32"]
    (row,) = out["round_trip"]
    names = ["psd", "psd_view"]
    for name in names:
        p = row[name]
        assert {"updates_per_s", "updates_per_s_min", "updates_per_s_max", "reps", "model_gbs", "pulls_per_update",
                "push_p50_us", "push_p99_us", "step_p50_us", "step_p99_us"} <= set(p)
        assert p["updates_per_s"] > 0 and p["model_gbs"] > 0 and p["pulls_counted"]
        assert 0 <= p["pulls_per_update"] <= 1.05  # a pull is skipped when the clock has not moved
        assert 0 < p["push_p50_us"] <= p["push_p99_us"] and 0 < p["step_p50_us"] <= p["step_p99_us"]
    assert 0 < row["psd"]["pulls_per_update"]
    for peer in ("hogwild", "hogwild_snapshot", "ddp_gloo"):
        assert row[peer]["updates_per_s"] > 0 and row[f"psd_over_{peer}"] > 0
    for name in names[1:]:
        assert row[f"{name}_over_hogwild"] > 0 and row[f"{name}_over_hogwild_snapshot"] > 0
        assert row[f"{name}_over_psd"] > 0
    (train,) = out["training"]
    for name in names:
        assert train[name]["samples_per_s"] > 0 and 0 <= train[name]["accuracy"] <= 1
        assert train[f"{name}_over_hogwild"] > 0
    assert train["hogwild"]["samples_per_s"] > 0


def test_the_default_bench_measures_every_variant():
    from psd.bench import BenchConfig

    assert BenchConfig().variants() == {"psd": ("copy", "float32", "auto"), "psd_view": ("view", "float32", "auto"),
                                        "psd_bf16": ("copy", "bf16", "auto"), "psd_view_bf16": ("view", "bf16", "auto")}
    assert BenchConfig.quick().variants() == BenchConfig().variants()
    assert BenchConfig(pull_modes=("copy",), grad_dtypes=("float32",)).variants() == \
        {"psd": ("copy", "float32", "auto")}
    assert BenchConfig(pull_modes=("copy",), grad_dtypes=("float32",), overlap_modes=("on", "off")).variants() == \
        {"psd": ("copy", "float32", "auto"), "psd_overlap_on": ("copy", "float32", "on"),
         "psd_overlap_off": ("copy", "float32", "off")}


@pytest.mark.parametrize("text, size", [("32768K", 32 << 20), ("1M", 1 << 20), ("512", 512), ("48K\n", 48 << 10),
                                        ("2G", 2 << 30)])
def test_cache_sizes_parse(text, size):
    assert parse_cache_size(text) == size


def test_the_last_level_cache_is_the_highest_data_or_unified_one(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1M"),
                                             (3, "Unified", "300M"), (4, "Instruction", "9M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    c = last_level_cache(tmp_path)
    assert (c.bytes, c.fallback) == (300 << 20, False) and "L3" in c.source
    gone = last_level_cache(tmp_path / "absent")
    assert gone.bytes == DEFAULT_LLC_BYTES and gone.fallback and gone.source.startswith("default")


def _committed_run(llc: int) -> dict:
    """A small committed result: one round-trip row (its psd/Hogwild ratio 10x and more off anything
    measured), an update-loop row of this format and one of the older (no "where")."""
    return {"psd_version": "test", "cpus": 2, "llc_bytes": llc,
            "update_loop": [{"where": "cache", "params": cache_params(llc), "threads": 1, "gbs": 50.0,
                             "fraction_of_limit": 0.5},
                            {"params": 25_000_000, "threads": 1, "gbs": 44.0, "fraction_of_limit": 0.87}],
            "round_trip": [{"params": 10_000, "learners": 1, "psd": {"updates_per_s": 1e6},
                            "hogwild": {"updates_per_s": 1e4}, "psd_over_hogwild": 100.0},
                           {"params": 10_000, "learners": 8, "psd": {"updates_per_s": 1e5},
                            "hogwild": {"updates_per_s": 1e5}, "psd_over_hogwild": 1.0}],
            "training": []}


@pytest.mark.timeout(300)
def test_compare_reports_a_ratio_far_off_as_moved(tmp_path):
    committed = tmp_path / "bench.json"
    committed.write_text(json.dumps(_committed_run(last_level_cache().bytes)))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--committed", str(committed),
                        "--json", "--strict", "--quick", "--sizes", "10000", "--learners", "1", "--reps", "1",
                        "--duration", "0.2", "--no-view"], capture_output=True, text=True, env=child_env(), timeout=600)
    assert r.returncode == 1, r.stderr  # --strict: the psd/Hogwild ratio is far worse than committed
    out = json.loads(r.stdout)
    by_name = {m["metric"]: m for m in out["metrics"]}
    far = by_name["round trip 10,000 params x1: psd / hogwild"]
    assert (far["verdict"], far["direction"], far["noise_from"]) == ("moved", "worse", "default")
    assert far["committed"] == 100.0 and 0 < far["now"] and far["change_pct"] < -25
    assert any(m["kind"] == "update_loop" and m["where"] == "cache" for m in out["metrics"])
    reasons = {u["metric"]: u["reason"] for u in out["unmatched"]}
    assert "older format" in reasons["update loop (no where) 25,000,000 params 1 thread(s): fraction of limit"]
    assert "not measured now" in reasons["round trip 10,000 params x8: psd / hogwild"]
    assert any(n["ratio"] == "psd_over_hogwild_snapshot" for n in out["new"])
    assert out["worse"] >= 1


def test_compare_noise_comes_from_the_reps_where_both_runs_kept_them():
    compare = _compare_module().compare

    def run(psd: tuple[float, float, float], hog: tuple[float, float, float], fraction: float) -> dict:
        def measure(v):
            return {"updates_per_s": v[1], "updates_per_s_min": v[0], "updates_per_s_max": v[2], "reps": 3}

        return {"round_trip": [{"params": 1000, "learners": 2, "psd": measure(psd), "hogwild": measure(hog),
                                "psd_over_hogwild": psd[1] / hog[1]}],
                "update_loop": [{"where": "dram", "params": 10, "threads": 2, "fraction_of_limit": fraction,
                                 "fraction_of_limit_min": fraction * 0.95, "fraction_of_limit_max": fraction * 1.05,
                                 "reps": 3}],
                "training": []}

    # Tight reps: a 20% drop (under the 25% default) is beyond the reps' spread.
    out = compare(run((99, 100, 101), (99, 100, 101), 0.9), run((79, 80, 81), (99, 100, 101), 0.6))
    rt, loop = sorted(out["metrics"], key=lambda m: m["kind"])
    assert (rt["noise_from"], rt["verdict"], rt["direction"]) == ("reps", "moved", "worse")
    assert 2 < rt["noise_pct"] < 10 and round(rt["change_pct"]) == -20
    assert (loop["verdict"], loop["direction"]) == ("moved", "worse")
    # Wide reps: the same drop is within their spread.
    out = compare(run((50, 100, 150), (99, 100, 101), 0.9), run((79, 80, 81), (99, 100, 101), 0.88))
    assert {m["verdict"] for m in out["metrics"]} == {"within noise"} and out["worse"] == 0
