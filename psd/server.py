"""The psd server: owns a job's arena and runs the native update loop.

The server creates the arena, learns the model's parameter spec (from the first
learner to attach, or from an initial-weights file), grows the arena to hold
the weights and one ring per learner slot, starts the update loop, notices
learners that died and lets the loop drain and free their slots, and removes
the arena on a clean stop. It is the only role that creates, grows or removes
an arena; learners only attach.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from psd import __version__, _native
from psd.arena import (
    ParamSpec,
    check_space,
    decode_spec,
    default_job,
    encode_spec,
    shm_name,
    shm_path,
)
from psd.errors import Error, OutOfSharedMemory, SpecError

__all__ = ["ServeConfig", "Server", "auto_threads"]

log = logging.getLogger("psd.server")

SPEC_CAPACITY = 1 << 20  # bytes of JSON: room for tens of thousands of tensors


def auto_threads() -> int:
    """Update-loop threads when not told: a quarter of the cores, 1 to 8.

    The learners need the rest; on small machines one thread already moves
    memory at close to the bandwidth limit.
    """
    return max(1, min(8, (os.cpu_count() or 1) // 4))


@dataclass
class ServeConfig:
    """What ``psd serve`` is asked to do. Every field has a CLI flag and a PSD_<FLAG> variable."""

    job: str = field(default_factory=default_job)
    learners: int = 8
    lr: float = 0.01
    slots: int = 4
    threads: int = 0
    spin_us: int = 50
    init: str | None = None
    poll_interval: float = 0.1

    def validate(self) -> None:
        """Raise ValueError with a fix for each bad value."""
        shm_name(self.job)
        if not 1 <= self.learners <= _native.MAX_SLOTS:
            raise ValueError(f"--learners must be 1..{_native.MAX_SLOTS}, not {self.learners}")
        k = self.slots
        if not (1 <= k <= _native.MAX_RING and k & (k - 1) == 0):
            raise ValueError(f"--slots must be a power of two from 1 to {_native.MAX_RING}, not {k}")
        if not (self.lr > 0 and self.lr < float("inf")):
            raise ValueError(f"--lr must be a positive number, not {self.lr}")
        if self.threads < 0:
            raise ValueError(f"--threads must be 0 (automatic) or more, not {self.threads}")
        if self.spin_us < 0:
            raise ValueError(f"--spin-us must be 0 or more, not {self.spin_us}")


def _load_initial_weights(path: str) -> tuple[list[ParamSpec], dict]:
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise FileNotFoundError(f"--init {path}: no such file (give a .safetensors file of the weights)")
    tensors = load_file(path)
    spec = []
    for name, t in tensors.items():
        if str(t.dtype) != "torch.float32":
            raise SpecError(f"--init {path}: tensor {name!r} is {t.dtype}; psd holds float32 weights")
        spec.append(ParamSpec(name, tuple(t.shape)))
    return spec, tensors


class Server:
    """One job's server. ``start()``, then ``run(stop_event)`` or ``poll()`` in a loop, then ``stop()``."""

    def __init__(self, config: ServeConfig) -> None:
        config.validate()
        self.config = config
        self.threads = config.threads or auto_threads()
        self.arena: _native.Arena | None = None
        self.generation = 0
        self._loop_running = False
        self._owners: dict[int, int] = {}  # slot -> pid last seen
        self._stopped = False

    # -- life cycle ---------------------------------------------------------

    def start(self) -> None:
        """Create the arena (and, given initial weights, make it ready at once)."""
        cfg = self.config
        name = shm_name(cfg.job)
        spec = tensors = None
        if cfg.init:
            spec, tensors = _load_initial_weights(cfg.init)
        check_space(_native.arena_size(cfg.learners, cfg.slots, SPEC_CAPACITY, 0), f"job {cfg.job!r}")
        if spec is not None:
            n = sum(p.numel for p in spec)
            check_space(_native.arena_size(cfg.learners, cfg.slots, SPEC_CAPACITY, n), f"job {cfg.job!r}")
        try:
            self.arena = _native.create(name, 0o600, cfg.learners, cfg.slots, SPEC_CAPACITY, __version__)
        except FileExistsError:
            raise self._existing_job_error() from None
        me = os.getpid()
        self.generation = self.arena.become_server(
            me, _native.proc_start_time(me), cfg.lr, self.threads, cfg.spin_us
        )
        log.info(
            "job %r: arena %s, %d learner slots x %d ring entries, lr %g, %d update thread(s)",
            cfg.job, shm_path(cfg.job), cfg.learners, cfg.slots, cfg.lr, self.threads,
        )
        if spec is not None:
            self._load_weights(spec, tensors)
        else:
            log.info("job %r: waiting for the first learner to bring its model", cfg.job)

    def _existing_job_error(self) -> Error:
        job = self.config.job
        try:
            old = _native.open(shm_name(job))
        except Error as e:
            return Error(f"{shm_path(job)} exists but cannot be used ({e}); remove it with `psd clean`")
        try:
            pid = old.header()["server_pid"]
            if old.server_alive():
                return Error(f"job {job!r} already has a running server (pid {pid}); stop it first, "
                             f"or choose another --job")
            return Error(f"job {job!r} has an arena left by a server that died (pid {pid}); remove it "
                         f"with `psd clean`, then start again")
        finally:
            old.close()

    def _load_weights(self, spec: list[ParamSpec], tensors: dict) -> None:
        import torch

        data, digest = encode_spec(spec)
        n = sum(p.numel for p in spec)
        me = os.getpid()
        self.arena.set_spec(data, digest, n, me, _native.proc_start_time(me))
        self.arena.grow()
        h = self.arena.header()
        w = torch.frombuffer(self.arena, dtype=torch.float32, count=n, offset=h["weights_off"])
        off = 0
        for p in spec:
            w[off:off + p.numel].copy_(tensors[p.name].reshape(-1))
            off += p.numel
        del w
        self.arena.set_state(_native.ARENA_READY)
        log.info("job %r: loaded %d parameters (%d tensors) from %s", self.config.job, n, len(spec),
                 self.config.init)

    def poll(self) -> None:
        """One supervision tick: admit a spec, start the loop, reap dead learners."""
        a = self.arena
        st = a.state
        if st == _native.ARENA_SPEC_OFFERED:
            self._admit_spec()
        elif st == _native.ARENA_INIT_WEIGHTS:
            h = a.header()
            if _native.proc_start_time(h["offer_pid"]) != h["offer_start_time"]:
                a.set_state(_native.ARENA_WAITING_SPEC,
                            f"learner pid {h['offer_pid']} died before writing its initial weights")
                log.warning("job %r: learner pid %d died before writing its initial weights; waiting for "
                            "another", self.config.job, h["offer_pid"])
        elif st == _native.ARENA_READY:
            if not self._loop_running:
                a.start_loop()
                self._loop_running = True
                log.info("job %r: ready, %d parameters; update loop running", self.config.job,
                         a.header()["n_params"])
            for pid in a.reap():
                log.warning("job %r: learner pid %d died; applying what it pushed, then freeing its slot",
                            self.config.job, pid)
            self._log_admissions()

    def _admit_spec(self) -> None:
        a = self.arena
        cfg = self.config
        h = a.header()
        try:
            spec = decode_spec(a.spec())
            if sum(p.numel for p in spec) != h["n_params"] or not spec:
                raise SpecError("the offered spec is inconsistent (its sizes do not add up)")
            size = _native.arena_size(cfg.learners, cfg.slots, SPEC_CAPACITY, h["n_params"])
            check_space(size - h["mapped_size"], f"job {cfg.job!r} with {h['n_params']:,} parameters")
            a.grow()
        except (Error, ValueError) as e:
            msg = str(e)
        except OSError as e:  # posix_fallocate found /dev/shm fuller than statvfs said
            msg = str(OutOfSharedMemory(f"job {cfg.job!r}: cannot reserve the arena: {e.strerror}"))
        else:
            a.set_state(_native.ARENA_INIT_WEIGHTS)
            log.info("job %r: model from pid %d: %d tensors, %d parameters, arena %.1f MiB", cfg.job,
                     h["offer_pid"], len(spec), h["n_params"], size / (1 << 20))
            return
        log.error("job %r: refused the model offered by pid %d: %s", cfg.job, h["offer_pid"], msg)
        a.set_state(_native.ARENA_WAITING_SPEC, msg)

    def _log_admissions(self) -> None:
        a = self.arena
        for i in range(a.header()["n_slots"]):
            info = a.slot_info(i)
            pid = info["pid"] if info["state"] == _native.SLOT_ACTIVE else 0
            if pid and self._owners.get(i) != pid:
                log.info("job %r: learner pid %d attached (slot %d)", self.config.job, pid, i)
            self._owners[i] = pid

    def run(self, stop: threading.Event) -> None:
        """Supervise until ``stop`` is set."""
        while not stop.is_set():
            self.poll()
            stop.wait(self.config.poll_interval)

    def stop(self) -> None:
        """Stop the update loop, mark the arena stopped, and remove it."""
        if self._stopped or self.arena is None:
            return
        self._stopped = True
        a = self.arena
        a.stop_loop()
        c = a.counters()
        a.set_state(_native.ARENA_STOPPED, "the server stopped")
        try:
            _native.unlink(a.name)
        except FileNotFoundError:
            pass
        a.close()
        log.info("job %r: stopped; %d gradients pushed, %d applied, %d rejected, %d pending; arena removed",
                 self.config.job, c["pushed"], c["applied"], c["rejected"], c["pending"])
