"""The watchdog: keeps a job's server alive and writes its checkpoints.

``psd serve`` runs this. It starts the server as a child process (in its own
session, so a Ctrl-C reaches only the watchdog, which then checkpoints and
stops the server in order), reads the server's heartbeat from the arena
header, and restarts a server that died or hung: SIGUSR2 (hand over: stop
without removing the arena), a one-second deadline, then SIGKILL. The new server takes over the
surviving arena, so learners lose nothing; only if the arena itself is gone
or damaged (a server that died of SIGBUS: its arena file was truncated or
replaced) does the new server start from the newest valid checkpoint.
Restarts are counted over the whole run and spaced by an exponential
back-off; a restart is forgiven only after a long healthy stretch, so a
server that crashes the same way after every start is given up on, with its
last error, and its arena is left for ``psd inspect``.
Periodically, on SIGUSR1 and at a clean stop, it writes a consistent
checkpoint. A watchdog that finds a live server for its job (because an
earlier watchdog was killed) adopts it instead of starting another.

The watchdog only supervises and checkpoints; creating, repairing and
removing arenas stays with the server.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from psd import _native
from psd.arena import (
    ARENA_LOST_EXIT,
    WEIGHTLESS,
    ArenaWatch,
    HeaderView,
    open_job,
    recover_from_sigbus,
    shm_name,
    shm_path,
)
from psd.errors import ArenaLost, Error
from psd.events import EventLog
from psd.server import WATCHDOG_ENV, ServeConfig
from psd.signals import SignalFlag, Stop
from psd.watchdog import checkpoint
from psd.watchdog.restarts import Backoff, RestartPolicy

__all__ = ["GIVE_UP_EXIT", "ServerState", "Watchdog", "WatchdogConfig", "terminate", "terminate_writer"]

log = logging.getLogger("psd.watchdog")

# The exit status of a watchdog that gave up on its server (max_restarts): `psd run` then stops the job and
# leaves the arena, instead of starting another watchdog that would start the crash loop again.
GIVE_UP_EXIT = 86
# The node link's restarts: 0.5 s doubling (to WatchdogConfig.backoff_cap) while it crash-loops; a link that
# ran longer than LINK_FRESH_AFTER seconds was not crash-looping, and its count starts over.
LINK_BACKOFF_BASE = 0.5
LINK_FRESH_AFTER = 60.0


class ServerState(enum.Enum):
    """What the watchdog believes about its server.

    STARTING -> RUNNING      the server's heartbeat appeared in the arena
    STARTING -> FAILED       the very first server exited before it ran: a configuration error
                             (its message is on stderr), not a crash to restart
    STARTING -> RESTARTING   a later server exited, or gave no heartbeat within the start deadline
    RUNNING  -> RESTARTING   it exited, was killed, or its heartbeat went stale
    RESTARTING -> STARTING   a new server was started, after the back-off (below)
    STARTING, RUNNING -> FAILED   instead of RESTARTING: that restart would be the (max_restarts + 1)-th
                             still counted (the arena is left as it is)
    any      -> STOPPED      clean stop (SIGINT/SIGTERM)

    A server killed by a signal (an OOM kill, a preemption, ``psd chaos``: not an exit of its own, a hang or a
    lost arena) whose life got the job further than every life before it (the arena's clock at its end past
    the furthest any earlier server reached: it applied gradients) was no crash loop: it is restarted at once
    and forgives the restarts counted before (``Watchdog._progressed``, as ``psd run`` forgives a learner's
    lives). A server that exits with an error after some updates (every start applies what the rings hold)
    still counts. Every other restart counts, whether the server had run or not. A counted restart is also
    forgiven once a server has run healthy (RUNNING, beating) for ``forgive_after`` seconds; the next one
    needs as long again. With n restarts counted, the n-th waits 0 s if n == 1 (a server killed once comes
    back at once), else ``min(backoff_cap, backoff_base * 2 ** (n - 2))``. The rule is the watchdog's
    ``RestartPolicy`` (watchdog/restarts.py), ``Watchdog.server_policy``.
    """

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class WatchdogConfig:
    """What ``psd serve`` asks of its watchdog; each field has a flag and a PSD_<FLAG> variable."""

    serve: ServeConfig
    checkpoint_dir: Path | None = None  # None: checkpoint.default_dir(job)
    checkpoint_every: float = 60.0  # seconds; 0 turns periodic checkpoints off
    keep: int = 3
    heartbeat_timeout: float = 2.0
    max_restarts: int = 10  # server restarts counted at once before the watchdog gives up
    forgive_after: float = 300.0  # seconds of healthy running that forgive one counted restart
    backoff_base: float = 0.1  # seconds before the second counted restart; doubles with each one after
    backoff_cap: float = 10.0  # longest back-off between restarts, in seconds
    start_timeout: float = 30.0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    extra_env: dict = field(default_factory=dict)

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else checkpoint.default_dir(self.serve.job)


def terminate(proc_or_pid, deadline: float = 5.0, sig: int = signal.SIGTERM) -> None:
    """Stop a process: ``sig`` (SIGTERM), wait up to ``deadline`` seconds, then SIGKILL."""
    if not isinstance(proc_or_pid, int):  # a subprocess.Popen, or a learner the fork server forked (its calls)
        p = proc_or_pid
        if p.poll() is not None:
            return
        p.send_signal(sig)
        try:
            p.wait(deadline)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        return
    # Not our child: we cannot wait() for it, and once it exits it may stay a zombie until its
    # parent reaps it, so "gone" means its pid no longer names the process we signalled.
    pid = proc_or_pid
    start = _native.proc_start_time(pid)
    if start == 0:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    end = time.monotonic() + deadline
    while _native.owner_alive(pid, start):
        if time.monotonic() > end:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        time.sleep(0.01)


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc stat file after the command name (which may hold spaces and parentheses): the
    state first; None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _work_done(pid: int) -> tuple[int, int] | None:
    """How far process ``pid`` has got: its CPU time in clock ticks (user and system, /proc/PID/stat) and the
    bytes it has written (``wchar`` of /proc/PID/io; -1 where that file is not ours to read); None where the
    process is gone. Either moving means it is working (a checkpoint is copied, serialised, then written)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    try:
        ticks = int(fields[11]) + int(fields[12])  # utime and stime, the stat line's 14th and 15th fields
    except (TypeError, ValueError, IndexError):
        return None
    written = -1
    try:
        with open(f"/proc/{pid}/io") as f:
            written = next((int(line.split()[1]) for line in f if line.startswith("wchar:")), -1)
    except (OSError, ValueError):
        pass
    return ticks, written


def _waits_on_disk(pid: int) -> bool:
    """Whether a thread of process ``pid`` sleeps in the kernel uninterruptibly (state D: an fsync, a write
    to a slow disk), which neither CPU time nor bytes written show while it lasts."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any((fields := _stat_fields(f"/proc/{pid}/task/{t}/stat")) and fields[0] == "D" for t in tasks)


def terminate_writer(pid: int, start: int, deadline: float, idle: float, cap: float, sig: int = signal.SIGTERM,
                     waiting: Callable[[float], None] | None = None) -> bool:
    """Stop process ``pid`` (not our child; ``start``: its start time, as the header recorded it) that may
    have much to do on its way out (the watchdog's last checkpoint): ``sig``, then wait until it is gone;
    SIGKILL it once ``deadline`` seconds have passed and for ``idle`` seconds it has neither run, written nor
    waited on the disk (``_work_done``, ``_waits_on_disk``), or at ``cap`` seconds whatever it does. A
    checkpoint slower than the rate a deadline allowed for (a loaded machine, a slow disk) is waited for while
    it moves, not killed halfway: that lost what was trained since the last checkpoint. ``waiting(cap)`` is
    called once as the deadline passes with the process still working. Signals go through a pidfd, so a
    reused pid is never signalled. True if it had to be killed."""
    if not _native.owner_alive(pid, start):
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if not _native.owner_alive(pid, start):  # the pid named another process by the time the fd was opened
            return False
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            return False
        t0 = time.monotonic()
        done, moved, told = _work_done(pid), t0, False
        while _native.owner_alive(pid, start):
            now = time.monotonic()
            d = _work_done(pid)
            if (d is not None and d != done) or _waits_on_disk(pid):
                moved = now
            done = d if d is not None else done
            if now - t0 > cap or (now - t0 > deadline and now - moved > idle):
                if not _native.owner_alive(pid, start):  # it ended meanwhile (a zombie counts so)
                    return False
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    return False
                return True
            if not told and now - t0 > deadline and waiting is not None:
                waiting(cap)
                told = True
            select.select([pidfd], [], [], 0.05)  # readable once it has exited: no need to look again sooner
        return False
    finally:
        os.close(pidfd)


class Watchdog:
    """Supervise one job's server. ``start()``, then ``run(stop_event)``, then ``stop()``."""

    def __init__(self, config: WatchdogConfig) -> None:
        config.serve.validate()
        self.config = config
        self.state = ServerState.STARTING
        self.proc: subprocess.Popen | None = None  # our child server, if we started it
        self.server_pid = 0
        self._server_start = 0
        self._started_at = 0.0
        self._start_limit = config.start_timeout  # seconds a server may take to make its arena (_spawn)
        self._last_poll = 0.0  # monotonic time of the last poll
        self._awake_since = 0.0  # when this watchdog last woke from a stall (a gap between polls)
        # The server's crash loop: restarts counted until forgiven by forgive_after s of healthy running, at most
        # max_restarts of them, the first at once, then backoff_base doubling to backoff_cap.
        self.server_policy = RestartPolicy(Backoff(config.backoff_base, config.backoff_cap),
                                           limit=config.max_restarts, first_step=0,
                                           forgive_after=config.forgive_after)
        self.restarts = 0
        self._reach = 0  # the furthest clock any server's life reached (_progressed)
        self.backoffs: list[float] = []  # the wait before each restart, in seconds
        self.last_error = ""  # why the last server died, as the give-up message says it
        self._restart_at = 0.0  # when RESTARTING: the monotonic time the back-off ends
        self._arena_lost = False  # when RESTARTING: the dead server's arena is lost (start from a checkpoint)
        self._watch = ArenaWatch(config.serve.job)
        self._next_checkpoint = 0.0
        self._last_ckpt_clock = -1
        self.checkpoint_requested = SignalFlag()  # SIGUSR1's handler sets it
        self._importing = False  # the import of what checkpoints need has been started
        self._resume_first = bool(config.serve.resume)
        self._had_model = False  # the job reached READY under this watchdog (its arena held weights)
        # The job's lineage and the checkpoint its weights were loaded from, from its READY arena (psd_layout.h):
        # what checkpoint.of_job takes for the job's own
        self._lineage, self._origin = 0, (0, 0)
        self._ready_seen = False  # the arena mapped now was seen READY (a replaced arena starts unseen)
        self.events = EventLog(config.serve.event_log, config.serve.job, "watchdog")
        self.exit_code = 1  # when FAILED
        self.link: subprocess.Popen | None = None  # the node link (--nnodes > 1), psd/nodelink.py
        self._link_lives = 0  # node links started by this watchdog
        # The link's crash loop: no limit; a link that ran a while starts the count over.
        self.link_policy = RestartPolicy(Backoff(LINK_BACKOFF_BASE, config.backoff_cap), first_step=1,
                                         fresh_after=LINK_FRESH_AFTER)
        self._link_restart_at = 0.0

    # -- the server process -------------------------------------------------

    def _server_argv(self, resume_from: Path | None, init: str | None) -> list[str]:
        s = self.config.serve
        argv = [sys.executable, "-m", "psd.cli", "serve", "--no-watchdog", *s.argv()]
        if init:
            argv += ["--init", init]
        if resume_from is not None:
            argv += ["--resume", str(resume_from)]
        argv += ["--event-log", s.event_log or ""]
        return argv

    def _spawn(self, resume: bool, source: Path | None = None) -> None:
        """Start a server; with ``resume``, one that loads ``source`` (a checkpoint file), or where none is given,
        ``_resume_source()``."""
        me = os.getpid()
        # The server names this watchdog in the header before it names itself (psd/server.py own_watchdog): a
        # second `psd serve` that finds the server alive finds its watchdog alive too, and refuses; it adopted
        # the server as if its watchdog had died when it came before this watchdog's first look at the arena.
        env = dict(os.environ, **self.config.extra_env, **{WATCHDOG_ENV: f"{me}:{_native.proc_start_time(me)}"})
        resume_from = (source or self._resume_source()) if resume else None
        init = self.config.serve.init if not self._had_model else None  # until the job holds a model: --init's
        self.proc = subprocess.Popen(self._server_argv(resume_from, init), env=env, start_new_session=True)
        self.server_pid = self.proc.pid
        self._server_start = _native.proc_start_time(self.proc.pid)
        self._started_at = time.monotonic()
        # The server reads --resume's checkpoint or --init's file before it makes its arena: a large one takes
        # longer than the start limit of a server that loads nothing.
        self._start_limit = (self.config.start_timeout + checkpoint.load_allowance(resume_from, self.config.serve.job)
                             + checkpoint.load_allowance(init))
        self.state = ServerState.STARTING
        log.info("job %r: started server pid %d%s", self.config.serve.job, self.proc.pid,
                 " (resuming from checkpoint)" if resume else "")

    def _open_arena(self, announce: bool = True) -> _native.Arena | None:
        """Our mapping of the job's arena, reopened if the object was replaced (psd.arena.ArenaWatch).

        A new mapping records this process as the arena's watchdog, unless ``announce`` is false.
        """
        a = self._watch.current()
        if a is not None and self._watch.opened:
            self._ready_seen = False  # another arena than the one seen: what it holds is not known yet
        if a is not None and self._watch.opened and announce:
            me = os.getpid()
            a.note_watchdog(me, _native.proc_start_time(me))
            if not self._importing:
                # Checkpoints need torch (safetensors.torch, the arena's views): importing it takes seconds
                # of CPU, which the first checkpoint, or the last one at a stop, would otherwise wait for (a
                # stop of an idle job took 2.5 s, 2.2 of them this import). Started once this watchdog has
                # put its name in the arena, so that the import's seconds never delay that.
                self._importing = True
                threading.Thread(target=_import_checkpoint_deps, name="psd-import-torch").start()
        return a

    def _drop_arena(self) -> None:
        self._watch.close()  # a snapshot tensor that still maps it keeps it until the tensor goes

    def _server_alive(self) -> bool:
        if self.proc is not None and self.proc.pid == self.server_pid:
            return self.proc.poll() is None
        return _native.owner_alive(self.server_pid, self._server_start)

    def start(self) -> None:
        """Adopt the job's live server, or start one."""
        for _ in range(3):
            try:
                self._start()
                return
            except ArenaLost as e:  # truncated as this watchdog read it: look again, at what is left
                log.warning("job %r: %s", self.config.serve.job, e)
                self._drop_arena()
        self._start()

    def _start(self) -> None:
        a = self._open_arena(announce=False)
        if a is not None:
            with contextlib.suppress(ArenaLost):
                self._reach = max(self._reach, a.clock())  # a dead server's arena: its clock is no life's progress
        if a is not None and HeaderView(a).n_params and a.state in (_native.ARENA_READY, _native.ARENA_STOPPED):
            # The job held its model before this watchdog (one restarted, or a server adopted): a lost arena is
            # then restored from a checkpoint or the job stops, never started empty.
            self._had_model = self._ready_seen = True
            self._lineage, self._origin = checkpoint.lineage_in(HeaderView(a))
        if a is not None and a.server_alive():
            h = HeaderView(a)
            server, watchdog = (h.server_pid, h.server_start_time), (h.watchdog_pid, h.watchdog_start_time)
            if _native.owner_alive(*watchdog):
                self._drop_arena()
                raise Error(f"job {self.config.serve.job!r} already has a running server (pid {server[0]}, "
                            f"watchdog pid {watchdog[0]}); stop it first, or choose another --job")
            me = os.getpid()
            a.note_watchdog(me, _native.proc_start_time(me))  # take over as its watchdog
            self.server_pid, self._server_start = server
            self._started_at = time.monotonic()
            self.state = ServerState.RUNNING
            self.server_policy.healthy(time.monotonic())
            log.info("job %r: adopted running server pid %d", self.config.serve.job, self.server_pid)
            self.events.emit("server_adopted", server_pid=self.server_pid)
        else:
            self._spawn(resume=self._resume_first)
        self._next_checkpoint = time.monotonic() + self.config.checkpoint_every

    def _restart(self, why: str, arena_lost: bool = False, killed: bool = False) -> None:
        job = self.config.serve.job
        log.warning("job %r: server pid %d %s; restarting it", job, self.server_pid, why)
        if self._server_alive():
            terminate(self.proc if self.proc is not None and self.proc.pid == self.server_pid else self.server_pid,
                      deadline=1.0, sig=signal.SIGUSR2)
        self.last_error = why
        policy = self.server_policy
        n = policy.failed(progress=self._progressed(arena_lost) and killed)
        if policy.exhausted:
            self._give_up(why)
            return
        self.state = ServerState.RESTARTING
        wait = policy.delay()
        self.backoffs.append(wait)
        self.events.emit("server_restart", server_pid=self.server_pid, reason=why, counted=n, backoff_s=wait)
        if wait:
            log.warning("job %r: %d server restarts counted (limit %d); waiting %.1f s before the next", job, n,
                        self.config.max_restarts, wait)
        if arena_lost:  # its mappings fault: nobody can use what is in it
            self._drop_arena()
        self._arena_lost = arena_lost
        self._restart_at = time.monotonic() + wait
        self._respawn()

    def _clock(self) -> int | None:
        """The job's clock in the arena this watchdog maps, or None where there is none to read."""
        a = self._open_arena()
        if a is None:
            return None
        try:
            return a.clock()
        except ArenaLost:
            return None

    def _progressed(self, arena_lost: bool) -> bool:
        """Whether the server that just ended got the job further than every server before it: the arena's clock
        past the furthest any earlier life reached: at its death, in the arena the watchdog found at its start,
        or in the checkpoint a new server restores (what it loads is no progress of its own). A lost arena's
        clock is not there to read: no progress. Never read while a server runs: its own updates would count
        as where it started."""
        clock = None if arena_lost else self._clock()
        if clock is None or clock <= self._reach:
            return False
        self._reach = clock
        return True

    def _respawn(self) -> None:
        """Start the next server once the back-off has passed (poll() calls again until then)."""
        if time.monotonic() < self._restart_at:
            return
        a = None if self._arena_lost else self._open_arena()
        restore = self._own_checkpoint() if a is None and self._had_model else None
        if restore is not None:
            self._reach = max(self._reach, restore.clock)
        if a is None and self._had_model and restore is None:
            # Starting over would silently make the next learner's model the job's: the trained weights
            # are gone, and that must be said, not papered over.
            job = self.config.serve.job
            self.state = ServerState.FAILED
            self.exit_code = GIVE_UP_EXIT
            log.error("job %r: its arena %s was lost or damaged (truncated, removed or overwritten) and there is "
                      "no valid checkpoint of this job in %s to restore it from: the trained weights are gone. "
                      "Stopping instead of starting an empty job. Remove what is left with `psd clean`, then start "
                      "the job again with `psd serve --job %s` (--checkpoint-every keeps checkpoints)", job,
                      shm_path(job), " or ".join(map(str, checkpoint.job_sources(self.config.ckpt_dir,
                                                                                    self.config.serve.resume))), job)
            self.events.emit("watchdog_gave_up", restarts=self.server_policy.count, reason="arena lost, no checkpoint",
                             fail_msg="")
            return
        self.restarts += 1
        # The arena survived: the new server takes it over. Gone, damaged or lost: the last checkpoint, where the
        # job resumed or held a model (one that did neither starts as it first did: a checkpoint there is another
        # run's, which would win over --init's weights); and where a server died before its arena held the
        # checkpoint's weights (a resuming job's first, or one restoring a lost arena), the checkpoint again: the
        # server starts over from it rather than wait for a learner's model.
        resume = (self._resume_first or self._had_model) and (a is None or a.state in WEIGHTLESS)
        if a is None and not resume:
            # A job that never held a model whose arena was lost or damaged: nothing in it to keep, and the next
            # server, given nothing to restore, would refuse a damaged file. It starts on a new one.
            with contextlib.suppress(FileNotFoundError):
                _native.unlink(shm_name(self.config.serve.job))
        self._spawn(resume=resume, source=restore.path if restore is not None else None)

    def _own_checkpoint(self) -> checkpoint.Checkpoint | None:
        """The job's newest checkpoint: of its lineage, or the one its weights were loaded from (checkpoint.of_job)."""
        return checkpoint.of_job(self.config.ckpt_dir, self.config.serve.resume, self._lineage, self._origin)

    def _resume_source(self) -> Path:
        """What a server this watchdog starts with --resume loads. Once the job held its model: its newest
        checkpoint of the job's lineage (the file). Before: what the job was started from (--resume DIR or FILE;
        a bare --resume, the checkpoint directory): a checkpoint elsewhere in the job's directory is then another
        run's, since the job wrote none (its first server, and one restarted before the job held its model)."""
        if self._had_model and self._lineage:
            ckpt = self._own_checkpoint()
            if ckpt is not None:
                return ckpt.path
        return Path(self.config.serve.resume or self.config.ckpt_dir)

    def _give_up(self, why: str) -> None:
        """FAILED: say why, and leave the arena as it is for ``psd inspect`` and a later server."""
        job = self.config.serve.job
        self.state = ServerState.FAILED
        self.exit_code = GIVE_UP_EXIT
        msg = self._fail_msg()
        n = self.server_policy.count - 1
        log.error("job %r: giving up: the server was restarted %d times (--server-restarts %d; a restart counts "
                  "until a server has run healthy for %g s after it, unless it was killed by a signal after it "
                  "applied gradients), and the last one %s%s. "
                  "The arena %s is left as it is: `psd inspect --job %s` shows it; fix the cause (the server's "
                  "log is above), then `psd serve --job %s` takes it over (or `psd clean` removes it)",
                  job, n, self.config.max_restarts, self.config.forgive_after, why,
                  f" (the arena says: {msg})" if msg else "", shm_path(job), job, job)
        self.events.emit("watchdog_gave_up", restarts=n, reason=why, fail_msg=msg)

    def _fail_msg(self) -> str:
        """The arena's fail_msg, if the dead server left one that says more than a clean stop."""
        a = self._open_arena(announce=False)
        if a is None:
            return ""
        try:
            msg = a.header()["fail_msg"]
        except Error:
            return ""
        return "" if msg in ("", "the server stopped") else msg

    def _exit_reason(self, code: int) -> str:
        if code == ARENA_LOST_EXIT:
            return (f"died of SIGBUS (exit status {code}): its arena file was truncated or replaced, so the "
                    f"arena is lost")
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with {code}"

    def poll(self) -> None:
        """One supervision tick."""
        try:
            self._poll()
        except ArenaLost as e:
            # Truncated while this tick read it (between ArenaWatch's look at the file's size and a read: the
            # watchdog outlives that, psd.arena.recover_from_sigbus): what it read is not the arena. Its server
            # dies of SIGBUS at its next touch, and the next tick restarts it from the last checkpoint.
            log.warning("job %r: %s", self.config.serve.job, e)
            self._drop_arena()

    def _poll(self) -> None:
        if self.state in (ServerState.FAILED, ServerState.STOPPED):
            return
        now = time.monotonic()
        if self._last_poll and now - self._last_poll > self.config.heartbeat_timeout:
            # This watchdog did not run for that long (the machine stalled: a paused VM, swapping, the job's
            # processes stopped), and neither did its server: its heartbeat's age says nothing of a hang until
            # it had --heartbeat-timeout to beat again (after a long checkpoint here, the verdict waits as long)
            self._awake_since = now
        self._last_poll = now
        self._supervise_link()
        if self.state == ServerState.RESTARTING:
            self._respawn()
            return
        alive = self._server_alive()
        if self.proc is not None and self.proc.poll() is not None and self.proc.pid == self.server_pid:
            if self.state == ServerState.STARTING and self.restarts == 0 and self.proc.returncode > 0 and \
                    self.proc.returncode != ARENA_LOST_EXIT:
                self.state = ServerState.FAILED
                self.exit_code = self.proc.returncode
                return
            code = self.proc.returncode
            self._restart(self._exit_reason(code), arena_lost=code == ARENA_LOST_EXIT, killed=code < 0)
            return
        if not alive:
            self._restart("is gone")
            return
        a = self._open_arena()
        if a is None and self._watch.truncated:
            # The file shrank under this watchdog's mapping of its server's arena: lost. The server dies of SIGBUS
            # at its next touch of what is gone, which one that only waits (for a model, or for gradients) may not
            # make for long: restart it now, as for that SIGBUS.
            self._restart("lost its arena (the file was truncated under it)", arena_lost=True)
            return
        late = self.state == ServerState.STARTING and now - self._started_at > self._start_limit
        if a is None:
            if late:
                self._restart(f"has no arena {self._start_limit:.0f} s after its start")
            return
        h = HeaderView(a)  # the fields it needs, each read alone: not the whole header() every poll
        if h.state == _native.ARENA_READY:
            self._ready_seen = True
            self._lineage, self._origin = checkpoint.lineage_in(h)
        if h.state == _native.ARENA_READY and not self._had_model:
            self._had_model = True  # from now on, losing the arena loses trained weights
            log.info("job %r: the job holds its model (%d parameters); a lost arena is restored from the last "
                     "checkpoint in %s, or the job stops", self.config.serve.job, h.n_params,
                     self.config.ckpt_dir)
        fresh = h.server_pid == self.server_pid and 0 <= h.heartbeat_age_s < self.config.heartbeat_timeout
        if self.state == ServerState.STARTING and late and not fresh:
            # Stuck before its first beat (taking a dead server's arena over, or loading): no wait without end
            self._restart(f"has not taken over its arena and beaten {self._start_limit:.0f} s after its start")
            return
        if h.server_pid != self.server_pid:
            return  # not yet attached to its arena
        age = h.heartbeat_age_s
        if self.state == ServerState.STARTING and 0 <= age < self.config.heartbeat_timeout:
            self.state = ServerState.RUNNING
            self.server_policy.healthy(time.monotonic())
            log.info("job %r: server pid %d running (%.2f s after its start)", self.config.serve.job,
                     self.server_pid, time.monotonic() - self._started_at)
            self.events.emit("server_running", server_pid=self.server_pid,
                             start_s=round(time.monotonic() - self._started_at, 3))
        elif self.state == ServerState.RUNNING and age > self.config.heartbeat_timeout and \
                now - self._awake_since > self.config.heartbeat_timeout:
            self._restart(f"has not beaten for {age:.1f} s")
            return
        elif self.state == ServerState.RUNNING and self.server_policy.forgive_due(time.monotonic()):
            log.info("job %r: a server restart forgiven after %g s of healthy running (%d still counted)",
                     self.config.serve.job, self.config.forgive_after, self.server_policy.count)
        if self.checkpoint_requested.is_set() or (
                self.config.checkpoint_every > 0 and time.monotonic() >= self._next_checkpoint):
            self.checkpoint(force=self.checkpoint_requested.is_set())

    # -- the node link (--nnodes > 1) ---------------------------------------------

    def _supervise_link(self) -> None:
        """Start the node link, and restart it (after a back-off) if it died alone."""
        if self.config.serve.nnodes <= 1:
            return
        now = time.monotonic()
        if self.link is not None:
            code = self.link.poll()
            if code is None:
                return
            # A link that ran a while was not crash-looping: its back-off starts over (link_policy).
            self.link_policy.failed(now)
            self._link_restart_at = now + self.link_policy.delay()
            log.warning("job %r: node link pid %d exited with %d; restarting it in %.1f s", self.config.serve.job,
                        self.link.pid, code, self._link_restart_at - now)
            self.events.emit("nodelink_restart", nodelink_pid=self.link.pid, exit=code)
            self.link = None
        if now < self._link_restart_at:
            return
        argv = [sys.executable, "-m", "psd.nodelink", *self.config.serve.argv()]
        if self.config.serve.resume and not self._link_lives:
            # The job resumes: the link's first life takes the agreed state it saved last. A link restarted
            # alone must not: its node's weights moved on since, and it takes the agreed state from a peer.
            argv += ["--resume", self.config.serve.resume]
        if logging.getLogger().level > logging.INFO:
            argv.append("--quiet")
        self.link = subprocess.Popen(argv, env=dict(os.environ, **self.config.extra_env), start_new_session=True)
        self._link_lives += 1
        self.link_policy.started(now)
        log.info("job %r: node %d of %d: node link pid %d", self.config.serve.job, self.config.serve.node_rank,
                 self.config.serve.nnodes, self.link.pid)

    def _stop_link(self) -> None:
        if self.link is not None:
            terminate(self.link, deadline=5.0)  # it clears its hold on the update loop first
            self.link = None

    # -- checkpoints --------------------------------------------------------

    def checkpoint(self, force: bool = False, arena: _native.Arena | None = None) -> Path | None:
        """Write a checkpoint now if the weights changed since the last one (or ``force``).

        ``arena``: snapshot this mapping (at a stop: the server has removed the arena's name already).
        """
        self.checkpoint_requested.clear()
        self._next_checkpoint = time.monotonic() + self.config.checkpoint_every
        s = self.config.serve
        t0 = time.monotonic()
        try:
            a = arena or self._open_arena()
            if a is None or not checkpoint.holds_model(a, self._ready_seen):
                return None
            a.remap()
            if not force and a.clock() == self._last_ckpt_clock:
                return None
            snap = checkpoint.snapshot(a, s.job, {"learners": s.learners, "ring_depth": s.ring_depth, "lr": s.lr})
        except Error as e:  # ArenaLost among them: a truncated arena leaves nothing to write
            log.warning("job %r: checkpoint skipped: %s", s.job, e)
            return None
        path = checkpoint.write(snap, self.config.ckpt_dir, self.config.keep)
        self._last_ckpt_clock = snap.clock
        del snap
        a.note_checkpoint(self._last_ckpt_clock, time.time_ns())
        ms = (time.monotonic() - t0) * 1000
        log.info("job %r: checkpoint %s (clock %d, %.0f ms)", s.job, path, self._last_ckpt_clock, ms)
        self.events.emit("checkpoint", path=str(path), clock=self._last_ckpt_clock, ms=round(ms, 1))
        return path

    # -- life cycle ---------------------------------------------------------

    def run(self, stop: Stop) -> None:
        """Supervise until ``stop`` is set (or the server fails for good)."""
        while not stop.is_set() and self.state != ServerState.FAILED:
            self.poll()
            stop.wait(self.config.serve.poll_interval)

    def stop(self) -> None:
        """Clean stop: stop the server (it applies what is pending and removes the arena's name), then
        write the last checkpoint from our mapping, which outlives the name: nothing pushed before the
        stop is missing from it."""
        if self.state == ServerState.STOPPED:
            return
        failed = self.state == ServerState.FAILED
        a = self._open_arena() if not failed else None
        try:
            if a is not None and a.state == _native.ARENA_READY:
                self._had_model = self._ready_seen = True  # READY since the last poll: the stop's checkpoint is of it
        except ArenaLost:
            a = None  # truncated: nothing to write from it
        self._stop_link()
        try:
            if self.proc is not None and self.proc.pid == self.server_pid:
                terminate(self.proc, deadline=10.0)
            elif self._server_alive():
                terminate(self.server_pid, deadline=10.0)
            if a is not None:
                self.checkpoint(force=True, arena=a)
        finally:
            self._drop_arena()
            self.state = ServerState.STOPPED
            # A server killed before it could clean up leaves its arena: nobody else would remove it.
            # After a failure, though, keep it: it holds what the learners pushed, for a later server.
            if not failed:
                self._remove_dead_arena()

    def _remove_dead_arena(self) -> None:
        try:
            a = open_job(self.config.serve.job)
        except (Error, OSError):
            return
        try:
            dead = not a.server_alive()
        except ArenaLost:
            dead = False  # truncated as it was read: `psd clean` removes it once its server is gone
        finally:
            a.close()
        if dead:
            _native.unlink(shm_name(self.config.serve.job))


def _import_checkpoint_deps() -> None:
    """Import what writing a checkpoint needs, ahead of the first one (a thread of the watchdog)."""
    try:
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401

        import psd.state  # noqa: F401
    except Exception as e:  # the checkpoint itself will raise it, where it can be reported
        log.debug("importing torch ahead of checkpoints failed: %s", e)


def serve_forever(config: WatchdogConfig) -> int:
    """``psd serve``: supervise until SIGINT/SIGTERM; SIGUSR1 asks for a checkpoint."""
    recover_from_sigbus()  # a learner that truncates the arena faults the server, never its watchdog
    stop = SignalFlag()  # set by the handlers: a threading.Event could deadlock there
    wd = Watchdog(config)

    def on_stop(signum, frame):
        stop.set()

    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGTERM, on_stop)
    # A server (or node link) that dies wakes the poll at once, not at its next tick: restarted up to a tick (0.1 s)
    # sooner, which was half of a killed server's time down
    signal.signal(signal.SIGCHLD, lambda s, f: stop.nudge())
    signal.signal(signal.SIGUSR1, lambda s, f: wd.checkpoint_requested.set())
    failed = False
    metrics = None
    try:
        if config.metrics_port:
            from psd.metrics import serve_metrics

            metrics = serve_metrics(config.serve.job, config.metrics_port, config.metrics_host)
        wd.start()
        wd.run(stop)
        failed = wd.state == ServerState.FAILED
    finally:
        wd.stop()
        if metrics is not None:
            metrics.shutdown()
    return wd.exit_code if failed else 0
