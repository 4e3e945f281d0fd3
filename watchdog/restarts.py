"""The one back-off of every restart and retry psd makes: the watchdog's server restarts, its node link's,
``psd run``'s learners and virtual workers, and the node link's own waits (for its arena to hold weights, for
the clock, for the loop to stop, for a collective, for the other nodes at the rendezvous). Each restarter
counts the failures of a crash loop in its own way (the watchdog forgives a restart after 300 s of health,
``psd run`` counts lives without progress); all of them wait ``Backoff.delay(n)`` before the restart that
follows the n-th counted failure. A wait for something nothing announces polls through ``Backoff.tries``,
at a fixed interval (``Backoff.every``) where the thing waited for is due any moment."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True)
class Backoff:
    """``base`` seconds after the first counted failure, doubling with each one after, at most ``cap``."""

    base: float = 0.1
    cap: float = 10.0

    def delay(self, n: int) -> float:
        """Seconds to wait before restarting after the ``n``-th counted failure (0: none counted, no wait)."""
        return 0.0 if n <= 0 else min(self.cap, self.base * 2 ** (n - 1))

    @classmethod
    def every(cls, interval: float) -> Backoff:
        """A back-off that does not grow: ``interval`` seconds between tries (a poll)."""
        return cls(interval, interval)

    def tries(self, deadline: float | None = None, stop: threading.Event | None = None) -> Iterator[int]:
        """Tries 0, 1, 2, ...: the first at once, try ``n`` after ``delay(n)`` seconds of sleep. After each try,
        none follows once ``stop`` is set or the ``time.monotonic()`` ``deadline`` has passed; a caller that
        found what it waited for leaves the loop (``break``, ``return``), and a ``for`` loop's ``else`` is the
        case where it never did."""
        n = 0
        while True:
            yield n
            if (stop is not None and stop.is_set()) or (deadline is not None and time.monotonic() > deadline):
                return
            n += 1
            time.sleep(self.delay(n))
