"""Shared fixtures: unique job names, a real `psd serve` process, child processes that report readiness.

Every test that starts a server checks, at teardown, that the server stopped
cleanly and left nothing in /dev/shm.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from psd.arena import open_job, shm_path, wait_for_job
from psd.errors import JobNotFound

ROOT = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"
_counter = itertools.count()


@pytest.fixture
def job() -> Iterator[str]:
    """A job name no other test uses; fails the test if its arena is left behind."""
    name = f"test-{os.getpid()}-{next(_counter)}"
    yield name
    path = shm_path(name)
    if os.path.exists(path):
        os.unlink(path)
        pytest.fail(f"{path} was left behind")


_STATE = tempfile.mkdtemp(prefix="psd-test-state-")


def child_env() -> dict[str, str]:
    """Environment for psd processes under test: default checkpoints go to a temporary directory."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["XDG_STATE_HOME"] = _STATE
    return env


def signalled_in_wait(log: Path, *argv: str, timeout: float) -> tuple[int, str]:
    """Run `psd ARGV` under helpers/serve_signalled_in_wait.py (SIGTERM at every line its main thread runs in
    its stop flag's wait; its arguments first: ``[--event] SECONDS``); its exit status and output. The output
    goes to the file ``log``, not a pipe: what a hung command leaves running would hold a pipe open."""
    with log.open("w") as out:
        rc = subprocess.run([sys.executable, str(HELPERS / "serve_signalled_in_wait.py"), *argv], stdout=out,
                            stderr=subprocess.STDOUT, timeout=timeout, env=child_env()).returncode
    return rc, log.read_text()


class Served:
    """A `psd serve` process for one job."""

    def __init__(self, job: str, *args: str) -> None:
        self.job = job
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "psd.cli", "serve", "--job", job, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
        )
        wait_for_job(job, timeout=30, server_pid=self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Stop it as a user would, return its log; asserts a clean exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, f"psd serve exited with {self.proc.returncode}:\n{out}"
        assert not os.path.exists(shm_path(self.job)), "a clean stop must remove the arena"
        return out


@pytest.fixture
def serve() -> Iterator:
    """serve(job, *flags) starts `psd serve`; every server still running at teardown is stopped."""
    started: list[Served] = []

    def start(job: str, *args: str) -> Served:
        s = Served(job, *args)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.stop()


def spawn(script: str, *args: str) -> subprocess.Popen:
    """Run tests/helpers/<script> with args; stdout is a pipe of lines."""
    return subprocess.Popen([sys.executable, str(HELPERS / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())


def read_line(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """The child's next stdout line, waiting at most ``timeout`` seconds.

    Reads the pipe's descriptor a byte at a time, never through the text wrapper: a buffered
    readline could take the child's later lines too, and ``communicate()`` (``finish``) reads the
    descriptor directly, so lines left in the wrapper's buffer would be lost.
    """
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise AssertionError(f"no line from pid {proc.pid} within {timeout} s (got {bytes(line)!r})")
            b = os.read(fd, 1)
            if not b:
                break
            line += b
    finally:
        sel.close()
    if not line:
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"pid {proc.pid} closed stdout (exit {proc.wait()}):\n{err}")
    return line.decode().strip()


def strict_json(text: str):
    """Parse ``text`` as strict JSON: NaN, Infinity and -Infinity (which json.loads takes) are errors."""
    import json

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def arena_header(job: str) -> dict:
    """The job's arena header, read the way `psd inspect` reads it."""
    a = open_job(job)
    try:
        return a.header()
    finally:
        a.close()


def header_if_any(job: str) -> dict | None:
    """The job's arena header, or None while it has no arena (a server replacing it unlinks it, then creates one)."""
    try:
        return arena_header(job)
    except JobNotFound:
        return None


def wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    """Poll ``predicate`` until it returns a true value or ``timeout`` passes (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        v = predicate()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def finish(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """Wait for a child to exit 0 and return its remaining stdout."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"pid {proc.pid} exited {proc.returncode}:\n{out}\n{err}"
    return out


@contextlib.contextmanager
def killed_at_exit(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc``, killed (and reaped) at the block's end if it still runs: a failed assertion leaves nothing running."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode == -sig


@pytest.fixture(scope="session", autouse=True)
def _state_dir_cleanup():
    yield
    import shutil

    shutil.rmtree(_STATE, ignore_errors=True)
