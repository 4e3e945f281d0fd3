"""The arena fuzzer: damaged and foreign files at /dev/shm/psd.<job> are clear errors, never crashes.

tests/helpers/arena_fuzz.py makes a real arena whose server died, derives a seeded, bounded set of cases
from it (truncations; random bytes in the header and in each region; random data, an ELF binary, another
layout version or build, a foreign byte order, an empty file, a file never completed) and gives each to
`psd status`, `psd inspect`, `psd clean`, `psd serve --resume` (in-process Server) and `learner.attach`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import HELPERS, child_env
from psd.arena import shm_path

TARGETS = ("status", "inspect", "clean", "serve --resume", "learner attach")


@pytest.mark.timeout(180)
def test_damaged_and_foreign_arenas_are_clear_errors_never_crashes(job, tmp_path):
    try:
        r = subprocess.run([sys.executable, str(HELPERS / "arena_fuzz.py"), job, "13", str(tmp_path)],
                           capture_output=True, text=True, env=child_env(), timeout=150)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"hung on {out.splitlines()[-1:] or 'the template'}")
    finally:
        if os.path.exists(shm_path(job)):
            os.unlink(shm_path(job))
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    last = next((x for x in reversed(lines) if "target" in x), None)
    assert r.returncode == 0, f"died with {r.returncode} on {last}:\n{r.stderr[-3000:]}"
    calls = list(zip(lines[::2], lines[1::2], strict=True))
    assert {c["target"] for c, _ in calls} == set(TARGETS)
    assert len(calls) >= 150, "every case reaches every target"
    bad = [(c, o["outcome"]) for c, o in calls if not (o["outcome"] == "ok" or o["outcome"].startswith("error: "))]
    assert not bad, bad
    # A damaged or foreign arena is refused, and the message says what to do about it.
    for c, o in calls:
        if o["outcome"] != "ok":
            assert "`psd " in o["outcome"] or "attach the same" in o["outcome"], (c, o)
    refused = {c["case"] for c, o in calls if c["target"] == "inspect" and o["outcome"] != "ok"}
    for case in ("empty file", "random page", "another program's file (an ELF binary)", "another layout version",
                 "another fingerprint", "foreign byte order", "never completed (no magic)",
                 "truncated to 4096 bytes", "truncated to 100 bytes"):
        assert case in refused, f"{case}: psd inspect did not refuse it"
    assert all(c["case"] in refused for c, _ in calls if c["case"].startswith("truncated")), "every truncation"
