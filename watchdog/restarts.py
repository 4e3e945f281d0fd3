"""The one restart policy and the one back-off of every restart and retry psd makes. ``RestartPolicy`` is what
each restarter knows about its crash loop: the watchdog's of its server and of its node link, ``psd run``'s of
each learner (or virtual worker). ``Backoff`` is the wait: before the restart that follows a counted failure
(``RestartPolicy.delay``), and between the tries of the node link's own waits (for its arena to hold weights,
for the clock, for the loop to stop, for a collective, for the other nodes at the rendezvous, to be let into
an epoch). A wait for something nothing announces polls through ``Backoff.tries``, at a fixed interval
(``Backoff.every``) where the thing waited for is due any moment."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from psd.signals import Stop

__all__ = ["Backoff", "RestartPolicy"]


@dataclass(frozen=True)
class Backoff:
    """``base`` seconds after the first counted failure, doubling with each one after, at most ``cap``."""

    base: float = 0.1
    cap: float = 10.0

    def delay(self, n: int) -> float:
        """Seconds to wait before restarting after the ``n``-th counted failure (0: none counted, no wait)."""
        if n <= 0:
            return 0.0
        # The doubling stops at 2**1000: a float holds no power of two past 2**1023, and a poll's try 1,025
        # (``every``'s, a little over a second at 1 ms) would raise OverflowError. Any base reaches its cap first.
        return min(self.cap, self.base * 2.0 ** min(n - 1, 1000))

    @classmethod
    def every(cls, interval: float) -> Backoff:
        """A back-off that does not grow: ``interval`` seconds between tries (a poll; 0: the next try at once)."""
        return cls(interval, interval)

    def tries(self, deadline: float | None = None, stop: Stop | None = None) -> Iterator[int]:
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
            wait = self.delay(n)
            if wait > 0:
                time.sleep(wait)


@dataclass
class RestartPolicy:
    """One restarter's rule for a crash loop (torch elastic's ``max_restarts``, with forgiveness): how many
    failures are counted and not yet forgiven (``count``), what forgives them, how many are too many, and how
    long to wait before the next restart.

    Each life that ends in a failure is recorded by ``failed()``. What forgives:

    - progress: a life that got further than every life before it (``failed(progress=True)``, ``psd run``'s
      learners) was no part of a crash loop; its failure is not counted and the earlier ones are forgiven
      (``count`` 0);
    - a long life: a life that ran longer than ``fresh_after`` seconds (since ``started()``; the node link's
      60 s) was healthy; the earlier failures are forgiven and its own is the first of a new loop (``count`` 1);
    - healthy running: every ``forgive_after`` seconds a life runs healthy (since ``healthy()``; the watchdog's
      server, 300 s) forgive one counted failure (``forgive_due()``), the next after as long again.

    ``exhausted`` once more than ``limit`` failures are counted (None: never): the restarter gives up instead
    of restarting. ``delay()`` is the back-off before the restart: ``backoff.delay(count - 1 + first_step)``,
    so that the first counted failure waits the back-off's step ``first_step`` (0: restarted at once, the
    watchdog's server; 1: ``backoff.base``, the node link; 2: twice that, a learner's).
    """

    backoff: Backoff = field(default_factory=Backoff)
    limit: int | None = None
    first_step: int = 1
    forgive_after: float | None = None
    fresh_after: float | None = None
    count: int = 0  # failures counted and not yet forgiven
    _started: float | None = None  # when the current life started (time.monotonic())
    _healthy_since: float | None = None  # when it became healthy, or last had a failure forgiven

    def started(self, now: float) -> None:
        """A life starts at ``now`` (``time.monotonic()``): what ``fresh_after`` measures."""
        self._started = now

    def healthy(self, now: float) -> None:
        """The life is healthy from ``now`` (``time.monotonic()``): what ``forgive_after`` measures."""
        self._healthy_since = now

    def failed(self, now: float | None = None, progress: bool = False) -> int:
        """Record the failure that ended a life, at ``now`` (``time.monotonic()``; needed with ``fresh_after``),
        after forgiving what it earned (above); returns ``count``."""
        if progress:
            self.count = 0
        elif (self.fresh_after is not None and self._started is not None and now is not None
              and now - self._started > self.fresh_after):
            self.count = 1
        else:
            self.count += 1
        return self.count

    def forgive_due(self, now: float) -> bool:
        """Forgive one counted failure if the life has run healthy for ``forgive_after`` seconds since it became
        healthy or last had one forgiven (the next needs as long again); returns whether it did."""
        if (not self.count or self.forgive_after is None or self._healthy_since is None
                or now - self._healthy_since < self.forgive_after):
            return False
        self.count -= 1
        self._healthy_since = now
        return True

    @property
    def exhausted(self) -> bool:
        """Whether more failures are counted than ``limit``: give up rather than restart."""
        return self.limit is not None and self.count > self.limit

    def delay(self) -> float:
        """Seconds to wait before the restart that follows the failure last recorded."""
        return self.backoff.delay(self.count - 1 + self.first_step)
