"""The README's figures and where they come from: the machine record every benchmark writes, results that a
failing run leaves as they were, and README commands and results files that exist."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, child_env
from psd.bench.record import MACHINE_FIELDS, command_line, machine, machine_line, staged, write_results


def test_the_machine_record_has_every_field(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: Fake\nmodel name\t: Fake CPU 9000 @ 3.00GHz\n\n"
                       "processor\t: 1\nmodel name\t: Fake CPU 9000 @ 3.00GHz\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree:         1000 kB\n")
    cache = tmp_path / "cache" / "index3"
    cache.mkdir(parents=True)
    (cache / "level").write_text("3\n")
    (cache / "type").write_text("Unified\n")
    (cache / "size").write_text("16384K\n")
    m = machine(cpuinfo, meminfo, tmp_path / "cache")
    assert set(MACHINE_FIELDS) <= set(m)
    assert m["cpu_model"] == "Fake CPU 9000 @ 3.00GHz"
    assert m["memory_bytes"] == 16384000 * 1024
    assert m["llc_bytes"] == 16 << 20 and "L3" in m["llc_source"]
    assert m["cpus"] >= 1 and 1 <= m["cpus_usable"] <= m["cpus"]
    assert m["python"] and m["torch"] and m["psd"] and m["date"]
    line = machine_line(m)
    assert "Fake CPU 9000" in line and "16 MiB last-level cache" in line and "15.6 GiB memory" in line
    json.dumps(m, allow_nan=False)  # strict JSON, as the results files are


def test_this_machine_is_recorded_without_a_default():
    m = machine()
    assert set(MACHINE_FIELDS) <= set(m)
    assert m["cpus"] and m["cpus_usable"] and m["python"] and m["date"]
    assert m["cpu_model"], "no CPU model read from /proc/cpuinfo"
    assert m["memory_bytes"] and m["memory_bytes"] > 1 << 20


def test_a_failing_run_leaves_the_results_untouched(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "bench.json").write_text("committed")
    (out / "bench.md").write_text("committed table")
    with pytest.raises(RuntimeError, match="plot failed"), staged(out) as s:
        s.write_text("bench.json", "new")
        s.write_text("bench.md", "new table")
        raise RuntimeError("plot failed")  # as savefig would, after the tables were written
    assert (out / "bench.json").read_text() == "committed"
    assert (out / "bench.md").read_text() == "committed table"
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]  # no staging left behind


def test_a_run_that_succeeds_replaces_every_file_at_once(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "recovery.json").write_text("old")
    result = {"machine": machine(), "command": command_line(["benchmarks/recovery.py", "--rounds", "2"]), "x": 1}
    write_results(out, "recovery", result, "# new\n")
    assert json.loads((out / "recovery.json").read_text())["command"] == "python benchmarks/recovery.py --rounds 2"
    assert (out / "recovery.md").read_text() == "# new\n"
    assert sorted(p.name for p in out.iterdir()) == ["recovery.json", "recovery.md"]


@pytest.mark.timeout(60)
def test_run_all_without_matplotlib_stops_before_measuring(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "bench.json").write_text("committed")
    # matplotlib made unimportable in this process alone, whether or not it is installed
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['run_all.py', '--quick', '--out', {str(out)!r}]; "
            f"runpy.run_path({str(ROOT / 'benchmarks' / 'run_all.py')!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode != 0
    assert "pip install -e '.[bench]'" in r.stderr and "Nothing was measured" in r.stderr
    assert "limit" not in r.stdout  # nothing ran
    assert (out / "bench.json").read_text() == "committed"
    assert [p.name for p in out.iterdir()] == ["bench.json"]


def test_the_readme_names_commands_and_results_that_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in pages)
    for page in pages:  # every relative link of the README and the docs pages leads to a file
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
    scripts = set(re.findall(r"python (benchmarks/[\w/]+\.py)", text))
    results = set(re.findall(r"(benchmarks/results/[\w/.-]+\.(?:md|json|png))", text))
    assert scripts and results
    for path in sorted(scripts | results):
        assert (ROOT / path).exists(), f"the README names {path}, which does not exist"
