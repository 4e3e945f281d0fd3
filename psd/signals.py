"""A stop flag that a signal handler may set.

Python runs a signal handler in the main thread between two bytecodes, wherever that thread is, including inside
``threading.Event.wait()`` or ``set()`` while it holds the event's lock. A handler that calls ``Event.set()`` there
takes that lock again and blocks for ever (or, with more signals coming, nests until ``RecursionError``): a
``psd serve`` told to stop then never stops. ``SignalFlag.set()`` takes no lock: it stores a flag and writes a byte
down a pipe, and ``wait()`` sleeps in ``poll()`` on that pipe, which a signal interrupts and Python resumes.
``nudge()`` wakes the wait without setting the flag: a poll loop's "look now" (a SIGCHLD handler's: a child died).
"""

from __future__ import annotations

import math
import os
import select
import time
import weakref
from collections.abc import Sequence
from typing import Protocol


class Stop(Protocol):
    """What a poll loop asks of its stop: a ``threading.Event`` or a ``SignalFlag``."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


def _close(fds: list[int]) -> None:
    for i, fd in enumerate(fds):
        if fd >= 0:
            fds[i] = -1
            try:
                os.close(fd)
            except OSError:
                pass


class SignalFlag:
    """``threading.Event``'s ``set`` / ``is_set`` / ``wait`` / ``clear``, safe to ``set()`` from a signal handler
    and from any thread. ``wait()`` is for poll loops; ``clear()`` is for the one consumer of a request (a
    checkpoint asked for with SIGUSR1). The pipe is closed by ``close()`` or when the flag is collected; a
    closed flag still sets and reads its flag, and its ``wait()`` sleeps out its timeout unless the flag is set."""

    def __init__(self) -> None:
        self._flag = False
        self._nudged = False
        r, w = os.pipe()  # non-inheritable: no exec'd child keeps it open
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._fds = [r, w]
        self._finalize = weakref.finalize(self, _close, self._fds)

    def set(self) -> None:
        """Set the flag and wake every ``wait()``. Takes no lock, never blocks, never raises."""
        self._flag = True
        self._wake()

    def is_set(self) -> bool:
        """Whether ``set()`` was called since the last ``clear()``."""
        return self._flag

    def clear(self) -> None:
        """Unset the flag and drop the wake-ups (and nudges) written so far. A ``set()`` racing with it keeps its
        flag and its wake-up: the flag is cleared before the pipe is drained, and a flag set again meanwhile is
        woken for again."""
        self._flag = False
        self._nudged = False
        self._drain()
        if self._flag:
            self._wake()

    def nudge(self) -> None:
        """Wake the ``wait()`` under way (or the next one) without setting the flag: it returns early, with the
        flag as it is. For a poll loop's one waiter (a SIGCHLD handler's "a child died: look now"). Takes no lock,
        never blocks, never raises."""
        self._nudged = True
        self._wake()

    def wait(self, timeout: float | None = None, also: Sequence[int] = ()) -> bool:
        """Sleep until the flag is set, a ``nudge()``, one of the descriptors ``also`` is readable (it is not read:
        a socket whose messages the caller takes), or ``timeout`` seconds pass; returns the flag."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag:
            if self._nudged:
                self._nudged = False
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            r = self._fds[0]
            if r < 0 and not also:  # closed: nothing can wake it but the deadline
                time.sleep(left if left is not None else 0.1)
                continue
            p = select.poll()  # not select(): it takes any descriptor number
            if r >= 0:
                p.register(r, select.POLLIN)
            for fd in also:
                p.register(fd, select.POLLIN)
            # a handler runs inside; PEP 475 resumes the poll with what is left of its timeout
            ready = p.poll(None if left is None else max(1, math.ceil(left * 1000)))
            if any(fd != r for fd, _ in ready):
                break  # one of ``also``: the caller's to read
            if ready and not self._flag:
                self._drain()  # a wake-up left from before a clear(): not this wait's
                if self._flag:  # a set() between the check and the drain: its wake-up, for any other wait()
                    self._wake()
        return self._flag

    def close(self) -> None:
        """Close the pipe now (else it closes when the flag is collected)."""
        self._finalize()

    def _wake(self) -> None:
        w = self._fds[1]
        if w < 0:
            return
        try:
            os.write(w, b"\0")
        except OSError:  # full of wake-ups already (every wait() is awake), or closed meanwhile
            pass

    def _drain(self) -> None:
        r = self._fds[0]
        if r < 0:
            return
        try:
            os.read(r, 1 << 16)  # one read, never a loop: a storm of signals must not keep it here
        except OSError:
            pass
