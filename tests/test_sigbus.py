"""The SIGBUS handler alone (native/sigbus.c): a fault on a truncated arena is a message and exit status
ARENA_LOST_EXIT; a fault anywhere else keeps its usual effect."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest

from conftest import child_env
from psd.arena import ARENA_LOST_EXIT

TOUCH = """
import mmap, os, sys
from psd.arena import install_sigbus_handler
install_sigbus_handler()
path = sys.argv[1]
with open(path, "w+b") as f:
    f.truncate(1 << 16)
    m = mmap.mmap(f.fileno(), 1 << 16)
os.truncate(path, 4096)  # another process would do this
print("touching", flush=True)
m[1 << 15]
print("survived", flush=True)
"""


def _no_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the default action of SIGBUS dumps core


def touch_truncated(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TOUCH, path], capture_output=True, text=True, env=child_env(),
                          timeout=60, preexec_fn=_no_core)


@pytest.mark.timeout(60)
def test_a_fault_on_a_truncated_arena_is_a_message_and_an_exit_status(job):
    path = f"/dev/shm/psd.{job}"
    try:
        r = touch_truncated(path)
    finally:
        os.unlink(path)
    assert r.returncode == ARENA_LOST_EXIT, (r.returncode, r.stderr)
    assert "touching" in r.stdout and "survived" not in r.stdout
    assert "psd: SIGBUS at address 0x" in r.stderr and f"in the arena {path}" in r.stderr
    assert "truncated or replaced" in r.stderr and "psd serve --resume" in r.stderr


@pytest.mark.timeout(60)
def test_a_fault_outside_an_arena_is_left_alone(tmp_path):
    r = touch_truncated(str(tmp_path / "not-an-arena"))
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stderr)
    assert "psd: SIGBUS" not in r.stderr
