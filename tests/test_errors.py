"""Bad input gets an error that says what to do, and nothing breaks for the others.

The servers run without a watchdog (its last checkpoint costs seconds at each stop) but where a test
is about it (a second server for a running job names the first's watchdog).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
import torch

import psd
from conftest import child_env
from psd import learner
from psd.arena import shm_path


class Flat(torch.nn.Module):
    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


def psd_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psd.cli", *args], capture_output=True, text=True,
                          env=child_env(), timeout=60)


def test_attach_to_a_job_that_does_not_exist(job):
    with pytest.raises(psd.JobNotFound, match=rf"start its server first with `psd serve --job {job}"):
        learner.attach(Flat(), job=job)


def test_spec_mismatch_names_the_tensor_and_both_shapes(job, serve):
    serve(job, "--no-watchdog", "--learners", "2")
    with learner.attach(Flat(64), job=job):
        with pytest.raises(psd.SpecMismatch, match=r"'w' \[32\] float32 in this model but 'w' \[64\]"):
            learner.attach(Flat(32), job=job)

        class Extra(Flat):
            def __init__(self):
                super().__init__(64)
                self.z = torch.nn.Parameter(torch.zeros(2))

        with pytest.raises(psd.SpecMismatch, match=r"first one only this model has is 'z' \[2\]"):
            learner.attach(Extra(), job=job)


def test_more_learners_than_slots(job, serve):
    serve(job, "--no-watchdog", "--learners", "1")
    with learner.attach(Flat(), job=job):
        with pytest.raises(psd.NoFreeSlot, match=r"1 learner slot\(s\) and all are in use.*more --learners"):
            learner.attach(Flat(), job=job)
    with learner.attach(Flat(), job=job):  # the slot is back once the first one left
        pass


def test_arena_from_an_incompatible_version(job, serve):
    serve(job, "--no-watchdog", "--learners", "1")
    path = shm_path(job)
    with open(path, "r+b") as f:
        f.seek(8)
        (ours,) = struct.unpack("<I", f.read(4))
        f.seek(8)
        f.write(struct.pack("<I", 99))
    try:
        with pytest.raises(psd.VersionMismatch, match=rf"made by psd {psd.__version__} \(arena layout 99\), "
                           rf"but this is psd {psd.__version__} \(arena layout {ours}\)"):
            learner.attach(Flat(), job=job)
    finally:
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", ours))


def test_not_an_arena(job):
    with open(shm_path(job), "wb") as f:
        f.write(b"\0" * 8192)
    try:
        with pytest.raises(psd.ArenaCorrupt, match="psd clean"):
            learner.attach(Flat(), job=job)
    finally:
        os.unlink(shm_path(job))


@pytest.mark.parametrize("name", ["", "../etc/passwd", "a/b", "..", ".hidden", "x" * 65, "a b", "-x", "é"])
def test_invalid_job_names(name):
    with pytest.raises(psd.InvalidJobName, match="invalid job name"):
        learner.attach(Flat(), job=name or "\0")
    r = psd_cli("serve", f"--job={name}", "--learners", "1")
    assert r.returncode != 0 and "invalid job name" in r.stderr


def test_not_enough_shared_memory_at_start(job, tmp_path):
    from safetensors.torch import save_file

    init = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(1 << 20)}, str(init))
    r = psd_cli("serve", "--job", job, "--learners", "4096", "--ring-depth", "1024", "--init", str(init))
    assert r.returncode == 1
    assert "MiB of shared memory but /dev/shm has only" in r.stderr and "psd clean" in r.stderr
    assert not os.path.exists(shm_path(job))


def test_not_enough_shared_memory_for_a_learners_model(job, serve):
    """A model too big for /dev/shm is refused with numbers; a smaller one can still start the job."""
    s = serve(job, "--no-watchdog", "--learners", "64", "--ring-depth", "1024")
    with pytest.raises(psd.OutOfSharedMemory, match=r"needs [\d,.]+ MiB of shared memory"):
        learner.attach(Flat(1 << 20), job=job, timeout=30)
    with learner.attach(Flat(256), job=job) as ps:
        ps.step()
    assert "refused the model" in s.stop()


def test_second_server_for_a_running_job(job, serve):
    s = serve(job, "--learners", "1")
    r = psd_cli("serve", "--job", job)
    assert r.returncode == 1 and "already has a running server" in r.stderr
    assert f"watchdog pid {s.proc.pid}" in r.stderr
    assert os.path.exists(shm_path(job)), "the failed second server must not remove the first's arena"


@pytest.mark.parametrize("named", [True, False])
def test_a_server_names_its_watchdog_before_itself(job, named):
    """A server a watchdog starts writes that watchdog into the header before its own pid, which is what makes
    the server alive to others: a second `psd serve` then always finds the watchdog alive and refuses. It had
    adopted the server, as a watchdog whose predecessor died does, when it came before the first watchdog's
    own first look at the arena (a fresh clone's suite: test_second_server_for_a_running_job hung, two
    watchdogs on one job). Here this test process stands for the watchdog (the server's parent, named in
    PSD_SERVER_WATCHDOG) and never writes the header itself; a name that is not the server's parent is
    ignored, and the second `psd serve` adopts that server (what a restarted watchdog does)."""
    from psd import _native
    from psd.arena import wait_for_job
    from psd.server import WATCHDOG_ENV

    me = os.getpid() if named else os.getppid()
    env = child_env() | {WATCHDOG_ENV: f"{me}:{_native.proc_start_time(me)}"}
    server = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--no-watchdog", "--quiet", "--job", job,
                               "--learners", "1"], env=env, stderr=subprocess.DEVNULL)
    second = None
    try:
        wait_for_job(job, timeout=60, server_pid=server.pid)
        if named:
            r = psd_cli("serve", "--job", job)
            assert r.returncode == 1 and "already has a running server" in r.stderr, r.stderr
            assert f"watchdog pid {me}" in r.stderr, r.stderr
        else:
            second = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--job", job], env=child_env(),
                                      stderr=subprocess.PIPE, text=True)
            line = second.stderr.readline()
            assert "adopted running server pid" in line, line
    finally:
        if second is not None:
            second.terminate()
            second.wait(timeout=60)
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.parametrize("flags, message", [
    (["--ring-depth", "3"], "--ring-depth must be a power of two"),
    (["--learners", "0"], "--learners must be 1.."),
    (["--lr", "-1"], "--lr must be a positive number"),
])
def test_bad_serve_flags(flags, message):
    r = psd_cli("serve", "--job", "never-started", *flags)
    assert r.returncode != 0 and message in r.stderr


def test_flags_come_from_the_environment(job, serve):
    env = child_env() | {"PSD_RING_DEPTH": "5"}
    r = subprocess.run([sys.executable, "-m", "psd.cli", "serve", "--job", job], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode != 0 and "--ring-depth must be a power of two from 1 to 1024, not 5" in r.stderr


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_old_slots_name_still_works_with_a_warning_naming_ring_depth(how):
    flags, env = (["--slots", "5"], child_env()) if how == "flag" else ([], child_env() | {"PSD_SLOTS": "5"})
    r = subprocess.run([sys.executable, "-m", "psd.cli", "serve", "--job", "never-started", *flags],
                       capture_output=True, text=True, env=env, timeout=60)
    assert "deprecated" in r.stderr and ("--ring-depth" if how == "flag" else "PSD_RING_DEPTH") in r.stderr
    assert r.returncode != 0 and "--ring-depth must be a power of two from 1 to 1024, not 5" in r.stderr
