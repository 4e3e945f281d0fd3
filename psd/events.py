"""The job's event log: one JSON object per line for every admission, death, restart, checkpoint, rejection.

Several processes of a job (server, watchdog, launcher) append to the same
file; each event is one write() of one line to a file opened with O_APPEND,
so lines never interleave. A log that cannot be written is reported once and
then left alone: training never stops for it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

__all__ = ["EventLog", "default_path"]

log = logging.getLogger("psd.events")


def default_path(job: str) -> Path:
    """Where a job's events go unless told otherwise: ~/.local/state/psd/events/JOB.jsonl."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "psd" / "events" / f"{job}.jsonl"


class EventLog:
    """Append-only JSON-lines log of one job; ``EventLog(None)`` logs nothing."""

    def __init__(self, path: str | os.PathLike | None, job: str, source: str) -> None:
        self.path = Path(path) if path else None
        self.job = job
        self.source = source
        self._broken = False

    def emit(self, event: str, **fields) -> None:
        """Append ``{"ts", "job", "source", "pid", "event", **fields}`` as one line."""
        if self.path is None or self._broken:
            return
        record = {"ts": round(time.time(), 6), "job": self.job, "source": self.source, "pid": os.getpid(),
                  "event": event, **fields}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:
            self._broken = True
            log.warning("cannot write the event log %s (%s); events are not logged from now on", self.path, e)
