"""The C core alone, compiled with -Wall -Wextra -Werror and run under ThreadSanitizer and
AddressSanitizer + UndefinedBehaviorSanitizer (tests/native/stress.c says what it checks)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import ROOT

SOURCES = sorted(p for p in (ROOT / "native").glob("*.c") if not p.name.startswith("py_"))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to build the native stress test")
@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_native_stress_under_sanitizer(sanitizer, tmp_path):
    exe = tmp_path / "stress"
    build = subprocess.run(
        ["gcc", "-std=c11", "-O1", "-g", f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer",
         "-fno-sanitize-recover=all", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas",
         f"-I{ROOT / 'native'}", *map(str, SOURCES), str(ROOT / "tests" / "native" / "stress.c"),
         "-o", str(exe), "-lpthread", "-lm"],
        capture_output=True, text=True,
    )
    if build.returncode != 0 and "cannot find" in build.stderr and "san" in build.stderr:
        pytest.skip(f"gcc has no {sanitizer} sanitizer runtime here")
    assert build.returncode == 0, build.stderr
    env = dict(os.environ,
               TSAN_OPTIONS=f"halt_on_error=1 suppressions={ROOT / 'tests' / 'native' / 'tsan.supp'}",
               ASAN_OPTIONS="detect_leaks=1", UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1")
    run = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "WARNING" not in run.stderr and "ERROR" not in run.stderr, run.stderr
    assert run.stdout.strip().endswith(", 0 failed")
