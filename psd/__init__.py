"""psd: a shared-memory parameter server for asynchronous training on one machine.

A server (``psd serve``) holds one copy of a model's weights in shared memory;
learner processes attach with ``psd.learner.attach`` and push gradients through
per-learner rings that a native update loop applies in place.
"""

from __future__ import annotations

from psd import errors
from psd._version import __version__
from psd.errors import *  # noqa: F403  (the exception classes are psd's public API)

__all__ = [*errors.__all__, "__version__"]
