"""The shipped examples run as a user runs them, and learn."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT, child_env


def psd_run(job: str, tmp, learners: int, lr: str, *command: str) -> str:
    r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", str(learners),
                        "--lr", lr, "--checkpoint-dir", str(tmp), "--", sys.executable, *command],
                       capture_output=True, text=True, env=child_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("script, lr, pattern", [
    ("text_classifier.py", "0.5", r"intent accuracy (\d\.\d+)"),
    ("gpu_learner.py", "0.03", r"accuracy (\d\.\d+)"),
])
def test_example_learns(job, tmp_path, script, lr, pattern):
    out = psd_run(job, tmp_path, 2, lr, str(ROOT / "examples" / script), "--epochs", "2")
    accs = [float(a) for a in re.findall(pattern, out)]
    assert len(accs) == 2 and min(accs) > 0.9, out
