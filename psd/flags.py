"""The one declaration of psd's command-line flags.

Each :class:`Flag` gives a flag's name, the commands that take it, its
ServeConfig field (if it fills one), its default, its help and its
environment variable (``PSD_<FLAG>``: the flag in upper case, dashes as
underscores). ``psd/cli.py`` builds its parsers from :data:`FLAGS`,
``ServeConfig.argv()`` turns a configuration back into flags with
:func:`serve_argv`, and the flag table of docs/reference.md is :func:`readme_table`
(``python -m psd.flags docs/reference.md`` rewrites it; a test checks it is current).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from psd.choices import (
    ASYNC_MOMENTUM,
    GRAD_DTYPES,
    LEARNER_SCHED_CHOICES,
    LIVENESS,
    NODE_STATES,
    OPTIMIZERS,
    OUTER_OPTIMIZERS,
    OVERLAP,
    PULL_MODES,
    SCHEDULES,
    default_job,
)

__all__ = ["FLAGS", "LEARNER_SCHED_CHOICES", "PULL_MODES", "Flag", "add_flags", "check_args", "declared",
           "readme_table", "serve_argv", "serve_fields"]

SERVE, RUN = "serve", "run"
SERVE_RUN = (SERVE, RUN)


def on_off(raw: str) -> bool:
    """A PSD_<FLAG> value for an on/off flag."""
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(raw)


on_off.__name__ = "on/off value (1, 0, true, false)"


@dataclass(frozen=True)
class Flag:
    """One command-line flag: where it applies, what it fills, how it parses, what it means."""

    name: str
    help: str
    default: Any = None
    type: Callable[[str], Any] = str
    commands: tuple[str, ...] = SERVE_RUN
    field: str | None = None  # the ServeConfig field it fills
    metavar: str | tuple[str, ...] | None = None
    choices: tuple[str, ...] | None = None
    nargs: int | str | None = None  # 2 (--betas), "+" (lists), "?" (--resume)
    const: Any = None  # the value of a bare --resume
    switch: bool = False  # on/off: no value on the command line
    short: str | None = None  # "-q"
    group: str | None = None  # the help section
    env_prefix: str = "PSD_"
    readme_default: str | None = None  # the README's default column, when not str(default)
    required: bool = False  # on the command line, unless its PSD_<FLAG> is set
    # Flags of one command that exclude each other (psd export's --job and --checkpoint): one of them is
    # required, from the command line or the environment; see add_flags.
    exclusive: str | None = None
    # The value's rule: ``valid(value)`` is true for a good value (None, the unset default of an optional
    # flag, is never checked); ``rule`` says what it asks, as "--NAME must be RULE, not VALUE" (check()).
    # Rules that involve another flag (--node-rank below --nnodes) or a limit of the native layout
    # (--learners, --ring-depth) are ServeConfig.validate's.
    valid: Callable[[Any], bool] | None = None
    rule: str | None = None

    def check(self, value: Any) -> None:
        """Raise ValueError, saying what to give, when ``value`` is not one of the choices or breaks the rule.
        None is a value only of a flag whose default is None (unset: not checked)."""
        if value is None:
            if self.default is None:
                return
            raise ValueError(f"{self.name} needs a value")
        shown = " ".join(str(v) for v in value) if isinstance(value, (tuple, list)) else (
            repr(value) if isinstance(value, str) else str(value))
        many = isinstance(value, (tuple, list)) and self.nargs in ("+", "*")  # each value one of the choices
        if self.choices is not None and any(v not in self.choices for v in (value if many else [value])):
            raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}, not {shown}")
        if self.valid is not None and not self.valid(value):
            raise ValueError(f"{self.name} must be {self.rule}, not {shown}")

    @property
    def dest(self) -> str:
        """The argparse attribute name."""
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        """Its environment variable, PSD_<FLAG>."""
        return self.env_prefix + self.dest.upper()

    def default_value(self) -> Any:
        """The default, from the environment when its variable is set."""
        raw = os.environ.get(self.env)
        if raw is None:
            return self.default() if callable(self.default) else self.default
        kind = on_off if self.switch else self.type
        try:
            if self.nargs in (2, "+"):
                return [kind(v) for v in re.split(r"[,\s]+", raw.strip()) if v]
            return kind(raw)
        except ValueError:
            what = getattr(kind, "__name__", "value")
            raise SystemExit(f"psd: {self.env}={raw!r} is not a valid {what}; unset it or fix it") from None


TRAINING = "training semantics (see docs/training.md)"


_INF = float("inf")


def at_least(lo: float, rule: str | None = None) -> dict[str, Any]:
    """A flag's rule: a finite number, ``lo`` or more."""
    return {"valid": lambda v: lo <= v < _INF, "rule": rule or f"{lo:g} or more"}


def positive(rule: str = "a positive number") -> dict[str, Any]:
    """A flag's rule: a finite number above 0."""
    return {"valid": lambda v: 0 < v < _INF, "rule": rule}


def between(lo: float, hi: float, rule: str | None = None) -> dict[str, Any]:
    """A flag's rule: ``lo`` to ``hi``, both included."""
    return {"valid": lambda v: lo <= v <= hi, "rule": rule or f"{lo:g}..{hi:g}"}


def _serve(name: str, help: str, default: Any = None, **kw: Any) -> Flag:
    return Flag(name, help, default, field=kw.pop("field", name.lstrip("-").replace("-", "_")), **kw)


def _training(name: str, help: str, default: Any = None, **kw: Any) -> Flag:
    return _serve(name, help, default, group=TRAINING, **kw)


NODES = "several nodes (see the README's \"Several machines\")"


def _nodes(name: str, help: str, default: Any = None, **kw: Any) -> Flag:
    return _serve(name, help, default, group=NODES, **kw)




def _build() -> tuple[Flag, ...]:
    optimizers, schedules, async_momentum, grad_dtypes = OPTIMIZERS, SCHEDULES, ASYNC_MOMENTUM, GRAD_DTYPES
    return (
        # -- psd serve and psd run: the job
        _serve("--job", "job name: 1-64 letters, digits, _ . -; the arena is /dev/shm/psd.NAME", default_job,
               readme_default="`default`", metavar="NAME"),
        _serve("--learners", "learner slots: how many learners may be attached at once (psd run: how many it "
               "starts)", 8, type=int, metavar="N"),
        _serve("--lr", "base learning rate of the server's optimizer", 0.01, type=float, metavar="LR", **positive()),
        _serve("--ring-depth", "ring entries per learner, a power of two: gradients a learner may have in flight "
               "(a CPU learner in asp / ssp that waits for its own update, --overlap, has one; --slots, its old "
               "name, still works for now, with a warning)", 4, type=int, metavar="K"),
        _serve("--threads", "update-loop threads; 0: a quarter of the cores, 1 to 8", 0, type=int, metavar="T",
               **at_least(0, "0 (automatic) or more")),
        _serve("--spin-us", "how long the update loop spins for more work before it sleeps, in microseconds",
               50, type=int, metavar="US", **at_least(0)),
        # -- training semantics
        _training("--sync", "asp (fully asynchronous), ssp:S (a learner computes only while at most S pushes "
                  "ahead of the slowest live learner), bsp (average one gradient per learner, then update), "
                  "kasync:K (sum every K gradients into one update: each one process's step; Adagrad and Adam take "
                  "each gradient into their state)", "asp", metavar="MODE",
                  readme_default="`asp`"),
        _training("--push-every", "learners push the mean of W mini-batches' gradients as one gradient (a wave)",
                  1, type=int, metavar="W", **at_least(1)),
        _training("--optimizer", "server-side optimizer; its state lives in the arena", "sgd", choices=optimizers,
                  metavar="O", readme_default="`sgd`"),
        _training("--momentum", "momentum / nesterov factor", None, type=float, metavar="M", readme_default="0.9",
                  **at_least(0)),
        _training("--dampening", "momentum dampening", 0.0, type=float, metavar="D", **at_least(0)),
        _training("--betas", "adam / adamw moment decay rates", (0.9, 0.999), type=float, nargs=2,
                  metavar=("B1", "B2"), readme_default="0.9 0.999",
                  valid=lambda b: len(b) == 2 and all(0 <= x < 1 for x in b), rule="two numbers in [0, 1)"),
        _training("--eps", "adam / adagrad epsilon", None, type=float, metavar="EPS",
                  readme_default="1e-8; adagrad 1e-10", **positive("positive")),
        _training("--weight-decay", "L2 penalty (adamw: decoupled)", None, type=float, metavar="WD",
                  readme_default="0; adamw 0.01", **at_least(0)),
        _training("--lr-decay", "adagrad learning-rate decay", 0.0, type=float, metavar="D", **at_least(0)),
        _training("--schedule", "learning-rate schedule over optimizer steps: constant, step (--step-size, "
                  "--gamma) or cosine (--t-max, --eta-min)", "constant", choices=schedules, metavar="S",
                  readme_default="`constant`"),
        _training("--step-size", "step schedule: multiply the lr by --gamma every N optimizer steps", 0, type=int,
                  metavar="N"),
        _training("--gamma", "step schedule factor", 0.1, type=float, metavar="G", **at_least(0)),
        _training("--t-max", "cosine schedule: optimizer steps to anneal to --eta-min, then hold", 0, type=int,
                  metavar="N"),
        _training("--eta-min", "cosine schedule floor", 0.0, type=float, metavar="LR", **at_least(0)),
        _training("--warmup", "linear warm-up over the first N optimizer steps", 0, type=int, metavar="N",
                  **at_least(0)),
        _training("--staleness-lr", "divide the lr by each gradient's staleness (Zhang et al., IJCAI 2016)", False,
                  switch=True, readme_default="off"),
        _training("--max-staleness", "drop (and count) gradients computed on weights more than D updates old (a "
                  "pipeline stage's: updates of its own tensors)",
                  None, type=int, metavar="D", readme_default="none", **at_least(0)),
        _training("--predict", "learners train on weights extrapolated by their staleness along the optimizer's "
                  "update direction (PipeOptim); needs momentum, nesterov, adam or adamw", False, switch=True,
                  readme_default="off"),
        _training("--overlap", "asp / ssp (others ignore it): on, a CPU learner takes newer weights right after its "
                  "push (GaDei's hand-off: its next gradient is computed beside the server's update, every gradient "
                  "one update staler; GPU learners always do); off, only once the server applied it (its next "
                  "gradient holds its last one); auto: off, for every optimizer at any learner count (the "
                  "convergence matrix: docs/training.md)", "auto",
                  choices=OVERLAP, metavar="MODE", readme_default="`auto`"),
        _training("--async-momentum", "momentum / nesterov: auto takes the implicit momentum that asynchrony adds "
                  "(estimated from the measured staleness, held when learners leave; with several nodes exchanging "
                  "every few updates, the whole job's) off --momentum, keeps as much of one process's gain as "
                  "the measured sharpness allows, and near an edge (or unmeasured) damps the lr of a gradient "
                  "staler than that staleness; adagrad: auto divides the lr of the job's first 16 updates by 1 + the "
                  "gradient's staleness (not with --staleness-lr); off applies --momentum and the lr as given, as "
                  "torch.optim", "auto",
                  choices=async_momentum, metavar="MODE", readme_default="`auto`"),
        _training("--grad-dtype", "what CPU learners push of a dense gradient: float32, or bf16 (rounded to "
                  "bfloat16: half the bytes into and out of the ring; the server widens it and keeps float32 "
                  "weights and state; sparse gradients and GPU learners push float32)", "float32",
                  choices=grad_dtypes, metavar="D", readme_default="`float32`"),
        # -- several machines (psd/nodelink.py); --nnodes 1 starts nothing of it
        _nodes("--nnodes", "nodes (machines) in the job, each running its own psd serve / psd run; 1: this "
               "machine alone", 1, type=int, metavar="N", **at_least(1)),
        _nodes("--node-rank", "this node's rank, 0..N-1; node 0 hosts the rendezvous (a TCPStore)", 0, type=int,
               metavar="R"),
        _nodes("--master-addr", "address of node 0, where the rendezvous listens", "127.0.0.1", metavar="HOST",
               readme_default="`127.0.0.1`"),
        _nodes("--master-port", "port of the rendezvous on node 0", 29500, type=int, metavar="PORT",
               **between(1, 65535)),
        _nodes("--sync-every", "local updates (this node's clock) between two exchanges of weights across nodes; "
               "1: a node runs at most --max-node-lag + 1 local updates past the last exchange it adopted, so the "
               "other nodes' work reaches it about as late as a learner's gradient reaches its own server (the "
               "convergence matrix: docs/training.md); a larger K for a network too slow or dear to exchange "
               "every update", 1, type=int, metavar="K", **at_least(1, "1 or more local updates")),
        _nodes("--outer-optimizer", "how the nodes' deltas move the agreed weights: avg (add their mean), sum (add "
               "their sum: every node's progress, as one node with all the learners would make) or nesterov "
               "(DiLoCo's outer SGD with Nesterov momentum on minus the mean delta)", "sum",
               choices=OUTER_OPTIMIZERS, metavar="O", readme_default="`sum`"),
        _nodes("--node-state", "with --outer-optimizer sum under asp or ssp: sum combines the optimizer state too "
               "(the momentum buffer, Adam's moments and step counts, Adagrad's sums), each node's change since the "
               "last exchange added as the weights' are, so that N nodes train as one node with all the learners; "
               "auto does so for momentum, nesterov, adam and adamw and keeps Adagrad's sums per node (the "
               "convergence matrix: docs/training.md); local keeps each node's own state (always so with avg, "
               "nesterov, bsp and kasync)", "auto", choices=NODE_STATES, metavar="S", readme_default="`auto`"),
        _nodes("--outer-lr", "nesterov: the outer learning rate", 0.7, type=float, metavar="LR",
               **positive("positive")),
        _nodes("--outer-momentum", "nesterov: the outer momentum", 0.9, type=float, metavar="M",
               valid=lambda m: 0 <= m < 1, rule="in [0, 1)"),
        _nodes("--max-node-lag", "exchanges a node may run ahead of the last one adopted (WSP's D); 0: lockstep, "
               "the update loop waits at each exchange point until it is done", 1, type=int, metavar="D",
               **at_least(0, "0 (lockstep) or more")),
        _nodes("--node-compress", "how deltas travel: none (float32) or bf16 (half the bytes; each node's delta and "
               "the sum are rounded to bfloat16)", "none", choices=("none", "bf16"), metavar="C",
               readme_default="`none`"),
        _nodes("--node-timeout", "seconds without an answer after which a node counts as dead (and the first "
               "rendezvous gives up)", 30.0, type=float, metavar="S", **positive("a positive number of seconds")),
        # -- liveness of learners
        _serve("--liveness", "how the server tells that a learner died: auto (its pid and start time in /proc, "
               "where the server shares its PID namespace and /proc shows it; else its lease), lease (the lease "
               "only: for /proc mounted hidepid, or learners in other containers)", "auto", choices=LIVENESS,
               metavar="M", readme_default="`auto`"),
        _serve("--lease", "seconds a learner's slot outlives its last heartbeat where /proc cannot tell whether it "
               "lives; its pushes and a native thread renew it", 5.0, type=float, metavar="S",
               **between(0.05, 3600, "0.05 to 3600 seconds")),
        # -- where the job starts from and what the watchdog does
        _serve("--init", "start from these weights (.safetensors) instead of the first learner's (with --resume: "
               "where DIR holds no checkpoint)", None,
               metavar="FILE"),
        _serve("--resume", "start from the newest valid checkpoint in DIR (the job's own where other jobs' share DIR), "
               "or from the checkpoint file DIR names (bare --resume: the checkpoint dir)", None, nargs="?", const="",
               metavar="DIR"),
        Flag("--checkpoint-dir", "where checkpoints go (default: the --resume DIR or the file's, else "
             "~/.local/state/psd/checkpoints/JOB)", None, metavar="DIR",
             readme_default="`~/.local/state/psd/checkpoints/JOB`"),
        Flag("--checkpoint-every", "seconds between checkpoints; 0: only on demand and at stop", 60.0, type=float,
             metavar="S", **at_least(0)),
        Flag("--keep", "checkpoints to keep", 3, type=int, metavar="N", **at_least(1)),
        Flag("--heartbeat-timeout", "restart a server whose heartbeat is older than this, in seconds", 2.0,
             type=float, metavar="S", **positive("positive")),
        Flag("--start-timeout", "restart a server that has not made or taken over its arena and beaten within this "
             "many seconds of its start (plus the checkpoint or --init file it reads, at 100 MB/s)", 30.0,
             type=float, metavar="S", **positive("positive")),
        Flag("--server-restarts", "the watchdog gives up (and leaves the arena) when a restart would be the N+1-th "
             "counted; a server killed by a signal after it applied gradients beyond every earlier one's is no "
             "crash loop (restarted at once, the count forgiven), and each other restart counts until a server has "
             "run healthy for 300 s after it", 10, type=int, metavar="N",
             **at_least(0)),
        _serve("--event-log", "JSON-lines log of admissions, deaths, restarts, checkpoints, rejections ('' for "
               "none)", None, metavar="FILE", readme_default="`~/.local/state/psd/events/JOB.jsonl`"),
        Flag("--metrics-port", "serve Prometheus metrics on this port (0: off)", 0, type=int, metavar="P",
             **between(0, 65535)),
        Flag("--metrics-host", "address the metrics endpoint binds to", "127.0.0.1", metavar="H",
             readme_default="`127.0.0.1`"),
        Flag("--no-watchdog", "run the bare server in this process, without restarts or checkpoints", False,
             switch=True, commands=(SERVE,), readme_default="off"),
        Flag("--max-restarts", "a learner that dies this many times in a row without progress (no step beyond "
             "its earlier lives) is given up: the others finish, and psd run exits non-zero", 3,
             type=int, commands=(RUN,), metavar="R", **at_least(0)),
        Flag("--fork-server", "start learners (and their restarts) by forking a process that has already "
             "imported torch, so a restart costs milliseconds instead of an interpreter's start-up: on (COMMAND "
             "must be `python SCRIPT ...` or `python -m MODULE ...` with psd's Python), off (a new process each "
             "time), auto (on where COMMAND is such)", "auto", choices=("auto", "on", "off"), metavar="MODE",
             commands=(RUN,), readme_default="`auto`"),
        Flag("--stages", "pipeline stages per learner: each of the --learners virtual workers is K processes "
             "(PSD_VW, PSD_STAGE, PSD_STAGES, and RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for a "
             "torch.distributed process group of its own; PSD_RANK = VW * K + STAGE), each attaching its stage "
             "with partial=True; the server gets --learners x K slots. A stage that dies restarts its whole "
             "virtual worker; the others go on. With --gpus each stage runs on a GPU of its own (PSD_DEVICE), "
             "and the script's process group uses nccl there (gloo on the CPU)", 1, type=int, commands=(RUN,),
             metavar="K", **at_least(1)),
        Flag("--learner-threads", "torch threads per learner; 0: the cores divided among the learners, at least 1",
             0, type=int, commands=(RUN,), metavar="T", **at_least(0)),
        Flag("--pull", "how learners get the job's weights (PSD_PULL for them, attach(pull=...)): copy, a private "
             "copy swapped in after each step (one consistent set of weights per forward pass); view, the "
             "parameters are read-only views of the shared weights (no copy, always the newest; CPU float32 "
             "models, no --predict)", "copy", choices=PULL_MODES, commands=(RUN,), metavar="MODE"),
        Flag("--learner-sched", "CPU scheduling of the learners: normal; batch (SCHED_BATCH: no wake-up "
             "preemption of the update loop); idle (SCHED_IDLE: the update loop, and anything else on the "
             "machine, runs first whenever it has work); auto: batch when the learners fill the cores, else "
             "normal", "auto", choices=LEARNER_SCHED_CHOICES,
             commands=(RUN,), metavar="POLICY"),
        Flag("--gpus", "GPU indices, e.g. 0,1: learner RANK gets PSD_DEVICE=cuda:LIST[RANK % len(LIST)] (more "
             "learners than GPUs share them; with --stages K, RANK = VW * K + STAGE, and the K stages of a "
             "virtual worker must land on K different GPUs)", "", commands=(RUN,), metavar="LIST", readme_default=""),
        Flag("--quiet", "log warnings and errors only", False, switch=True, short="-q", readme_default="off"),
        # -- the other commands
        Flag("--job", "job name (default: every job on the machine)", None, commands=("status", "top", "clean")),
        Flag("--job", "job name", default_job, commands=("stop", "checkpoint", "inspect")),
        Flag("--json", "machine-readable output (strict JSON)", False, switch=True,
             commands=("status", "inspect", "doctor")),
        Flag("--sample", "seconds over which rates (gradients/s, GB/s) are measured; 0: none", 0.25, type=float,
             commands=("status",)),
        Flag("--interval", "seconds between refreshes", 1.0, type=float, commands=("top",)),
        Flag("--iterations", "stop after this many refreshes (0: never)", 0, type=int, commands=("top",)),
        Flag("--timeout", "seconds to wait (psd stop: for the job to stop, plus the time its last checkpoint "
             "takes at 100 MB/s, and while the watchdog still works on it up to ten times that)", 30.0, type=float,
             commands=("stop", "checkpoint"), **at_least(0)),
        Flag("--checkpoint-dir", "where to write it when the job has no watchdog (default: the job's checkpoint "
             "dir)", None, commands=("checkpoint",)),
        Flag("--keep", "checkpoints to keep when the job has no watchdog (with one, its own --keep)", 3, type=int,
             metavar="N", commands=("checkpoint",), **at_least(1)),
        Flag("--dry-run", "only list what would be removed", False, switch=True, commands=("clean",)),
        # psd export: one source, --job or --checkpoint (a flag on the command line wins over the other's
        # variable: PSD_JOB, which psd run sets for its learners, does not override --checkpoint)
        Flag("--job", "take the live weights of this job; once it has ended, those of its newest checkpoint (in "
             "--checkpoint-dir)", None, commands=("export",), exclusive="source", metavar="NAME"),
        Flag("--checkpoint", "take the weights of this checkpoint file (verified first)", None, commands=("export",),
             exclusive="source", metavar="FILE"),
        Flag("--out", "output file, loaded with torch.load + model.load_state_dict", None, commands=("export",),
             required=True, metavar="FILE"),
        Flag("--checkpoint-dir", "--job: where its checkpoints are, for a job that has ended (default: the job's "
             "default checkpoint directory, where psd run and the watchdog write)", None, commands=("export",),
             metavar="DIR"),
        Flag("--learners", "learners the job will run", None, type=int, commands=("doctor",)),
        Flag("--threads", "update-loop threads the job will use", None, type=int, commands=("doctor",)),
        Flag("--params", "model parameters, to size the arena", None, type=int, commands=("doctor",)),
        Flag("--ring-depth", "ring entries per learner: gradients each may have in flight", 4, type=int,
             commands=("doctor",)),
        # psd bench: PSD_BENCH_<FLAG>, so that PSD_LEARNERS (a job's learners) does not set bench's list
        Flag("--quick", "a smoke test: small sizes, short runs", False, switch=True, commands=("bench",),
             env_prefix="PSD_BENCH_"),
        Flag("--sizes", "model sizes in parameters (default: 1e4 .. 1e7)", None, type=int, nargs="+",
             commands=("bench",), env_prefix="PSD_BENCH_"),
        Flag("--learners", "learner counts (default: 1 2 4 8)", None, type=int, nargs="+", commands=("bench",),
             env_prefix="PSD_BENCH_"),
        Flag("--batches", "mini-batch sizes for training (default: 1 2 4 8)", None, type=int, nargs="+",
             commands=("bench",), env_prefix="PSD_BENCH_"),
        Flag("--duration", "seconds per round-trip measurement (default: 1)", None, type=float,
             commands=("bench",), env_prefix="PSD_BENCH_"),
        Flag("--reps", "runs of each measurement, psd and peers taking turns; the median is reported (default: 3)",
             None, type=int, commands=("bench",), env_prefix="PSD_BENCH_"),
        Flag("--no-peers", "psd alone", False, switch=True, commands=("bench",), env_prefix="PSD_BENCH_"),
        Flag("--pull-modes", "how psd's learners get the weights: copy (the psd figures), view (psd_view)", None,
             nargs="+", choices=PULL_MODES, commands=("bench",), env_prefix="PSD_BENCH_",
             readme_default="copy view"),
        Flag("--grad-dtypes", "what psd's learners push (--grad-dtype): float32 (the psd figures), bf16 "
             "(psd_bf16, psd_view_bf16)", None, nargs="+", choices=grad_dtypes, commands=("bench",),
             env_prefix="PSD_BENCH_", readme_default="float32 bf16"),
        Flag("--overlap-modes", "more --overlap modes to measure psd's learners in beside the job's default (auto): on "
             "(psd_overlap_on), off (psd_overlap_off); copy pulls, float32", None, nargs="+", choices=OVERLAP[1:],
             commands=("bench",), env_prefix="PSD_BENCH_", readme_default="none"),
        Flag("--learner-sched", "psd's learners' scheduling policy, as psd run --learner-sched gives it", None,
             choices=LEARNER_SCHED_CHOICES, commands=("bench",), env_prefix="PSD_BENCH_",
             readme_default="auto"),
        Flag("--server-threads", "update-loop threads of psd's jobs in the round trips and training; 0: what psd serve "
             "picks (--threads 0: a quarter of the cores, 1 to 8)", None, type=int, commands=("bench",),
             env_prefix="PSD_BENCH_", readme_default="0", **at_least(0)),
        Flag("--no-limits", "skip the memory limits, the update loop and the kernels (minutes on a large "
             "last-level cache: the DRAM vectors are 4 of them)", False, switch=True, commands=("bench",),
             env_prefix="PSD_BENCH_"),
        Flag("--loop-sizes", "more model sizes to measure the update loop at, e.g. 10000000 100000000 (1e8 is a "
             "3.6 GB arena)", None, type=int, nargs="+", commands=("bench",), env_prefix="PSD_BENCH_",
             readme_default=""),
        Flag("--optimizer-sizes", "model sizes to measure the server's optimizer kernels at, against torch's fused "
             "ones (default: 10000000; --quick 100000)", None, type=int, nargs="+", commands=("bench",),
             env_prefix="PSD_BENCH_"),
        Flag("--no-training", "skip the training workload", False, switch=True, commands=("bench",),
             env_prefix="PSD_BENCH_"),
        Flag("--json", "print the results as strict JSON on stdout (progress goes to stderr)", False, switch=True,
             commands=("bench",), env_prefix="PSD_BENCH_"),
    )


FLAGS: tuple[Flag, ...] = _build()

_DEPRECATED = {SERVE: {"--slots": "--ring-depth"}, RUN: {"--slots": "--ring-depth"}, "doctor": {"--slots":
                                                                                                "--ring-depth"}}
_DEPRECATED_ENV = {"PSD_SLOTS": "PSD_RING_DEPTH"}


def deprecated(old: str, new: str) -> None:
    """Warn on stderr that ``old`` is going away, naming ``new``."""
    print(f"psd: {old} is deprecated and will be removed; use {new} instead", file=sys.stderr)


class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores into the new flag's dest and warns on stderr, naming the new flag."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        deprecated(str(option_string), self.new)
        setattr(namespace, self.dest, values)


def _apply_deprecated_env() -> None:
    for old, new in _DEPRECATED_ENV.items():
        if old in os.environ and new not in os.environ:
            deprecated(old, new)
            os.environ[new] = os.environ[old]


def _help(f: Flag) -> str:
    """The flag's --help line: its text, its choices (where a metavar hides them), its default (the
    README's wording where the default depends on another flag, e.g. --eps by optimizer) and variable."""
    text = f.help.replace("%", "%%")
    if f.choices and f.metavar and not any(c in f.help for c in f.choices):
        text += f"; one of {', '.join(map(str, f.choices))}"
    if f.rule:
        text += f"; {f.rule.replace('%', '%%')}"
    if f.switch or "(default" in f.help:
        return f"{text} [{f.env}]"
    if f.default is None or callable(f.default):
        shown = (f.readme_default or "").replace("`", "").replace("%", "%%")
        return f"{text} (default: {shown}) [{f.env}]" if shown else f"{text} [{f.env}]"
    return f"{text} (default: %(default)s) [{f.env}]"


class _StoreGiven(argparse._StoreAction):
    """A flag of an exclusive group: stored as usual, and its dest noted in ``namespace.given``, so that a
    flag given on the command line can win over the other flags' environment variables."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        given = set(getattr(namespace, "given", None) or ())
        namespace.given = given | {self.dest}


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add ``command``'s flags from :data:`FLAGS` to ``parser``, defaults read from PSD_<FLAG>.

    A ``required`` flag is required on the command line only while its variable is unset; so is one flag
    of each ``exclusive`` group while none of the group's variables is set.
    """
    if command in _DEPRECATED:
        _apply_deprecated_env()
    groups: dict[str, argparse._ArgumentGroup] = {}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    by_dest: dict[str, Flag] = {}
    mine = [f for f in FLAGS if command in f.commands]
    for f in mine:
        if f.exclusive is not None and f.exclusive not in exclusive:
            members = [g for g in mine if g.exclusive == f.exclusive]
            exclusive[f.exclusive] = parser.add_mutually_exclusive_group(
                required=not any(g.env in os.environ for g in members))
    for f in mine:
        target: Any = parser if f.group is None else groups.setdefault(f.group, parser.add_argument_group(f.group))
        if f.exclusive is not None:
            target = exclusive[f.exclusive]
        names = [f.short, f.name] if f.short else [f.name]
        if f.switch:
            target.add_argument(*names, action="store_true", default=f.default_value(), help=_help(f))
        else:
            kw: dict[str, Any] = {"type": f.type, "default": f.default_value(), "help": _help(f)}
            for k in ("metavar", "choices", "nargs"):
                if getattr(f, k) is not None:
                    kw[k] = getattr(f, k)
            if f.nargs == "?":
                kw["const"] = f.const
            if f.required and f.env not in os.environ:
                kw["required"] = True
            if f.exclusive is not None:
                kw["action"] = _StoreGiven
            target.add_argument(*names, **kw)
        by_dest[f.dest] = f
    for old, new in _DEPRECATED.get(command, {}).items():
        f = by_dest[new.lstrip("-").replace("-", "_")]
        parser.add_argument(old, dest=f.dest, type=f.type, action=_DeprecatedAlias, new=new)


def check_args(args: argparse.Namespace, command: str) -> None:
    """Each of ``command``'s flags' choices and rule on its parsed value, but those that fill a ServeConfig field
    (ServeConfig.validate checks them, and what involves several flags): ValueError naming the first."""
    for f in FLAGS:
        if command in f.commands and f.field is None and hasattr(args, f.dest):
            f.check(getattr(args, f.dest))


def serve_fields() -> tuple[Flag, ...]:
    """The flags that fill ServeConfig fields."""
    return tuple(f for f in FLAGS if f.field is not None and SERVE in f.commands)


def declared(field: str) -> Any:
    """The flag table's default for the ServeConfig field ``field``, as declared (not $PSD_<FLAG>'s): what
    ServeConfig's fields default to, so that a default is written once."""
    (flag,) = [f for f in serve_fields() if f.field == field]
    return flag.default


# Filled by the watchdog itself, not passed through argv: where the weights come from and the log.
_NOT_IN_ARGV = ("init", "resume", "event_log")


def serve_argv(config: Any) -> list[str]:
    """``config`` (a ServeConfig) as ``psd serve`` flags, every field of :func:`serve_fields` but the start's."""
    out: list[str] = []
    for f in serve_fields():
        if f.field in _NOT_IN_ARGV:
            continue
        v = getattr(config, f.field)
        if f.switch:
            out += [f.name] * bool(v)
        elif v is None:
            continue
        elif isinstance(v, (tuple, list)):
            out += [f.name, *(repr(x) if isinstance(x, float) else str(x) for x in v)]
        else:
            out += [f.name, repr(v) if isinstance(v, float) else str(v)]
    return out


def _readme_default(f: Flag) -> str:
    if f.readme_default is not None:
        return f.readme_default
    if f.default is None:
        return ""
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def readme_table(commands: Iterable[str] = SERVE_RUN) -> str:
    """The reference's table (docs/reference.md) of ``psd serve`` and ``psd run`` flags, one row per flag."""
    commands = tuple(commands)
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for f in FLAGS:
        if not set(f.commands) & set(commands):
            continue
        meta = f.metavar if isinstance(f.metavar, str) else " ".join(f.metavar or ())
        if f.nargs == "?":
            meta = f"[{meta}]"
        name = f"{f.short}, {f.name}" if f.short else f.name
        only = "" if set(commands) <= set(f.commands) else f" ({', '.join(c for c in f.commands if c in commands)})"
        flag = f"`{name} {meta}`" if meta and not f.switch else f"`{name}`"
        meaning = (f.help + (f"; {f.rule}" if f.rule else "")).replace("|", "\\|")
        rows.append(f"| {flag}{only} | `{f.env}` | {_readme_default(f)} | {meaning} |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- flags: generated by `python -m psd.flags docs/reference.md` -->\n", "<!-- flags: end -->\n"


def rewrite_readme(path: str) -> bool:
    """Put :func:`readme_table` between the markers of a page (docs/reference.md); True if it changed."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{path}: no {BEGIN.strip()} ... {END.strip()} markers; add them where the table goes")
    new = head + BEGIN + readme_table() + END + tail
    if new != text:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
    return new != text


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "docs/reference.md"
    print(f"{target}: flag table {'rewritten' if rewrite_readme(target) else 'already current'}")
