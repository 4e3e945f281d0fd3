"""The psd server: owns a job's arena and runs the native update loop.

The server creates the arena, learns the model's parameter spec (from the first
learner to attach, or from an initial-weights file), grows the arena to hold
the weights and one ring per learner slot, starts the update loop, notices
learners that died and lets the loop drain and free their slots, and removes
the arena on a clean stop. It is the only role that creates, grows, repairs or
removes an arena; learners only attach.

A server that finds the arena of a dead server for its job takes it over:
the rings are as the dead server left them, so nothing a learner pushed is
lost (only the one gradient being applied at the moment of the crash may be
applied twice, partly). With ``resume`` it starts a job whose arena is gone or
damaged from the newest valid checkpoint instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import select
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from psd import __version__, _native, gain
from psd.arena import (
    EVICTION_RULES,
    WEIGHTLESS,
    HeaderView,
    ParamSpec,
    arena_spec,
    buffers_set,
    check_space,
    decode_spec,
    encode_spec,
    model_sizes,
    open_job,
    piece_geometry,
    shm_name,
    shm_path,
)
from psd.choices import ASYNC_MOMENTUM, GRAD_DTYPES, OPTIMIZERS, OVERLAP, SCHEDULES
from psd.errors import ArenaCorrupt, Error, OutOfSharedMemory, SpecError, VersionMismatch
from psd.events import EventLog
from psd.flags import NODES, declared, serve_argv, serve_fields
from psd.signals import SignalFlag

__all__ = ["ASYNC_MOMENTUM", "DRAIN_TIMEOUT", "GRAD_DTYPES", "OPTIMIZERS", "SCHEDULES", "ServeConfig", "Server",
           "auto_threads", "validate_nodes"]

log = logging.getLogger("psd.server")

SPEC_CAPACITY = 1 << 20  # bytes of JSON: room for tens of thousands of tensors
# Seconds a clean stop lets the update loop apply what was pushed before it; then it stops anyway, so SIGTERM
# ends a server within a few seconds whatever its backlog (the loop finishes its pass: one entry per ring).
DRAIN_TIMEOUT = 3.0


class Deaths:
    """A pidfd for each live learner in a slot (``os.pidfd_open``): one turns readable when its process ends, which
    wakes the server's poll (``Server.run``), so the slot is reaped in a millisecond and a restarted learner gets
    it back, not at the next tick. Only where the pid is this PID namespace's and ``/proc`` tells (else the lease
    does); a pidfd is checked against the slot's start time after it is opened (a pid reused meanwhile is not the
    learner's). The fields read are the server's own slot record, never the learner's block."""

    def __init__(self) -> None:
        self._fds: dict[int, tuple[int, int]] = {}  # slot -> (claim token, pidfd)
        self._done: dict[int, int] = {}  # slot -> the claim token whose process is watched no more (ended, or none)
        self.ended = False  # a pidfd found readable while its slot was still held: look again at once

    def watch(self, slot: int, info: dict, usable: bool) -> None:
        """Follow slot ``slot``'s record ``info`` (``Arena.slot_info``): a pidfd for its owner while it holds it."""
        claims = info["claims"] if info["state"] == _native.SLOT_ACTIVE else 0
        held = self._fds.get(slot)
        if held is not None and (held[0] != claims or _readable(held[1])):
            # Ended while its slot is still held: it may have died after this poll's reap looked (the reap runs
            # first), and with its pidfd gone nothing would wake the next one. Poll again at once.
            self.ended |= held[0] == claims
            self._drop(slot)
            held = None
        if held is not None or not claims or not usable or self._done.get(slot) == claims:
            return
        self._done[slot] = claims  # one try per claim: a pid that cannot be followed is the reaper's poll's
        pid = info["pid"]
        if pid <= 0 or info["pid_ns"] != _native.pid_ns():
            return
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already, or no pidfds here: the next poll reaps it
            return
        if _native.proc_start_time(pid) != info["start_time"]:
            os.close(fd)
            return
        self._fds[slot] = (claims, fd)

    def fds(self) -> tuple[int, ...]:
        """The pidfds to wait on."""
        return tuple(fd for _, fd in self._fds.values())

    def close(self) -> None:
        for slot in list(self._fds):
            self._drop(slot)

    def _drop(self, slot: int) -> None:
        _, fd = self._fds.pop(slot)
        os.close(fd)


def _readable(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


def validate_nodes(cfg: ServeConfig) -> None:
    """Raise ValueError with a fix for each bad several-node setting of ``cfg`` (a ServeConfig): each flag's own
    rule, and the node's rank within --nnodes."""
    for f in serve_fields():
        if f.group == NODES:
            f.check(getattr(cfg, f.field))
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ValueError(f"--node-rank must be 0..{cfg.nnodes - 1} (--nnodes {cfg.nnodes}), not {cfg.node_rank}")


def auto_threads() -> int:
    """Update-loop threads when not told: a quarter of the cores, 1 to 8.

    The learners need the rest; on small machines one thread already moves
    memory at close to the bandwidth limit.
    """
    return max(1, min(8, (os.cpu_count() or 1) // 4))


@dataclass
class ServeConfig:
    """What ``psd serve`` is asked to do. Every field but poll_interval has a flag and a PSD_<FLAG> variable,
    declared in psd.flags.FLAGS, whose declared default is the field's (``declared``)."""

    job: str = field(default_factory=declared("job"))
    learners: int = declared("learners")
    lr: float = declared("lr")
    ring_depth: int = declared("ring_depth")
    threads: int = declared("threads")
    spin_us: int = declared("spin_us")
    init: str | None = declared("init")
    resume: str | None = declared("resume")
    event_log: str | None = declared("event_log")
    poll_interval: float = 0.1
    liveness: str = declared("liveness")
    lease: float = declared("lease")
    # -- training semantics (docs/training.md)
    sync: str = declared("sync")
    push_every: int = declared("push_every")
    optimizer: str = declared("optimizer")
    momentum: float | None = declared("momentum")
    dampening: float = declared("dampening")
    betas: tuple[float, float] = declared("betas")
    eps: float | None = declared("eps")
    weight_decay: float | None = declared("weight_decay")
    lr_decay: float = declared("lr_decay")
    schedule: str = declared("schedule")
    step_size: int = declared("step_size")
    gamma: float = declared("gamma")
    t_max: int = declared("t_max")
    eta_min: float = declared("eta_min")
    warmup: int = declared("warmup")
    staleness_lr: bool = declared("staleness_lr")
    max_staleness: int | None = declared("max_staleness")
    predict: bool = declared("predict")
    overlap: str = declared("overlap")
    async_momentum: str = declared("async_momentum")
    grad_dtype: str = declared("grad_dtype")
    # -- several nodes (psd/nodelink.py; see the README's "Several machines")
    nnodes: int = declared("nnodes")
    node_rank: int = declared("node_rank")
    master_addr: str = declared("master_addr")
    master_port: int = declared("master_port")
    sync_every: int = declared("sync_every")
    outer_optimizer: str = declared("outer_optimizer")
    node_state: str = declared("node_state")
    outer_lr: float = declared("outer_lr")
    outer_momentum: float = declared("outer_momentum")
    max_node_lag: int = declared("max_node_lag")
    node_timeout: float = declared("node_timeout")
    node_compress: str = declared("node_compress")

    def sync_mode(self) -> tuple[str, int]:
        """``--sync`` parsed: ('asp', 0), ('ssp', S), ('bsp', 0) or ('kasync', K)."""
        mode, _, arg = self.sync.partition(":")
        if mode in ("asp", "bsp") and not arg:
            return mode, 0
        if mode in ("ssp", "kasync") and arg.isdigit():
            n = int(arg)
            if mode == "kasync" and n < 1:
                raise ValueError("--sync kasync:K needs K >= 1 (gradients summed into one update)")
            return mode, n
        raise ValueError(f"--sync must be asp, ssp:S, bsp or kasync:K (e.g. ssp:3, kasync:4), not {self.sync!r}")

    def training(self) -> dict:
        """The keyword arguments of ``Arena.configure``: optimizer defaults filled in as PyTorch's."""
        mode, param = self.sync_mode()
        opt = self.optimizer
        momentum = self.momentum if self.momentum is not None else (0.9 if opt in ("momentum", "nesterov") else 0.0)
        eps = self.eps if self.eps is not None else (1e-10 if opt == "adagrad" else 1e-8)
        wd = self.weight_decay if self.weight_decay is not None else (0.01 if opt == "adamw" else 0.0)
        nodes, node_lag = gain.node_terms(self.nnodes, self.sync_every, self.max_node_lag)
        return dict(optimizer=opt, sync=mode, sync_param=param, push_every=self.push_every,
                    schedule=self.schedule, staleness_lr=self.staleness_lr, predict=self.predict,
                    momentum=momentum, dampening=self.dampening, beta1=self.betas[0], beta2=self.betas[1],
                    eps=eps, weight_decay=wd, lr_decay=self.lr_decay, gamma=self.gamma, eta_min=self.eta_min,
                    step_size=self.step_size, t_max=self.t_max, warmup=self.warmup,
                    max_staleness=(1 << 64) - 1 if self.max_staleness is None else self.max_staleness,
                    async_momentum=ASYNC_MOMENTUM.index(self.async_momentum),
                    lease_ms=max(1, round(self.lease * 1000)), lease_only=self.liveness == "lease",
                    grad_bf16=self.grad_dtype == "bf16", overlap=OVERLAP.index(self.overlap), nodes=nodes,
                    node_lag=node_lag)

    def state_vectors(self) -> int:
        """Vectors the size of the weights that the optimizer state and accumulator take."""
        return _native.state_vectors(self.optimizer, self.sync_mode()[0])

    def argv(self) -> list[str]:
        """These settings as ``psd serve`` flags (for the processes the watchdog and launcher start)."""
        return serve_argv(self)

    def validate(self) -> None:
        """Raise ValueError with a fix for each bad value: each flag's own choices and rule (the flag table,
        psd.flags), then what involves several flags or the native layout's limits."""
        shm_name(self.job)
        for f in serve_fields():  # several-node settings: checked where there are several nodes (validate_nodes)
            if f.group != NODES or f.field == "nnodes":
                f.check(getattr(self, f.field))
        self.sync_mode()
        if self.schedule == "step" and self.step_size < 1:
            raise ValueError("--schedule step needs --step-size N (optimizer steps between lr drops)")
        if self.schedule == "cosine" and self.t_max < 1:
            raise ValueError("--schedule cosine needs --t-max N (optimizer steps to reach --eta-min)")
        if self.predict and self.optimizer not in ("momentum", "nesterov", "adam", "adamw"):
            raise ValueError(f"--predict needs an optimizer with an update direction to extrapolate: momentum, "
                             f"nesterov, adam or adamw (not {self.optimizer})")
        if not 1 <= self.learners <= _native.MAX_SLOTS:
            raise ValueError(f"--learners must be 1..{_native.MAX_SLOTS}, not {self.learners}")
        k = self.ring_depth
        if not (1 <= k <= _native.MAX_RING and k & (k - 1) == 0):
            raise ValueError(f"--ring-depth must be a power of two from 1 to {_native.MAX_RING}, not {k}")
        if self.nnodes > 1 or self.node_rank:
            validate_nodes(self)


def _unlink(name: str) -> None:
    """Remove the arena's name (learners and the watchdog keep their mappings); gone already is fine."""
    with contextlib.suppress(FileNotFoundError):
        _native.unlink(name)


WATCHDOG_ENV = "PSD_SERVER_WATCHDOG"  # "pid:start_time" of the watchdog that started this server


def own_watchdog() -> tuple[int, int] | None:
    """(pid, start time) of the watchdog that started this server (``WATCHDOG_ENV``, set by
    watchdog/supervisor.py), if it is this process's parent still; else None (``--no-watchdog`` by hand).

    The server writes it into the header before its own pid, which is what makes it alive to others: a second
    watchdog for the job then sees this one alive and refuses to start, where before this watchdog's first
    look at the arena it saw a server without a live watchdog and adopted it (two watchdogs on one job)."""
    pid, _, start = os.environ.get(WATCHDOG_ENV, "").partition(":")
    try:
        pid_n, start_n = int(pid), int(start)
    except ValueError:
        return None
    if pid_n != os.getppid() or _native.proc_start_time(pid_n) != start_n:
        return None
    return pid_n, start_n


def _initial_spec(path: str) -> list[ParamSpec]:
    """The model of --init's file, from its header alone (no tensor read): float32 parameters only."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(f"--init {path}: no such file (give a .safetensors file of the weights)")
    spec = []
    try:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                if piece.get_dtype() != "F32":
                    raise SpecError(f"--init {path}: tensor {name!r} is {piece.get_dtype()}; --init takes the float32 "
                                    f"parameters of a model without buffers (for any other model, let its first "
                                    f"learner bring it)")
                spec.append(ParamSpec(name, tuple(piece.get_shape())))
    except SpecError:
        raise
    except Exception as e:  # safetensors' own error (a truncated or foreign file) is no public class
        raise SpecError(f"--init {path} is not a readable .safetensors file ({e}); write it with "
                        f"safetensors.torch.save_file(model.state_dict(), path)") from None
    if not spec:
        raise SpecError(f"--init {path} holds no tensors; write the model's parameters into it with "
                        f"safetensors.torch.save_file(model.state_dict(), path)")
    return spec


def _load_initial_weights(path: str) -> tuple[list[ParamSpec], dict]:
    from safetensors.torch import load_file

    _initial_spec(path)  # checked as it is read alone
    tensors = load_file(path)
    return [ParamSpec(name, tuple(t.shape)) for name, t in tensors.items()], tensors


def _by_name(spec: list[ParamSpec], params_only: bool = False) -> list[ParamSpec]:
    """A model's tensors sorted by name (a file lists them so, a module in its own order); with ``params_only``,
    its parameters alone (what an --init file holds)."""
    return sorted((p for p in spec if not params_only or p.kind == "param"), key=lambda p: p.name)


# While an --async-momentum auto job waits for its first measured gain level: the server looks this often
# (seconds), for at most the window after its first look (Server.next_poll_s).
FIRST_LEVEL_POLL_S = 0.005
FIRST_LEVEL_WINDOW_S = 10.0


class Server:
    """One job's server. ``start()``, then ``run(stop_event)`` or ``poll()`` in a loop, then ``stop()``."""

    def __init__(self, config: ServeConfig) -> None:
        config.validate()
        self.config = config
        self.threads = config.threads or auto_threads()
        self.arena: _native.Arena | None = None
        self.generation = 0
        self._loop_running = False
        self._owners: dict[int, int] = {}  # slot -> claim token last seen (a reattaching pid gets a new one)
        self._deaths = Deaths()  # the live learners' pidfds, which wake the poll when one ends
        self._rejected: dict[int, int] = {}  # slot -> rejected count last seen
        self._dropped: dict[int, int] = {}  # slot -> dropped count last seen
        self._evictions_seen: set[tuple[int, int]] = set()  # (slot, evicted_unix_ns) of evictions logged
        self._gain_level = math.nan  # the gain level last set (psd/gain.py); a new server sets its own
        self._gain_clock = 0  # the clock it was set at
        self._held = gain.SharpnessHold()  # the learners' readings' decaying maximum
        self._damping = math.nan  # the damping of staler-than-mean gradients last set (psd/gain.py damping)
        self._measured = False  # whether a learner's measurement has set the level yet
        self._steer_since: float | None = None  # when this server first steered the level (monotonic)
        self._ignored: dict[int, int] = {}  # slot -> stale-token entries last seen
        self._offer_since: float | None = None  # when an offerer /proc cannot judge was first seen
        self._stopped = False
        self.events = EventLog(config.event_log, config.job, "server")
        # Tests of the watchdog's restart limit need a server that fails the same way after every start:
        # PSD_TEST_CRASH_AFTER=S makes this one exit with status 3, S seconds after it started, leaving its
        # arena behind as a crash does.
        self._crash_after = float(os.environ.get("PSD_TEST_CRASH_AFTER") or 0)
        self._crash_at = 0.0

    # -- life cycle ---------------------------------------------------------

    def start(self) -> None:
        """Create the arena, or take over the one a dead server left; load initial weights if given."""
        cfg = self.config
        if self._test_once("PSD_TEST_CRASH_AT_START"):
            os.kill(os.getpid(), signal.SIGKILL)  # a test's server killed before its arena (an OOM kill as it reads)
        spec = tensors = ckpt = None
        looked = False  # load_source ran: it reads a checkpoint or the file once
        try:
            self.arena = open_job(cfg.job)
        except FileNotFoundError:
            pass
        except (ArenaCorrupt, VersionMismatch) as e:
            if not cfg.resume:
                raise Error(f"{shm_path(cfg.job)} cannot be used ({e}); remove it with `psd clean`, or start "
                            f"with --resume DIR to continue from the last checkpoint") from None
            log.warning("job %r: the arena is damaged (%s); starting over from the last checkpoint", cfg.job, e)
            _native.unlink(shm_name(cfg.job))

        def load_source() -> None:
            """The job's first weights, where this server loads them itself: --resume's newest checkpoint, else
            --init's file (so one command starts a job and restarts it)."""
            nonlocal ckpt, spec, tensors, looked
            if looked:
                return
            looked = True
            if cfg.resume:
                ckpt = self._latest_checkpoint()
                if ckpt is not None:
                    # (a file gone since the job began is no matter: the checkpoint is newer)
                    if cfg.init and Path(cfg.init).is_file() and \
                            _by_name(ckpt.spec, params_only=True) != _by_name(_initial_spec(cfg.init)):
                        raise Error(f"job {cfg.job!r}: the newest checkpoint in {cfg.resume} ({ckpt.path.name}) holds "
                                    f"another model than --init {cfg.init}: a checkpoint of another run? Move it "
                                    f"away, or give --checkpoint-dir / --resume a directory of this job's own")
                    spec, tensors = ckpt.spec, ckpt.weights
                    return
            if cfg.init:
                spec, tensors = _load_initial_weights(cfg.init)

        if self.arena is not None and (cfg.resume or cfg.init) and not self.arena.server_alive() and \
                self.arena.state in WEIGHTLESS:
            # A server killed before its arena held the job's weights (while it wrote those of --init or the
            # checkpoint, or before a learner wrote its model's): taken over, the arena would wait for the next
            # learner's model and make that the job's, --init or the checkpoint ignored. Start over from them.
            load_source()
            if spec is not None:
                log.warning("job %r: the arena of dead server pid %d never held the job's weights; starting over "
                            "from %s", cfg.job, HeaderView(self.arena).server_pid,
                            ckpt.path if ckpt is not None else cfg.init)
                self.arena.close()
                self.arena = None
                _native.unlink(shm_name(cfg.job))
        took_over = self.arena is not None
        if took_over:
            self._test_hang_in_takeover()
            # The arena holds the job's model: it is newer than --init's file, which must be of the same model, and
            # than any checkpoint (with --resume, the file may be the model the job started from long ago, or gone).
            self._take_over(_initial_spec(cfg.init) if cfg.init and not cfg.resume else None)
        else:
            load_source()
            self._create(spec)
            if spec is not None:
                # Claim the model at once: a learner attaching between the arena's creation and the load
                # below would otherwise offer its own model, and the job would silently ignore --init.
                self._offer_own(spec)
        me = os.getpid()
        watchdog = own_watchdog()
        if watchdog is not None:  # named before this server is: see own_watchdog
            self.arena.note_watchdog(*watchdog)
        self.generation = self.arena.become_server(
            me, _native.proc_start_time(me), cfg.lr, self.threads, cfg.spin_us
        )
        if not (took_over and HeaderView(self.arena).lineage):
            # A new lineage for the weights this server loads (psd_layout.h), and the checkpoint they come from; a
            # server taking the arena over keeps the arena's.
            origin = (ckpt.created_unix_ns, ckpt.clock) if ckpt is not None else ()
            self.arena.note_lineage(secrets.randbits(63) + 1, *origin)
        self.arena.configure(**cfg.training())
        # --async-momentum auto's level and damping as a fresh arena has them (level 0, all of the damping): a
        # server taking over sets its own from its learners' readings (_steer_gain), or never, where its flags
        # leave nothing to steer, and must not run on with what the dead one left
        self.arena.set_gain_level(0.0, 1.0)
        if cfg.nnodes > 1 and not took_over:
            # One node of several: the update loop applies nothing until the node link takes this hold
            # over and lets it go with the nodes' agreed weights.
            self.arena.hold(me, _native.proc_start_time(me), self.arena.clock())
        log.info(
            "job %r: arena %s, %d learner slots x %d ring entries, %s lr %g, sync %s, %d update thread(s), "
            "generation %d", cfg.job, shm_path(cfg.job), cfg.learners, cfg.ring_depth, cfg.optimizer, cfg.lr, cfg.sync,
            self.threads, self.generation,
        )
        self.events.emit("server_started", generation=self.generation, took_over=took_over,
                         resumed_from=str(ckpt.path) if ckpt is not None else None)
        if self._crash_after:
            self._crash_at = time.monotonic() + self._crash_after
        st = self.arena.state
        if spec is not None and (st == _native.ARENA_WAITING_SPEC or (
                st == _native.ARENA_SPEC_OFFERED and HeaderView(self.arena).offer_pid == os.getpid())):
            self._test_crash_before_weights()
            self._load_weights(spec, tensors, ckpt)
        elif self.arena.state == _native.ARENA_WAITING_SPEC:
            log.info("job %r: waiting for the first learner to bring its model", cfg.job)

    @staticmethod
    def _test_once(variable: str) -> bool:
        """Whether the test hook ``variable`` (=FILE) fires in this server: once per FILE, the first server to
        reach it creating FILE, so that the server restarted after it goes on."""
        marker = os.environ.get(variable)
        if not marker or os.path.exists(marker):
            return False
        Path(marker).touch()
        return True

    def _test_crash_before_weights(self) -> None:
        """PSD_TEST_CRASH_BEFORE_WEIGHTS=FILE: a test's server SIGKILLs itself once with its arena made and claimed
        and the weights it loaded not yet written, as a server killed while it writes a large checkpoint's weights
        is left."""
        if self._test_once("PSD_TEST_CRASH_BEFORE_WEIGHTS"):
            os.kill(os.getpid(), signal.SIGKILL)

    def _test_crash_in_stop(self) -> None:
        """PSD_TEST_CRASH_IN_STOP=FILE: a test's server SIGKILLs itself once in its stop, between marking the arena
        STOPPED and unlinking it (in either order)."""
        if self._test_once("PSD_TEST_CRASH_IN_STOP"):
            os.kill(os.getpid(), signal.SIGKILL)

    def _test_hang_in_takeover(self) -> None:
        """PSD_TEST_HANG_IN_TAKEOVER=FILE: a test's server hangs once as it begins to take a dead server's arena
        over, before its first heartbeat."""
        if self._test_once("PSD_TEST_HANG_IN_TAKEOVER"):
            while True:
                time.sleep(60)  # hung: only its watchdog's SIGKILL ends it

    def _create(self, spec: list[ParamSpec] | None) -> None:
        cfg = self.config
        check_space(_native.arena_size(cfg.learners, cfg.ring_depth, SPEC_CAPACITY, 0), f"job {cfg.job!r}")
        if spec is not None:
            n_params, n_train, n_buffers, n_pieces = model_sizes(spec)
            check_space(_native.arena_size(cfg.learners, cfg.ring_depth, SPEC_CAPACITY, n_params, cfg.state_vectors(),
                                           n_train, n_buffers, n_pieces), f"job {cfg.job!r}")
        try:
            self.arena = _native.create(shm_name(cfg.job), 0o600, cfg.learners, cfg.ring_depth, SPEC_CAPACITY,
                                        __version__)
        except FileExistsError:  # another server won the race to create it
            raise Error(f"job {cfg.job!r} was just started by another server; stop it first, "
                        f"or choose another --job") from None

    def _latest_checkpoint(self):
        from psd.watchdog import checkpoint

        # Another job's checkpoint (jobs sharing the directory) only where there is nothing else to start from:
        # --init is the job's own start.
        ckpt = checkpoint.latest(self.config.resume, job=self.config.job, others=not self.config.init)
        if ckpt is None:
            log.warning("job %r: no valid checkpoint in %s; starting %s", self.config.job, self.config.resume,
                        f"from --init {self.config.init}" if self.config.init else "without one")
        else:
            log.info("job %r: resuming from %s (clock %d)", self.config.job, ckpt.path, ckpt.clock)
        return ckpt

    def _take_over(self, spec: list[ParamSpec] | None) -> None:
        """Recover the arena of a dead server: same geometry, same model, rings as they are."""
        cfg, a = self.config, self.arena
        h = a.header()
        try:
            if a.server_alive():
                raise Error(f"job {cfg.job!r} already has a running server (pid {h['server_pid']}); stop it "
                            f"first, or choose another --job")
            if (h["n_slots"], h["ring_k"]) != (cfg.learners, cfg.ring_depth):
                raise Error(f"job {cfg.job!r} has an arena left by a dead server (pid {h['server_pid']}) made for "
                            f"--learners {h['n_slots']} --ring-depth {h['ring_k']}; start with those to recover it, or "
                            f"remove it with `psd clean`")
            made = a.training()
            if h["state"] >= _native.ARENA_INIT_WEIGHTS and h["n_params"] and \
                    (made["optimizer"], h["state_vectors"]) != (cfg.optimizer, cfg.state_vectors()):
                raise Error(f"job {cfg.job!r} has an arena left by a dead server that trained with --optimizer "
                            f"{made['optimizer']} --sync {made['sync']}; start with those to recover it (its "
                            f"optimizer state is in the arena), or remove it with `psd clean`")
            a.remap()
            if spec is not None and h["state"] >= _native.ARENA_INIT_WEIGHTS and \
                    _by_name(arena_spec(a)) != _by_name(spec):  # the same tensors in another order: the same model
                raise Error(f"job {cfg.job!r} has an arena left by a dead server with another model than "
                            f"{cfg.init}; remove it with `psd clean` to start over")
        except BaseException:
            a.close()
            self.arena = None
            raise
        self._evictions_seen = self._evictions_kept()  # the last server logged them; only new ones are news
        if h["state"] == _native.ARENA_STOPPED:  # the dead server was stopping: go on where it stopped
            a.set_state(_native.ARENA_READY if h["n_params"] and h["weights_off"] else _native.ARENA_WAITING_SPEC)
        log.warning("job %r: taking over the arena of dead server pid %d (clock %d, %d gradients pending)",
                    cfg.job, h["server_pid"], h["clock"], a.counters()["pending"])

    def _offer_own(self, spec: list[ParamSpec]) -> None:
        """Offer the model of --init / the checkpoint as the server's own (the state a learner's offer takes)."""
        me = os.getpid()
        data, digest = encode_spec(spec)
        if not self.arena.set_spec(data, digest, model_sizes(spec), me, _native.proc_start_time(me)):
            raise Error(f"job {self.config.job!r}: learner pid {HeaderView(self.arena).offer_pid} offered its model "
                        f"before this server could load {self.config.init or self.config.resume}; start the server "
                        f"first, then the learners")

    def _load_weights(self, spec: list[ParamSpec], tensors: dict, ckpt=None) -> None:
        sizes = model_sizes(spec)
        if self.arena.state == _native.ARENA_WAITING_SPEC:
            self._offer_own(spec)
        self.arena.grow()
        with self._beating():
            self._write_loaded(spec, tensors, ckpt)
        self.arena.set_state(_native.ARENA_READY)
        self._evictions_seen |= self._evictions_kept()  # restored from the checkpoint: logged by the last server
        log.info("job %r: loaded %d parameters (%d tensors) from %s", self.config.job, sizes[0], len(spec),
                 ckpt.path if ckpt is not None else self.config.init)

    @contextlib.contextmanager
    def _beating(self) -> Iterator[None]:
        """Beat the heartbeat every 0.1 s from a thread meanwhile: copying a large checkpoint's weights and
        optimizer state into the arena takes seconds, with this server already its server, and its watchdog
        restarts a server that does not beat for --heartbeat-timeout. Only around work that leaves the mapping
        where it is (no grow: a grow moves it, and beats by itself)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(0.1):
                self.arena.beat()

        t = threading.Thread(target=beat, name="psd-load-beat", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()

    def _write_loaded(self, spec: list[ParamSpec], tensors: dict, ckpt) -> None:
        """The weights (and, from a checkpoint, the optimizer state and progress) loaded, into the grown arena."""
        from psd.state import buffers_view, weights_view, write_state

        slow = float(os.environ.get("PSD_TEST_SLOW_LOAD") or 0)
        if slow:
            time.sleep(slow)  # a test's stand-in for the seconds a large checkpoint's copy takes
        h = self.arena.header()
        write_state(spec, tensors, weights_view(self.arena, h), buffers_view(self.arena, h))
        if ckpt is not None:
            from psd.watchdog.checkpoint import EVICTED_FIELDS, restore_optimizer_state

            self.generation = max(ckpt.generation + 1, self.generation)
            # The learners it had evicted stay refused (the records come back as they were; the reaper
            # frees each slot once its process is gone).
            evicted = [tuple(r[k] for k in EVICTED_FIELDS) for r in ckpt.evicted]
            if restore_optimizer_state(self.arena, ckpt):
                o = ckpt.optim
                # A round its last server was finishing (a snapshot of a dead server's arena, or of one held in
                # a round) is finished by this one's loop (update.c recover_round); older checkpoints hold none.
                self.arena.restore(ckpt.clock, self.generation, ckpt.ranks, opt_steps=o["opt_steps"],
                                   rounds=o["rounds"], acc_count=o["acc_count"], acc_staleness=o["acc_staleness"],
                                   lr_now=o["lr_now"], evicted=evicted, round_applying=o.get("round_applying", 0),
                                   round_applied=o.get("round_applied", 0))
            else:
                self.arena.restore(ckpt.clock, self.generation, ckpt.ranks, evicted=evicted)
                if self.config.state_vectors() or ckpt.optim.get("opt_steps"):
                    log.warning("job %r: %s was written with --optimizer %s --sync %s; the optimizer state "
                                "starts afresh", self.config.job, ckpt.path, ckpt.optim.get("optimizer", "sgd"),
                                ckpt.optim.get("sync", "asp"))

    def poll(self) -> None:
        """One supervision tick: admit a spec, start the loop, reap dead learners."""
        a = self.arena
        if self._crash_at and time.monotonic() >= self._crash_at:
            self._crash()
        st = a.state
        if st == _native.ARENA_SPEC_OFFERED:
            self._admit_spec()
        elif st == _native.ARENA_INIT_WEIGHTS:
            h = a.header()
            if self._offerer_gone(h):
                a.set_state(_native.ARENA_WAITING_SPEC,
                            f"learner pid {h['offer_pid']} died before writing its initial weights")
                log.warning("job %r: learner pid %d died before writing its initial weights; waiting for "
                            "another", self.config.job, h["offer_pid"])
        if not self._loop_running:
            a.beat()  # the update loop beats once it runs; until then, this thread does
        if st == _native.ARENA_READY:
            if not self._loop_running:
                spec = arena_spec(a)
                a.start_loop(piece_geometry(spec), buffers_set(spec))
                self._loop_running = True
                log.info("job %r: ready, %d parameters; update loop running", self.config.job,
                         HeaderView(a).n_params)
            for pid in a.reap():
                log.warning("job %r: learner pid %d died (or its lease ran out); applying what it pushed, "
                            "then freeing its slot", self.config.job, pid)
                self.events.emit("learner_died", learner_pid=pid)
            self._watch_slots()

    def _crash(self) -> None:
        """Die as a crashing server does (PSD_TEST_CRASH_AFTER): no clean-up, the arena stays."""
        msg = f"server pid {os.getpid()} crashed on purpose (PSD_TEST_CRASH_AFTER={self._crash_after:g})"
        log.error("job %r: %s", self.config.job, msg)
        self.arena.set_state(self.arena.state, msg)
        os._exit(3)

    def _offerer_gone(self, h: dict) -> bool:
        """Whether the learner writing the initial weights died. Where /proc cannot tell (it is in
        another PID namespace), it gets ten leases: it has no slot, so no lease of its own."""
        import time

        live = _native.liveness(h["offer_pid"], h["offer_start_time"], h["offer_pid_ns"],
                                bool(h["cfg_flags"] & _native.CFG_LEASE_ONLY))
        if live != "unknown":
            self._offer_since = None
            return live == "dead"
        if self._offer_since is None:
            self._offer_since = time.monotonic()
        return time.monotonic() - self._offer_since > 10 * self.config.lease

    def _admit_spec(self) -> None:
        a = self.arena
        cfg = self.config
        h = a.header()
        try:
            spec = decode_spec(a.spec())
            sizes = model_sizes(spec)
            if sizes != tuple(h[k] for k in ("n_params", "n_train", "n_buffers", "n_pieces")) or not sizes[1]:
                raise SpecError("the offered spec is inconsistent (its sizes do not add up)")
            if any(p.kind not in ("param", "frozen", "buffer") for p in spec):
                raise SpecError("the offered spec names a kind of tensor this psd does not know; use the same psd "
                                "version for the server and its learners")
            size = _native.arena_size(cfg.learners, cfg.ring_depth, SPEC_CAPACITY, *sizes[:1], cfg.state_vectors(),
                                      *sizes[1:])
            check_space(size - h["mapped_size"], f"job {cfg.job!r} with {h['n_params']:,} parameters")
            a.grow()
        except (Error, ValueError, KeyError, TypeError) as e:  # the offered spec is the learner's word
            msg = str(e) if isinstance(e, (Error, ValueError)) else f"the offered spec is malformed ({e!r})"
        except OSError as e:  # posix_fallocate found /dev/shm fuller than statvfs said
            msg = str(OutOfSharedMemory(f"job {cfg.job!r}: cannot reserve the arena: {e.strerror}"))
        else:
            a.set_state(_native.ARENA_INIT_WEIGHTS)
            log.info("job %r: model from pid %d: %d tensors, %d parameters, arena %.1f MiB", cfg.job,
                     h["offer_pid"], len(spec), h["n_params"], size / (1 << 20))
            self.events.emit("model_admitted", learner_pid=h["offer_pid"], tensors=len(spec),
                             parameters=h["n_params"], arena_bytes=size)
            return
        log.error("job %r: refused the model offered by pid %d: %s", cfg.job, h["offer_pid"], msg)
        self.events.emit("model_refused", learner_pid=h["offer_pid"], reason=msg)
        a.set_state(_native.ARENA_WAITING_SPEC, msg)

    def _evictions_kept(self) -> set[tuple[int, int]]:
        """The eviction records the arena's slots hold now, as (slot, evicted_unix_ns)."""
        a = self.arena
        h = HeaderView(a)
        if h.state < _native.ARENA_INIT_WEIGHTS or not h.weights_off:
            return set()  # no model: the learner blocks (and so no eviction) exist yet
        return {(i, info["evicted_unix_ns"]) for i in range(h.n_slots)
                if (info := a.slot_info(i))["state"] == _native.SLOT_EVICTED}

    def _watch_slots(self) -> None:
        """Log admissions, evictions and rejected gradients, which the native side only counts."""
        a = self.arena
        h = a.header()
        sharpness: dict[int, float] = {}
        by_proc = not h["cfg_flags"] & _native.CFG_LEASE_ONLY
        for i in range(h["n_slots"]):
            info = a.slot_info(i)
            self._deaths.watch(i, info, by_proc)
            if info["state"] == _native.SLOT_ACTIVE:
                sharpness[i] = info["sharpness"]
            if info["state"] == _native.SLOT_EVICTED and (i, info["evicted_unix_ns"]) not in self._evictions_seen:
                self._evictions_seen.add((i, info["evicted_unix_ns"]))
                rule = EVICTION_RULES.get(info["evicted_rule"], f"rule {info['evicted_rule']}")
                log.error("job %r: evicted learner pid %d (rank %d): %s (a stray write into its slot?); nothing "
                          "more of its ring is applied, that process gets no slot again, and the job goes on",
                          self.config.job, info["evicted_pid"], info["rank"], rule)
                self.events.emit("learner_evicted", learner_pid=info["evicted_pid"], rank=info["rank"], rule=rule,
                                 slot=i, evicted=h["evicted"])
            pid = info["pid"] if info["state"] == _native.SLOT_ACTIVE else 0
            owner = info["claims"] if pid else 0
            if owner and self._owners.get(i) != owner:
                log.info("job %r: learner pid %d attached (slot %d)", self.config.job, pid, i)
                self.events.emit("learner_attached", learner_pid=pid, slot=i, rank=info["rank"])
                self._rejected[i] = 0
                self._dropped[i] = 0
                self._ignored[i] = 0
            self._owners[i] = owner
            new = info["rejected"] - self._rejected.get(i, 0)
            if pid and new > 0:
                log.warning("job %r: rejected %d non-finite gradient(s) (NaN or Inf) from learner pid %d",
                            self.config.job, new, pid)
                self.events.emit("gradients_rejected", learner_pid=pid, slot=i, count=new, reason="non-finite")
                self._rejected[i] = info["rejected"]
            new = info["dropped"] - self._dropped.get(i, 0)
            if pid and new > 0:
                log.info("job %r: dropped %d gradient(s) staler than --max-staleness %s from learner pid %d",
                         self.config.job, new, self.config.max_staleness, pid)
                self.events.emit("gradients_dropped", learner_pid=pid, slot=i, count=new, reason="stale")
                self._dropped[i] = info["dropped"]
            new = info["ignored"] - self._ignored.get(i, 0)
            if new > 0:
                log.warning("job %r: ignored %d gradient(s) in slot %d pushed under an old claim (a learner "
                            "whose slot was taken back, e.g. after its lease ran out, kept pushing)",
                            self.config.job, new, i)
                self.events.emit("gradients_ignored", slot=i, count=new, reason="stale claim token")
                self._ignored[i] = info["ignored"]
        self._steer_gain(h, sharpness)

    def _steer_gain(self, h: dict, sharpness: dict[int, float]) -> None:
        """--async-momentum auto: the gain level and the damping (psd/gain.py) from the sharpness the live
        learners measured (slot -> its last reading, learner/sharpness.py: the curvature along its
        mini-batch's gradient). The median of the usable readings (one mini-batch's reading is noisy: the
        largest of 8 learners' would read the job sharper the more learners it has, and no one learner
        moves a median far) is held as a maximum that halves over gain.HALF_LIFE new readings
        (gain.SharpnessHold)."""
        mu = h["momentum"]  # the header's configuration: the flags' defaults filled in
        if (ASYNC_MOMENTUM[h["async_momentum"]] != "auto" or OPTIMIZERS[h["optimizer"]] not in ("momentum", "nesterov")
                or not 0 < mu < 1):
            return
        if self._steer_since is None:
            self._steer_since = time.monotonic()
        held = self._held.update(sharpness)
        seen = held is not None
        lr_sharpness = h["lr_now"] * held if seen else math.nan  # gain.level and gain.damping: unmeasured
        # The staleness the loop's rule reads (psd_rule_staleness: held when learners leave), as the job's
        tau = gain.node_staleness(h["staleness_rule"], h["nodes"], h["node_lag"])
        # Measured before the loop met any staleness: gain.level says 0 at tau 0, and the next poll is 0.1 s
        # away, hundreds of updates in a small job (the embeddings of the convergence matrix ran a third of
        # their 1,000 updates at level 0 so, momentum 0.5 where the level gave 0.89). Until some staleness is
        # measured, the level is taken at the staleness the live learners bring in turn: each gradient
        # meets the others' updates, one each (more than the mean they measure: the safer side).
        lvl = gain.level(lr_sharpness, mu, tau if tau > 0 else float(max(0, len(sharpness) - 1)))
        # The first measurement sets it (the learners measure densely at first: steps 1, 2, 4, ..., 32); after
        # that it falls at once, and rises by at most gain.RISE an update: a loss sharpens between measurements
        last = 0.0 if math.isnan(self._gain_level) else self._gain_level
        if self._measured:
            lvl = min(lvl, last + gain.RISE * max(0, h["clock"] - self._gain_clock))
        # Without staleness yet (the first updates) the rule applies the configured momentum at any level: the
        # level set above from the learners' number is set again, up or down, by the first measurement that
        # meets some staleness (the job's: several nodes' lag counts before this node's own learners meet any).
        self._measured = self._measured or (seen and tau > 0)
        self._gain_clock = h["clock"]
        damping = gain.damping(lr_sharpness, mu, tau)
        if lvl != self._gain_level or damping != self._damping:
            log.debug("job %r: gain level %.2f, damping %g (lr x sharpness %s, mean staleness %.2f)", self.config.job,
                      lvl, damping, f"{lr_sharpness:.4g}" if seen else "unmeasured", tau)
            self.arena.set_gain_level(lvl, damping)
            self._gain_level = lvl
            self._damping = damping

    def next_poll_s(self) -> float:
        """Seconds to the next poll: ``poll_interval``, or ``FIRST_LEVEL_POLL_S`` while an --async-momentum auto
        job waits for its first measured gain level, for at most ``FIRST_LEVEL_WINDOW_S`` from the first look
        (a job without a closure measures nothing). Until then the update loop runs at level 0 and under all
        of the damping, and 0.1 s is hundreds of updates of a small job: the convergence matrix's embeddings
        ran their first 175-330 of 1,000 so and lost 3-7 points of accuracy (-0.8 to +0.6 with this;
        benchmarks/results/matrix/README.md, "the first tenth of a second")."""
        if (self._steer_since is not None and not self._measured
                and time.monotonic() - self._steer_since < FIRST_LEVEL_WINDOW_S):
            return min(self.config.poll_interval, FIRST_LEVEL_POLL_S)
        return self.config.poll_interval

    def run(self, stop: SignalFlag) -> None:
        """Supervise until ``stop`` is set."""
        while not stop.is_set():
            self.poll()
            if self._deaths.ended:  # a learner ended between this poll's reap and its look at the slots
                self._deaths.ended = False
                continue
            stop.wait(self.next_poll_s(), also=self._deaths.fds())  # a learner's end wakes it: reaped at once

    def _drain(self, a: _native.Arena, timeout: float) -> None:
        """Apply what learners had pushed when the stop came (they may go on pushing), for at most ``timeout``
        seconds: a ring far behind (a slow optimizer on a big model, a paused loop) is left as it is."""
        n = HeaderView(a).n_slots
        targets = {}
        for i in range(n):
            s = a.slot_info(i)
            if s["state"] != _native.SLOT_FREE:
                targets[i] = (s["claims"], s["tail"])
        deadline = time.monotonic() + timeout
        while targets and time.monotonic() < deadline:
            for i, (claims, tail) in list(targets.items()):
                s = a.slot_info(i)
                if s["claims"] != claims or s["state"] == _native.SLOT_FREE or s["head"] >= tail:
                    del targets[i]
            time.sleep(0.002)  # the loop is applying them; it signals nothing we could wait on

    def _unapplied(self, a: _native.Arena) -> list[dict]:
        """What the stopped loop left in each ring: ``{slot, pid, rank, pending}``, ``pending`` the gradients
        pushed but not applied, or None where the ring's indices make no sense (a tail run ahead of its head
        by more than the ring's depth: nothing in it could have been applied)."""
        left = []
        h = HeaderView(a)
        k = h.ring_k
        for i in range(h.n_slots):
            s = a.slot_info(i)
            if s["state"] == _native.SLOT_FREE or s["tail"] == s["head"]:
                continue
            gap = (s["tail"] - s["head"]) % (1 << 64)
            left.append({"slot": i, "pid": s["pid"], "rank": s["rank"], "pending": gap if gap <= k else None})
        return left

    def stop(self, remove: bool = True, drain_timeout: float | None = None) -> None:
        """Stop the update loop, mark the arena stopped, and remove it.

        First the loop applies what was pushed before the stop, for at most ``drain_timeout`` seconds
        (DRAIN_TIMEOUT); what it could not apply is logged per learner, and lost with the arena.

        With ``remove=False`` (a hand-over), leave the arena as it is for the
        next server to take over; learners wait for that one.
        """
        if self._stopped or self.arena is None:
            return
        self._stopped = True
        self._deaths.close()
        drain_timeout = DRAIN_TIMEOUT if drain_timeout is None else drain_timeout
        a = self.arena
        if remove and self._loop_running:
            self._drain(a, drain_timeout)
        a.stop_loop()
        c = a.counters()
        left = self._unapplied(a) if remove and self._loop_running else []
        if not remove:
            a.close()
            log.info("job %r: server handing over; the arena stays for its successor (clock %d, %d pending)",
                     self.config.job, c["clock"], c["pending"])
            self.events.emit("server_handover", **c)
            return
        # A successor takes a STOPPED arena left by a server killed before its unlink as one that holds the
        # job's model (it goes on where this one stopped). One that never held the weights (a learner's offer
        # unwritten, --init or a checkpoint not yet loaded) is unlinked first: killed between the two, this
        # server leaves no arena of zeros for the next to take as the job's weights.
        weightless = a.state in WEIGHTLESS
        if weightless:
            _unlink(a.name)
        else:
            a.set_state(_native.ARENA_STOPPED, "the server stopped")
        self._test_crash_in_stop()
        if weightless:
            a.set_state(_native.ARENA_STOPPED, "the server stopped")
        else:
            _unlink(a.name)
        a.close()
        if left:
            each = ", ".join(f"learner pid {x['pid']} (slot {x['slot']}, rank {x['rank']}): "
                             + (f"{x['pending']}" if x["pending"] is not None else "its ring's tail ran ahead of the "
                                "head, nothing in it usable") for x in left)
            log.warning("job %r: stopped after draining for %g s; gradients pushed but not applied, lost with the "
                        "arena: %s. Stop the learners before the server to apply everything they push", self.config.job,
                        drain_timeout, each)
        log.info("job %r: stopped; %d gradients pushed, %d applied, %d rejected (non-finite), %d dropped "
                 "(stale), %d pending; arena removed", self.config.job, c["pushed"], c["applied"], c["rejected"],
                 c["dropped"], c["pending"])
        self.events.emit("server_stopped", **c, unapplied=left)
