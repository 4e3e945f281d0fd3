"""A stop flag that a signal handler may set.

Python runs a signal handler in the main thread between two bytecodes, wherever that thread is, including inside
``threading.Event.wait()`` or ``set()`` while it holds the event's lock. A handler that calls ``Event.set()`` there
takes that lock again and blocks for ever (or, with more signals coming, nests until ``RecursionError``): a
``psd serve`` told to stop then never stops. ``SignalFlag.set()`` takes no lock: it stores a flag and writes a byte
down a pipe, and ``wait()`` sleeps in ``select()`` on that pipe, which a signal interrupts and Python resumes.
"""

from __future__ import annotations

import os
import select
import time
from typing import Protocol


class Stop(Protocol):
    """What a poll loop asks of its stop: a ``threading.Event`` or a ``SignalFlag``."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class SignalFlag:
    """``threading.Event``'s ``set`` / ``is_set`` / ``wait`` / ``clear``, safe to ``set()`` from a signal handler
    and from any thread. ``wait()`` is for the main thread's poll loops; ``clear()`` is for the one consumer of a
    request (a checkpoint asked for with SIGUSR1)."""

    def __init__(self) -> None:
        self._flag = False
        self._r, self._w = os.pipe()  # non-inheritable: no child keeps it open
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def set(self) -> None:
        """Set the flag and wake every ``wait()``. Takes no lock and never blocks."""
        self._flag = True
        self._wake()

    def is_set(self) -> bool:
        """Whether ``set()`` was called since the last ``clear()``."""
        return self._flag

    def clear(self) -> None:
        """Unset the flag and drop the wake-ups written so far. A ``set()`` racing with it keeps its flag and
        its wake-up: the flag is cleared before the pipe is drained, and a flag set again meanwhile is woken
        for again."""
        self._flag = False
        self._drain()
        if self._flag:
            self._wake()

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the flag is set or ``timeout`` seconds pass; returns the flag."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            ready, _, _ = select.select([self._r], [], [], left)  # a handler runs inside; PEP 475 resumes it
            if ready and not self._flag:
                self._drain()  # a wake-up left from before a clear(): not this wait's
        return self._flag

    def _wake(self) -> None:
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already: every wait() is awake
            pass

    def _drain(self) -> None:
        try:
            os.read(self._r, 1 << 16)  # one read, never a loop: a storm of signals must not keep it here
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close the pipe (the flag keeps its value)."""
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
