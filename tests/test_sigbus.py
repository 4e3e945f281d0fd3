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


LOSE = """
import os, sys
from psd import ArenaLost, _native
from psd.arena import HeaderView, open_job, recover_from_sigbus, shm_path
from psd.watchdog import checkpoint
recover_from_sigbus()  # as the watchdog, `psd run` and `psd status` do
job, other = sys.argv[1], sys.argv[2]
a = open_job(job)
print("params", HeaderView(a).n_params, "lost", a.lost(), flush=True)
os.truncate(shm_path(job), _native.HEADER_SIZE)  # a learner would do this: the header stays, the weights go
for what, read in (("snapshot", lambda: checkpoint.snapshot(a, job)), ("field", lambda: HeaderView(a).clock),
                   ("header", a.header), ("remap", a.remap)):
    try:
        read()
        print(what, "read", flush=True)
    except ArenaLost:
        print(what, "lost", flush=True)
print("lost", a.lost(), flush=True)
a.close()
b = open_job(other)  # a new mapping, perhaps at the addresses of the lost one
print("other params", HeaderView(b).n_params, "lost", b.lost(), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_supervising_process_outlives_a_truncated_arena_and_reads_nothing_from_it(job):
    """The watchdog, `psd run` and `psd status` recover from a SIGBUS on an arena (psd.arena.recover_from_sigbus):
    the arena truncated under a checkpoint's copy of the weights, every read of it after is ArenaLost, never the
    zeros that replaced the mapping (a checkpoint of zeros would be the job's newest), and the process lives on:
    a mapping of another arena reads as it should."""
    from conftest import read_line, spawn

    other = job + "-other"
    procs = []
    try:
        for j in (job, other):
            procs.append(subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--no-watchdog", "--job", j,
                                           "--learners", "1", "--lr", "1"], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True, env=child_env()))
            pusher = spawn("pusher.py", j, "--n", "262144", "--count", "5")
            procs.append(pusher)
            assert read_line(pusher, timeout=60) == "ready"
        r = subprocess.run([sys.executable, "-c", LOSE, job, other], capture_output=True, text=True,
                           env=child_env(), timeout=60, preexec_fn=_no_core)
        server = procs[0]
        server.wait(timeout=30)
        err = server.stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
        for j in (job, other):
            if os.path.exists(f"/dev/shm/psd.{j}"):
                os.unlink(f"/dev/shm/psd.{j}")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[0] == "params 262147 lost False", lines
    assert lines[1:6] == ["snapshot lost", "field lost", "header lost", "remap lost", "lost True"], lines
    assert lines[6] == "other params 262147 lost False", lines
    assert server.returncode == ARENA_LOST_EXIT, err  # the server dies of it, as before: its watchdog restarts it


PARALLEL = """
import mmap, os, sys
import torch
from psd.arena import recover_from_sigbus
recover_from_sigbus()
trials, threads, n = int(sys.argv[1]), int(sys.argv[2]), 16 << 20
torch.set_num_threads(threads)
kept = []  # Python's mmap never unmaps through psd (psd_sigbus_forget): each trial takes an entry of the lost table
for i in range(trials):
    path = f"/dev/shm/psd.{sys.argv[3]}-{i}"
    with open(path, "w+b") as f:
        f.truncate(n)
        m = mmap.mmap(f.fileno(), n)
    os.truncate(path, 0)  # another process would do this
    os.unlink(path)
    t = torch.frombuffer(m, dtype=torch.float32)
    assert not t.clone().any()  # every thread of the copy faults, on the same mapping
    kept.append((m, t))
print("survived", trials, flush=True)
"""


@pytest.mark.timeout(120)
def test_the_threads_of_a_parallel_copy_all_outlive_the_truncation(job):
    """torch copies a large tensor on several threads (a checkpoint's clone in the watchdog): each faults on the
    truncated mapping, and one that looked the fault up after another had replaced the mapping found an anonymous
    one, "not an arena", and killed the process; threads that faulted together each took an entry of the lost
    table for one mapping, and the table ran out. Many trials, so that threads fault together in some."""
    r = subprocess.run([sys.executable, "-c", PARALLEL, "60", "4", job], capture_output=True, text=True,
                       env=dict(child_env(), OMP_NUM_THREADS="4"), timeout=100, preexec_fn=_no_core)
    for leftover in (f"/dev/shm/psd.{job}-{i}" for i in range(60)):
        if os.path.exists(leftover):
            os.unlink(leftover)
    assert r.returncode == 0 and r.stdout == "survived 60\n", (r.returncode, r.stdout, r.stderr[-2000:])
