"""psd's exceptions: one base class, `psd.Error`, and a subclass per thing a user can act on.

The C core returns codes; ``psd._native`` turns each into one of these classes
through a single table (see native/py_module.c). Plain errno values come out as
``OSError`` subclasses, so ``FileNotFoundError`` and ``PermissionError`` work as
usual. Every message says what went wrong and what to do next.
"""

from __future__ import annotations

__all__ = [
    "ArenaBusy",
    "ArenaCorrupt",
    "ArenaIncomplete",
    "ArenaLost",
    "Error",
    "Evicted",
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
]


class Error(Exception):
    """Base class of every psd error."""


class InvalidJobName(Error, ValueError):
    """A job name that could not safely name a shared-memory object."""


class JobNotFound(Error, FileNotFoundError):
    """No arena exists for the job: its server is not running."""


class ArenaCorrupt(Error):
    """The shared-memory object is not a psd arena (bad magic)."""


class ArenaLost(Error):
    """The arena's file was truncated under this process's mapping (by another process): what it held is gone
    for this mapping. Raised in the processes that supervise a job (the watchdog, `psd run`, `psd status`),
    which outlive the fault (``psd.arena.recover_from_sigbus``); the server and the learners die of SIGBUS
    instead, and the watchdog restarts them."""


class VersionMismatch(Error):
    """The arena was made by a psd whose layout this psd cannot read."""

    def __init__(self, op: str, name: str, made_by: str = "?", their_layout: int = 0,
                 our_layout: int = 0) -> None:
        from psd._version import __version__

        self.made_by = made_by
        self.their_layout = their_layout
        self.our_layout = our_layout
        theirs = f"arena layout {their_layout}"
        if their_layout == our_layout:  # same version number, other struct sizes: the layout fingerprint differs
            theirs += " but another build's struct sizes (another compiler, architecture or patched psd)"
        super().__init__(
            f"{op}: {name} was made by psd {made_by or '?'} ({theirs}), "
            f"but this is psd {__version__} (arena layout {our_layout}); use the same psd version "
            f"for the server and its learners, or stop the old job and remove it with `psd clean`"
        )


class NoFreeSlot(Error):
    """Every learner slot of the job is taken."""


class StateError(Error):
    """The arena is not in the state the operation needs."""


class SpecError(Error):
    """A parameter spec that cannot be used."""


class SpecMismatch(SpecError):
    """A learner's model differs from the job's parameter spec."""


class ArenaIncomplete(ArenaCorrupt):
    """The arena is being created right now (or its creator died while creating it)."""


class ArenaBusy(Error):
    """Arena memory is still referenced by tensors, so it cannot be unmapped."""


class ServerGone(Error):
    """The job's server died or stopped."""


class Timeout(Error, TimeoutError):
    """A bounded wait ran out."""


class Evicted(Error):
    """The server evicted this process from the job: something in it wrote into its slot what no learner
    writes (a stray pointer, a wrong tensor view). It is refused a slot for the rest of the job."""


class SlotLost(Error):
    """The server took this learner's slot back (it was thought dead)."""


class OutOfSharedMemory(Error):
    """/dev/shm has not enough free space for the arena."""
