"""`psd bench` runs and reports every figure (the figures themselves are measured, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import child_env


def test_bench_json_has_every_field():
    r = subprocess.run([sys.executable, "-m", "psd.cli", "bench", "--quick", "--json", "--sizes", "10000",
                        "--learners", "2", "--batches", "4", "--duration", "0.3"],
                       capture_output=True, text=True, env=child_env(), timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"psd_version", "cpus", "limit", "kernels", "update_loop", "idle_server_cpu", "round_trip",
            "training"} <= set(out)
    assert {x["kernel"] for x in out["kernels"]} == {"scalar", "vectorised", "unrolled x4", "unrolled x8"}
    assert all(x["gbs"] > 0 for x in out["kernels"])
    assert all(x["gbs"] > 0 for x in out["limit"] + out["update_loop"])
    assert 0 < out["update_loop"][0]["fraction_of_limit"]
    (row,) = out["round_trip"]
    assert {"updates_per_s", "model_gbs", "push_p50_us", "push_p99_us", "step_p50_us", "step_p99_us"} <= set(row["psd"])
    assert 0 < row["psd"]["push_p50_us"] <= row["psd"]["push_p99_us"]
    for peer in ("hogwild", "hogwild_snapshot", "ddp_gloo"):
        assert row[peer]["updates_per_s"] > 0 and row[f"psd_over_{peer}"] > 0
    (train,) = out["training"]
    assert train["psd"]["samples_per_s"] > 0 and 0 <= train["psd"]["accuracy"] <= 1
    assert train["hogwild"]["samples_per_s"] > 0 and train["psd_over_hogwild"] > 0
