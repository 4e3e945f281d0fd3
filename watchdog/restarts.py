"""The one back-off of every restart psd makes: the watchdog's server restarts, its node link's, and
``psd run``'s learners and virtual workers. Each counts the failures of a crash loop in its own way (the
watchdog forgives a restart after 300 s of health, ``psd run`` counts lives without progress); all of them
wait ``Backoff.delay(n)`` before the restart that follows the n-th counted failure."""

from __future__ import annotations

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
