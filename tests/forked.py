"""Learner scripts started as `python SCRIPT ARGS` would run them, forked from a process that has imported torch.

A learner started with ``subprocess.Popen([sys.executable, script, ...])`` imports torch again (1.5-3 s of CPU
on a small machine), which tests that start dozens of learners pay in full. ``start(argv, env)`` runs the same
script, arguments and environment in a child of multiprocessing's fork server with torch and psd.learner
imported once (as `psd run --fork-server` starts a job's learners): a process of its own, the script run as
``__main__``, its stdout and stderr kept apart, its exit status its own. What it returns answers the
``subprocess.Popen`` calls the tests make (``pid``, ``poll``, ``wait``, ``communicate``, ``returncode``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile

PRELOAD = ["torch", "psd.learner", "psd.workloads"]


def _ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` (``argv`` without the interpreter) as the fork server's
    children do (psd.watchdog.forkserver.run_as_main), its stdout and stderr into the files ``out``, ``err``."""
    from psd.watchdog.forkserver import finish_interpreter, run_as_main

    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # read at torch's import in a fresh interpreter; here, now
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        run_as_main(argv, env)  # a SystemExit's code is the child's exit status (multiprocessing's)
    finally:
        finish_interpreter()


class Forked:
    """A forked script with the ``subprocess.Popen`` calls the tests make (text output)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        if argv[0] != sys.executable or argv[1].startswith("-"):
            raise ValueError(f"not `{sys.executable} SCRIPT ...`: {argv}")
        self._dir = tempfile.mkdtemp(prefix="psd-forked-")
        self._out, self._err = os.path.join(self._dir, "out"), os.path.join(self._dir, "err")
        self._proc = _ctx().Process(target=_run, args=(argv[1:], env, self._out, self._err))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        texts = []
        for path in (self._out, self._err):
            with open(path) as f:
                texts.append(f.read())
            os.unlink(path)
        os.rmdir(self._dir)
        return texts[0], texts[1]

    def kill(self) -> None:
        if self.poll() is None:
            self._proc.kill()


def start(argv: list[str], env: dict[str, str]) -> Forked:
    """``python SCRIPT ARGS`` (``argv[0]`` is ``sys.executable``) in ``env``, forked with torch imported."""
    return Forked(argv, env)
