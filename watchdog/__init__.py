"""psd.watchdog: supervision, checkpoints, and the launcher behind ``psd run``.

- ``psd.watchdog.checkpoint``: consistent, atomic, checksummed safetensors checkpoints;
- ``psd.watchdog.supervisor``: the watchdog that keeps a job's server alive (``psd serve``);
- ``psd.watchdog.launcher``: ``psd run``, the watchdog plus N supervised learner processes;
- ``psd.watchdog.restarts``: the back-off all of them wait before a restart.
"""

__all__ = ["checkpoint", "launcher", "restarts", "supervisor"]
