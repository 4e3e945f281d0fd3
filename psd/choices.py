"""The closed lists of values psd's settings take, and the default job name.

This module imports nothing of psd: the flag table (psd.flags), the server, the node link, the learner
client and the launcher all take their choices from here, so none of them has to import another for a list.
The order of a tuple matters where a C enum mirrors it (named below).
"""

from __future__ import annotations

import os

__all__ = ["ASYNC_MOMENTUM", "DEFAULT_JOB", "GRAD_DTYPES", "LEARNER_SCHED_CHOICES", "LIVENESS", "NODE_STATES",
           "OPTIMIZERS", "OUTER_OPTIMIZERS", "OVERLAP", "PULL_MODES", "SCHEDULES", "default_job"]

# --optimizer: the server's optimizers, in the order of enum psd_optimizer (psd_layout.h).
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "adagrad")
# --async-momentum, in the order of enum psd_async_momentum (psd_layout.h).
ASYNC_MOMENTUM = ("off", "auto")
# --overlap: whether an asp / ssp CPU learner pulls right after its push (on) or once the server applied it
# (off); auto: off, for every optimizer (psd_learners_wait_for_their_own in psd_layout.h decides;
# docs/training.md). GPU learners always take the hand-off.
OVERLAP = ("auto", "on", "off")
# --grad-dtype: what a CPU learner pushes of a dense gradient (float32, or bfloat16: half the bytes).
GRAD_DTYPES = ("float32", "bf16")
# --schedule: the server's learning-rate schedules.
SCHEDULES = ("constant", "step", "cosine")
# --outer-optimizer (several nodes); its index travels in the node link's join handshake.
OUTER_OPTIMIZERS = ("avg", "sum", "nesterov")
# --node-state (several nodes): whether the exchange combines the optimizer state too (psd/nodelink.py).
NODE_STATES = ("auto", "sum", "local")
# --liveness: how the server tells a dead learner.
LIVENESS = ("auto", "lease")
# How learners get the weights (attach(pull=...), PSD_PULL, psd run --pull, psd bench --pull-modes).
PULL_MODES = ("copy", "view")
# psd run --learner-sched (watchdog/launcher.py maps each to a policy; psd bench --learner-sched).
LEARNER_SCHED_CHOICES = ("auto", "normal", "batch", "idle")

DEFAULT_JOB = "default"


def default_job() -> str:
    """The job name used when none is given: $PSD_JOB, else ``default``."""
    return os.environ.get("PSD_JOB", DEFAULT_JOB)
