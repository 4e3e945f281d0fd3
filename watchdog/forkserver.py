"""``psd run --fork-server``: start learners by forking a process that has already imported torch.

A learner restarted the usual way is a new interpreter that imports torch again (1.5-3 s on a small
machine) while its rank trains nothing; under faults that is most of the throughput lost. The fork
server is one child of ``psd run`` that imports torch and ``psd.learner`` once, then forks a learner
per request: the child sets its environment, its arguments and its session, and runs the script
(``runpy``) as ``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` would, so a restart costs a fork.

Protocol (JSON lines over a socketpair): ``psd run`` sends ``{"id", "argv", "env", "cwd"}``; the server
answers ``{"id", "pid"}`` once forked and ``{"pid", "exit"}`` when that child ends (``exit`` as
``Popen.returncode``: the status, or minus the signal). ``ForkServer`` is ``psd run``'s side; each
learner is a ``Forked``, with the ``Popen`` calls the launcher uses (``poll``, ``wait``,
``send_signal``, ``kill``, ``pid``, ``returncode``).

Forking after ``import torch`` is what torch's own DataLoader workers do; the server starts no
threads of its own and computes nothing before it forks.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["ForkServer", "Forked", "finish_interpreter", "forkable", "run_as_main"]


def forkable(command: list[str]) -> bool:
    """Whether ``command`` is ``python SCRIPT ...`` or ``python -m MODULE ...`` with this interpreter."""
    if len(command) < 2:
        return False
    exe = command[0]
    try:
        same = os.path.samefile(exe if os.sep in exe else (shutil.which(exe) or exe), sys.executable)
    except OSError:
        same = False
    if not same:
        return False
    if command[1] == "-m":
        return len(command) >= 3
    return not command[1].startswith("-") and Path(command[1]).is_file()


class Forked:
    """A learner forked by the fork server, with the ``subprocess.Popen`` calls ``psd run`` makes."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked learner {self.pid}", timeout or 0)
            self._server.pump(0.05 if left is None else min(0.05, left))
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """``psd run``'s side: start the server (``start``), fork learners (``spawn``), track their exits."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._buf = b""
        self._children: dict[int, Forked] = {}
        self._next = 0
        self._answers: dict[int, int] = {}
        self.alive = False
        self.ended = 0  # children's ends taken so far (by any pump: a poll, a spawn's wait for its answer)

    def start(self, env: dict[str, str], timeout: float = 120.0) -> None:
        """Start the fork server with ``env`` (its OMP_NUM_THREADS is every learner's) and wait until it
        has imported torch."""
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "psd.watchdog.forkserver", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        theirs.close()
        self._sock = ours
        end = time.monotonic() + timeout
        while not self.alive:
            if time.monotonic() > end or self.proc.poll() is not None:
                raise RuntimeError("psd run: the fork server did not start (see above)")
            for msg in self._read(0.1):
                if msg.get("ready"):
                    self.alive = True

    def _read(self, timeout: float) -> list[dict[str, Any]]:
        if self._sock is None:
            return []
        r, _, _ = select.select([self._sock], [], [], timeout)
        if not r:
            return []
        data = self._sock.recv(65536)
        if not data:  # the server is gone: its children got SIGTERM (PDEATHSIG)
            self.alive = False
            self._sock.close()
            self._sock = None
            for c in self._children.values():
                if c.returncode is None:
                    c.returncode = -signal.SIGTERM
            return []
        self._buf += data
        out = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            out.append(json.loads(line))
        return out

    def fileno(self) -> int | None:
        """The socket the server's messages come on (readable: a child was forked or ended), or None once closed."""
        return self._sock.fileno() if self._sock is not None else None

    def pump(self, timeout: float) -> None:
        """Take the server's messages: pids of new children, exits."""
        for msg in self._read(timeout):
            if "exit" in msg:
                c = self._children.get(msg["pid"])
                if c is not None:
                    c.returncode = int(msg["exit"])
                    self.ended += 1
            elif "id" in msg:
                self._answers[msg["id"]] = int(msg["pid"])

    def spawn(self, argv: list[str], env: dict[str, str], timeout: float = 30.0) -> Forked:
        """Fork a learner running ``argv`` (``python SCRIPT ...`` / ``python -m MODULE ...``) in ``env``."""
        if not self.alive or self._sock is None:
            raise RuntimeError("the fork server is not running")
        self._next += 1
        rid = self._next
        self._sock.sendall(json.dumps({"id": rid, "argv": argv, "env": env, "cwd": os.getcwd()}).encode() + b"\n")
        end = time.monotonic() + timeout
        while rid not in self._answers:
            if time.monotonic() > end or not self.alive:
                raise RuntimeError("the fork server did not answer")
            self.pump(0.05)
        child = Forked(self, self._answers.pop(rid))
        self._children[child.pid] = child
        return child

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.alive = False


def _prctl_pdeathsig() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _die_with_parent() -> None:
    _prctl_pdeathsig()


# -- the server process -------------------------------------------------------

def _child(req: dict[str, Any], sock: socket.socket, server_pid: int, wakeup: tuple[int, int]) -> None:
    """In the forked child: become the learner ``req`` asks for, run it, exit with its status."""
    code = 1
    try:
        sock.close()
        signal.set_wakeup_fd(-1)  # the server's SIGCHLD pipe (``wakeup``, serve's): not the learner's
        for fd in wakeup:
            os.close(fd)
        os.setsid()
        _prctl_pdeathsig()
        if os.getppid() != server_pid:  # the server died before the line above
            os._exit(1)
        for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(req["cwd"])
        run_as_main(req["argv"][1:], req["env"])
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            finish_interpreter()
        finally:
            os._exit(code & 0xFF if code >= 0 else 1)


def run_as_main(argv: list[str], env: dict[str, str]) -> None:
    """In a forked child: run ``argv`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``, without the interpreter) in
    ``env`` as ``python`` would, as ``__main__`` (a SystemExit it raises is the child's to turn into its exit
    status). Also tests/forked.py's."""
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[:0] = ["", *extra]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[:0] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
        runpy.run_path(argv[0], run_name="__main__")


def finish_interpreter() -> None:
    """What the interpreter does at exit, which a forked child that leaves by os._exit skips: join the
    non-daemon threads, run the atexit functions, flush stdout and stderr."""
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def serve(fd: int) -> int:
    """The fork server's loop: import torch and psd.learner, then fork one learner per request, and report each
    child's end as it happens (SIGCHLD wakes the loop through a pipe: a dead learner is restarted by ``psd run``
    in milliseconds, not at the loop's next look)."""
    sock = socket.socket(fileno=fd)
    import torch  # noqa: F401  (the point: children start with it imported)

    import psd.learner  # noqa: F401

    me = os.getpid()
    sock.sendall(b'{"ready": true}\n')
    buf = b""
    children: set[int] = set()
    # Leave at once (no interpreter teardown: torch's takes a while); the children follow (PDEATHSIG).
    signal.signal(signal.SIGTERM, lambda s, f: os._exit(0))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda s, f: None)  # a handler, so that the signal is delivered and written
    signal.set_wakeup_fd(wake_w)
    while True:
        r, _, _ = select.select([sock, wake_r], [], [], 0.5)
        if wake_r in r:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        if sock in r:
            data = sock.recv(65536)
            if not data:
                os._exit(0)  # psd run is gone
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, sock, me, (wake_r, wake_w))
                children.add(pid)
                sock.sendall(json.dumps({"id": req["id"], "pid": pid}).encode() + b"\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            sock.sendall(json.dumps({"pid": pid, "exit": code}).encode() + b"\n")


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
