"""psd: a shared-memory parameter server for asynchronous training on one machine.

A server (``psd serve``) holds one copy of a model's weights in shared memory;
learner processes attach with ``psd.learner.attach`` and push gradients through
per-learner rings that a native update loop applies in place.
"""

from __future__ import annotations

__version__ = "0.1.0"

from psd.errors import (
    ArenaBusy,
    ArenaCorrupt,
    Error,
    InvalidJobName,
    JobNotFound,
    NoFreeSlot,
    OutOfSharedMemory,
    ServerGone,
    SlotLost,
    SpecError,
    SpecMismatch,
    StateError,
    Timeout,
    VersionMismatch,
)

__all__ = [
    "ArenaBusy",
    "ArenaCorrupt",
    "Error",
    "InvalidJobName",
    "JobNotFound",
    "NoFreeSlot",
    "OutOfSharedMemory",
    "ServerGone",
    "SlotLost",
    "SpecError",
    "SpecMismatch",
    "StateError",
    "Timeout",
    "VersionMismatch",
    "__version__",
]
