"""``psd run``: the launcher, as torchrun is for DDP, but one death restarts one process.

It starts the watchdog (which starts the server) and N learner processes, each
told its job, rank and world size by PSD_JOB, PSD_RANK and PSD_WORLD (and how
often it was restarted by PSD_RESTARTS). A learner that dies is restarted
alone, with capped restarts and back-off; the others never stop. A learner
that restarts attaches with the same rank, and ``resume_step`` tells it how
many of its gradients were already applied, so it goes on where its last life
stopped. A watchdog that dies is restarted and adopts the running server; the
watchdog restarts the server. The launcher exits with the learners' status
when they finish, stops everything on Ctrl-C, and leaves nothing in /dev/shm.

The launcher is a child subreaper (PR_SET_CHILD_SUBREAPER), so a server
orphaned by a killed watchdog becomes its child and is reaped when it dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from psd import _native
from psd.arena import (
    ARENA_LOST_EXIT,
    ArenaWatch,
    Header,
    HeaderView,
    SlotInfo,
    recover_from_sigbus,
    shm_name,
    shm_path,
    wait_for_job,
)
from psd.choices import LEARNER_SCHED_CHOICES
from psd.errors import ArenaLost, Error, JobNotFound
from psd.events import EventLog
from psd.signals import SignalFlag
from psd.watchdog import checkpoint
from psd.watchdog.forkserver import ForkServer, forkable
from psd.watchdog.restarts import Backoff, RestartPolicy
from psd.watchdog.supervisor import GIVE_UP_EXIT, WatchdogConfig, terminate

__all__ = ["Launcher", "WorkerState"]

# A learner's (or virtual worker's) restarts after lives without progress: 0.2 s after the first, doubling to 10 s
LEARNER_BACKOFF = Backoff(0.2, 10.0)
# The watchdog's crash loop: a watchdog that lived over WATCHDOG_FRESH_AFTER seconds starts the count over; more
# than WATCHDOG_RESTARTS in a row and psd run gives up (it restarted one that failed at every start, without end).
WATCHDOG_RESTARTS = 10
WATCHDOG_FRESH_AFTER = 60.0
TICK_S = 0.1  # psd run's look at its processes and the job, when no child's death wakes it sooner
log = logging.getLogger("psd.run")

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# --learner-sched: the policy each learner process runs under. SCHED_BATCH learners do not preempt
# the update loop (SCHED_OTHER) when they wake, and SCHED_IDLE ones run only when it has nothing to do;
# lowering a policy needs no privilege. "normal" is SCHED_OTHER, whatever psd run has.
LEARNER_SCHED = {"normal": os.SCHED_OTHER, "batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}
assert ("auto", *LEARNER_SCHED) == LEARNER_SCHED_CHOICES


def learner_sched_policy(name: str, learners: int, cpus: int | None = None) -> int:
    """The scheduling policy for ``learners`` learner processes under ``--learner-sched name``. ``auto``
    is ``batch`` when the learners alone fill the cores, else ``normal``: measured on 2 cores, batch
    trained the MLP as fast as normal or faster with 2 and 8 learners and let null learners' round trips
    run 1.5x faster with 8, where idle gave the round trips as much but trained 10-25% slower (README)."""
    if name not in LEARNER_SCHED_CHOICES:
        raise Error(f"--learner-sched {name!r}: use one of {', '.join(LEARNER_SCHED_CHOICES)}")
    if name == "auto":
        cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
        name = "batch" if learners >= cpus else "normal"
    return LEARNER_SCHED[name]


def learner_restart_policy(max_restarts: int) -> RestartPolicy:
    """A learner's (or virtual worker's) restart policy under ``psd run --max-restarts``: it counts lives in a row
    without progress (a life that made progress forgives them all, itself included); the ``max_restarts``-th is
    not restarted. A life that made progress is restarted at once (it was killed, not crash-looping: every tenth
    of a second its rank waits is throughput lost); one without waits 0.2 s after the first such life, doubling
    to 10 s."""
    return RestartPolicy(LEARNER_BACKOFF, limit=max_restarts - 1, first_step=1)


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")


def _die_with_launcher() -> None:
    """In a child, before exec: get SIGTERM when the launcher dies, however it dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a virtual worker's process group, as torchrun picks one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerState(enum.Enum):
    """A learner process under ``psd run``.

    RUNNING -> SUCCEEDED  it exited with 0
    RUNNING -> BACKOFF    it died (non-zero exit or a signal) and has restarts left
    BACKOFF -> RUNNING    restarted, once its back-off passed
    RUNNING -> FAILED     it died with no restarts left (given up; the others finish)

    Restarts are capped per learner: ``max_restarts`` lives in a row that made
    no progress. A life makes progress when it gets further through the rank's
    data than every life before it: its reach is the rank's applied total at
    its death if it resumed (skipped what earlier lives had applied:
    ``resume_step``, ``ResumableSampler``; it says so in ``PSD_RESUME_FILE``),
    else what it applied itself (it started its data again). A learner that
    is killed while it trains is not crash-looping, so its count starts over;
    one that fails at the same batch every life is. A life that made progress
    is restarted at once; the back-off (0.2 s, doubling up to 10 s) follows
    lives without it. The rule is each learner's ``RestartPolicy``
    (watchdog/restarts.py), ``learner_restart_policy``.
    """

    RUNNING = "running"
    BACKOFF = "backoff"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen | None = None
    state: WorkerState = WorkerState.RUNNING
    restarts: int = 0
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)  # count: lives in a row that made no progress
    progress_at_start: int = 0
    reach: int = 0  # the furthest any life got through the rank's data (in applied gradients)
    restart_at: float = 0.0
    exit_code: int | None = None


class Launcher:
    """Run a whole job: ``Launcher(watchdog_config, ["python", "train.py"], max_restarts=3).run()``."""

    def __init__(self, config: WatchdogConfig, command: list[str], max_restarts: int = 3,
                 progress_every: float | None = None, learner_threads: int = 0,
                 gpus: list[int] | None = None, pull: str = "copy", learner_sched: str = "auto",
                 fork_server: str = "auto", stages: int = 1) -> None:
        self.config = config
        self.job = config.serve.job
        self.n = config.serve.learners  # learner processes: with stages, virtual workers x stages
        if stages < 1 or self.n % stages:
            raise ValueError(f"{self.n} learner slots do not split into virtual workers of {stages} stages")
        self.stages = stages
        self._vw_ports: dict[int, int] = {}  # virtual worker -> its process group's port, this life
        self.command = command
        self.max_restarts = max_restarts
        # virtual worker -> its restart policy (count: its lives in a row without progress)
        self._vw_policies = {vw: self._policy() for vw in range(self.n // stages)}
        # N learners must not oversubscribe the cores: each gets its share of them, at least one.
        self.learner_threads = learner_threads or max(1, len(os.sched_getaffinity(0)) // self.n)
        self.workers = [Worker(r, restart_policy=self._policy()) for r in range(self.n)]
        self.pull = pull
        self.sched_policy = learner_sched_policy(learner_sched, self.n)
        self.gpus = gpus or []  # rank r gets GPU gpus[r % len(gpus)]: several learners may share one
        if stages > 1 and self.gpus:
            for vw in range(self.n // stages):
                mine = [self.gpus[r % len(self.gpus)] for r in range(vw * stages, (vw + 1) * stages)]
                if len(set(mine)) < stages:
                    raise Error(f"--gpus {','.join(map(str, self.gpus))} puts stages of virtual worker {vw} on one "
                                f"GPU (cuda:{', cuda:'.join(map(str, mine))} for its {stages} stages): a virtual "
                                f"worker's process group runs NCCL between its stages on GPUs, which takes one GPU "
                                f"per stage. Give --gpus at least {stages} different GPUs, or drop --gpus to run "
                                f"the stages on the CPU (gloo)")
        self.watchdog: subprocess.Popen | None = None
        self.watchdog_restarts = 0
        self._gave_up = False  # the watchdog exited GIVE_UP_EXIT: keep the arena at the end
        self._had_model = False  # the job's arena was seen READY (_note_model)
        # The job's lineage and origin, from its READY arena (_note_model): what checkpoint.of_job takes for its own
        self._lineage, self._origin = 0, (0, 0)
        self._found_arena = False  # the job's arena existed before this run started its watchdog
        self._watchdog_policy = RestartPolicy(Backoff(0.1, 10.0), limit=WATCHDOG_RESTARTS, first_step=0,
                                              fresh_after=WATCHDOG_FRESH_AFTER)
        self._watchdog_due: float | None = None  # a dead watchdog's restart, after its back-off
        self._stop = SignalFlag()  # SIGINT/SIGTERM's handler sets it
        self._tty = sys.stderr.isatty()
        self._progress_every = progress_every if progress_every is not None else (1.0 if self._tty else 10.0)
        self._next_progress = 0.0
        self._watch = ArenaWatch(self.job)
        self._last = (time.monotonic(), 0)
        self.events = EventLog(config.serve.event_log, self.job, "run")
        self._run_dir = tempfile.TemporaryDirectory(prefix=f"psd-run-{self.job}-")
        if fork_server not in ("auto", "on", "off"):
            raise ValueError(f"fork_server is auto, on or off, not {fork_server!r}")
        if fork_server == "on" and not forkable(command):
            raise Error(f"psd run --fork-server forks learners from a process of this Python ({sys.executable}) "
                        f"that has imported torch: COMMAND must be `python SCRIPT ...` or `python -m MODULE ...` "
                        f"with that interpreter, not {' '.join(command[:2])!r}; run it "
                        f"as a new process (--fork-server off)")
        use = fork_server == "on" or (fork_server == "auto" and forkable(command))
        self._forks: ForkServer | None = ForkServer() if use else None
        self._forks_ended = 0  # the fork server's children's ends seen by the last tick

    # -- processes ----------------------------------------------------------

    def _watchdog_argv(self) -> list[str]:
        c, s = self.config, self.config.serve
        argv = [sys.executable, "-m", "psd.cli", "serve", *s.argv(), "--checkpoint-dir", str(c.ckpt_dir),
                "--checkpoint-every",
                str(c.checkpoint_every), "--keep", str(c.keep), "--heartbeat-timeout", str(c.heartbeat_timeout),
                "--start-timeout", str(c.start_timeout),
                "--server-restarts", str(c.max_restarts)]
        self._note_model()
        if s.init and not self._had_model:
            # Until the job held a model, every watchdog: one restarted while the job's first weights were still
            # loading (a large file) must load them again, not let the next learner's model become the job's.
            # Once it held one, the arena (taken over) or the last checkpoint is the job's, and the file is not
            # read again (nor needed: it may be gone).
            argv += ["--init", s.init]
        if s.resume is not None or (self.watchdog_restarts and self._had_model):
            # The new watchdog adopts the running server, or restarts it on the surviving arena; only if the
            # arena is gone or never held the weights does the server load a checkpoint: once the job held its
            # model, the newest of its lineage (another run's in the same directory is not the job's), and before,
            # what the job was started from (--resume DIR or FILE: supervisor._resume_source). A job that neither
            # resumed nor held a model starts as it first did (a checkpoint in its directory is an earlier run's,
            # which would win over --init).
            ckpt = None
            if self._had_model and self._lineage:
                ckpt = checkpoint.of_job(c.ckpt_dir, s.resume, self._lineage, self._origin)
            argv += ["--resume", str(ckpt.path if ckpt is not None else (s.resume or c.ckpt_dir))]
        argv += ["--event-log", s.event_log or ""]
        if logging.getLogger().level > logging.INFO:
            argv.append("--quiet")
        return argv

    def _start_watchdog(self) -> None:
        self.watchdog = subprocess.Popen(self._watchdog_argv(), start_new_session=True,
                                         preexec_fn=_die_with_launcher)
        self._watchdog_policy.started(time.monotonic())
        log.info("job %r: watchdog pid %d", self.job, self.watchdog.pid)

    def _watchdog_died(self, code: int) -> float:
        """Count the watchdog's death (exit status ``code``) in its crash loop; the seconds to wait before its
        restart, or raise Error where the loop is too long."""
        how = f"exit {code}" if code >= 0 else signal.Signals(-code).name
        # One killed by a signal once at work (the job's watchdog in its arena's header) was no part of a crash
        # loop of its own: killed from outside (`psd chaos --target watchdog`, an operator), it is restarted at
        # once and the count starts over. One that exits with a status always counts.
        n = self._watchdog_policy.failed(time.monotonic(), progress=code < 0 and self._watchdog_worked())
        if self._watchdog_policy.exhausted:
            raise Error(f"psd run: the watchdog of job {self.job!r} died {n} times in a row, each within "
                        f"{WATCHDOG_FRESH_AFTER:g} s of its start (the last: {how}); its log is above")
        delay = self._watchdog_policy.delay()
        log.warning("job %r: watchdog pid %d died (%s); restarting it%s", self.job, self.watchdog.pid, how,
                    f" in {delay:g} s" if delay else "")
        return delay

    def _watchdog_worked(self) -> bool:
        """Whether the (dead) watchdog had taken up its job: the arena names it as the job's watchdog."""
        a = self._arena_or_none()
        return a is not None and HeaderView(a).watchdog_pid == self.watchdog.pid

    def _restart_watchdog(self) -> None:
        self.watchdog_restarts += 1
        self.events.emit("watchdog_restart", watchdog_pid=self.watchdog.pid)
        self._start_watchdog()

    def _start_worker(self, w: Worker) -> None:
        resumed = self._resume_file(w)
        resumed.unlink(missing_ok=True)
        env = dict(os.environ, PSD_JOB=self.job, PSD_RANK=str(w.rank), PSD_WORLD=str(self.n),
                   PSD_RESUME_FILE=str(resumed),
                   PSD_RESTARTS=str(w.restarts), PSD_LEARNER_THREADS=str(self.learner_threads),
                   OMP_NUM_THREADS=str(self.learner_threads), PYTHONUNBUFFERED="1",
                   PSD_NODE_RANK=str(self.config.serve.node_rank), PSD_NNODES=str(self.config.serve.nnodes),
                   PSD_PULL=self.pull)
        if self.stages > 1:  # a stage of a virtual worker: torchrun's variables for its own process group
            vw, stage = divmod(w.rank, self.stages)
            env.update(PSD_VW=str(vw), PSD_STAGE=str(stage), PSD_STAGES=str(self.stages), RANK=str(stage),
                       LOCAL_RANK=str(stage), WORLD_SIZE=str(self.stages), LOCAL_WORLD_SIZE=str(self.stages),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._vw_ports[vw]))
        if self.gpus:
            env["PSD_DEVICE"] = f"cuda:{self.gpus[w.rank % len(self.gpus)]}"
        if self._forks is not None and self._forks.alive:
            w.proc = self._forks.spawn(self.command, env)  # torch already imported: a restart is a fork
        else:
            w.proc = subprocess.Popen(self.command, env=env, start_new_session=True, preexec_fn=_die_with_launcher)
        # Set from here rather than in the child before exec: a refusal (a sandbox that forbids the call)
        # is then a warning, not a learner that cannot start. The learner's first instructions may run
        # under psd run's own policy; its threads inherit the new one.
        try:
            os.sched_setscheduler(w.proc.pid, self.sched_policy, os.sched_param(0))
        except OSError as e:
            log.warning("job %r: could not set the scheduling policy of learner %d (pid %d): %s", self.job, w.rank,
                        w.proc.pid, e)
        w.state = WorkerState.RUNNING
        w.progress_at_start = self._rank_progress(w.rank)

    def _resume_file(self, w: Worker) -> Path:
        """Where a life of ``w`` notes that it resumed (psd.learner.resume.note_resumed)."""
        return Path(self._run_dir.name) / f"resumed-{w.rank}"

    def _made_progress(self, w: Worker) -> bool:
        """Whether the life that just ended got further through the rank's data than any before it."""
        total = self._rank_progress(w.rank)
        resumed = self._resume_file(w).exists()
        reach = total if resumed else total - w.progress_at_start
        if reach > w.reach:
            w.reach = reach
            return True
        return False

    def _rank_progress(self, rank: int) -> int:
        a = self._arena_or_none()
        if a is None or a.state != _native.ARENA_READY:
            return 0
        ranks = a.ranks()
        return ranks[rank] if rank < len(ranks) else 0

    # -- supervision --------------------------------------------------------

    def _await_arena(self) -> None:
        """Wait for the job's arena and its live server (the first server reads --resume's checkpoints or --init's
        file before it makes the arena), or for a stop. A watchdog killed by a signal meanwhile is restarted, up
        to WATCHDOG_RESTARTS times in a row; one that exits with an error fails the start, as a server that
        cannot start (bad flags, another job's arena) makes its watchdog do."""
        s = self.config.serve
        allowance = self.config.start_timeout + checkpoint.load_allowance(s.resume, s.job) + \
            checkpoint.load_allowance(s.init)
        deadline = time.monotonic() + allowance
        while not self._stop.is_set():
            try:
                wait_for_job(self.job, timeout=min(0.2, max(0.0, deadline - time.monotonic())),
                             server_pid=self.watchdog.pid)
                return
            except JobNotFound:
                pass
            code = self.watchdog.poll()
            if code is None:
                if time.monotonic() > deadline:
                    raise Error(f"psd run: the server of job {self.job!r} did not make its arena within "
                                f"{allowance:g} s; see above")
                continue
            if code >= 0:
                # The arena of an earlier life of the job, which this one could not take over, stays for the
                # server the error above asks for (or `psd clean`); one this start made goes.
                self._gave_up = code == GIVE_UP_EXIT or self._found_arena
                raise Error(f"psd run: the server of job {self.job!r} could not start (its watchdog exited "
                            f"{code}); see above")
            if self._sleep(self._watchdog_died(code)):
                return
            self._restart_watchdog()
            deadline = time.monotonic() + allowance

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` (a back-off), or until a stop; returns whether stopped. A child's death wakes the
        stop flag's wait (a nudge): this one goes on sleeping."""
        end = time.monotonic() + seconds
        while not self._stop.is_set() and (left := end - time.monotonic()) > 0:
            self._stop.wait(left)
        return self._stop.is_set()

    def _tick(self) -> None:
        """Wait for the next look: TICK_S, or less where a child dies (SIGCHLD, or the fork server's message
        that one of its learners did), so that a dead learner is restarted in milliseconds, not a tick."""
        fd = None
        if self._forks is not None:
            self._forks.pump(0.0)  # what came meanwhile: taken, so that the wait below waits
            if self._forks.ended != self._forks_ended:
                # A child's end taken since the last look (here, or by a spawn's wait for its answer, which
                # pumps too): the socket is empty, but that learner waits for the next pass. Look at once.
                self._forks_ended = self._forks.ended
                return
            fd = self._forks.fileno()
        self._stop.wait(TICK_S, also=() if fd is None else (fd,))

    def _note_model(self) -> None:
        """Note whether the job has held its model (its arena seen READY), which a restarted watchdog's flags
        follow."""
        a = self._arena_or_none()
        if a is not None and a.state == _native.ARENA_READY:
            self._had_model = True
            self._lineage, self._origin = checkpoint.lineage_in(HeaderView(a))

    def _supervise_watchdog(self) -> None:
        self._note_model()
        now = time.monotonic()
        if self._watchdog_due is None:
            code = self.watchdog.poll()
            if code is None:
                return
            if code == GIVE_UP_EXIT:
                self._gave_up = True
                raise Error(f"psd run: the watchdog gave up restarting the server of job {self.job!r} (its last "
                            f"error is above); its arena is left for `psd inspect --job {self.job}`")
            if code > 0 and self.watchdog_restarts == 0 and self._arena_or_none() is None:
                raise Error(f"psd run: the server of job {self.job!r} could not start (exit {code}); see above")
            self._watchdog_due = now + self._watchdog_died(code)
        if now < self._watchdog_due:
            return  # its back-off; the learners are supervised meanwhile
        self._watchdog_due = None
        if self._had_model and self._arena_or_none() is None:
            # The arena is gone (or damaged) with the watchdog that would have restored it. The next one, given
            # --resume, would find no checkpoint and start an empty job, whose next learner's model (a restarted
            # learner's first weights) would silently become the job's: as the watchdog itself does, stop and say
            # so (supervisor._respawn).
            c = self.config
            if checkpoint.of_job(c.ckpt_dir, c.serve.resume, self._lineage, self._origin) is None:
                where = " or ".join(map(str, checkpoint.job_sources(c.ckpt_dir, c.serve.resume)))
                raise Error(f"psd run: the arena of job {self.job!r} ({shm_path(self.job)}) was lost with its "
                            f"watchdog, and there is no valid checkpoint of this job in {where} to restore it from: "
                            f"the trained weights are gone. Stopping instead of starting an empty job; start it again "
                            f"with `psd run` (--checkpoint-every keeps checkpoints)")
        self._restart_watchdog()

    def _vw_members(self, vw: int) -> list[Worker]:
        return self.workers[vw * self.stages:(vw + 1) * self.stages]

    def _start_vw(self, vw: int, restart: bool = False) -> None:
        """Start (or restart) every stage of virtual worker ``vw``, on a fresh port: a stage that had finished
        starts again too, since the others need it in their pipeline (it resumes, and pushes nothing its
        earlier lives pushed)."""
        self._vw_ports[vw] = free_port()
        for w in self._vw_members(vw):
            if restart:
                w.restarts += 1
            self._start_worker(w)
        if restart:
            log.warning("job %r: virtual worker %d restarted (stages %s)", self.job, vw,
                        ", ".join(str(w.rank) for w in self._vw_members(vw)))
            self.events.emit("virtual_worker_restart", vw=vw, ranks=[w.rank for w in self._vw_members(vw)])

    def _poll(self, w: Worker) -> str | None:
        """A running learner's exit, if it ended: one that exited 0 is marked SUCCEEDED; one that died
        returns how (its status or signal), for the supervisor to restart or give up on."""
        code = w.proc.poll()
        if code is None:
            return None
        w.exit_code = code
        if code == 0:
            w.state = WorkerState.SUCCEEDED
            vw, stage = divmod(w.rank, self.stages)
            where = f" (virtual worker {vw}, stage {stage})" if self.stages > 1 else ""
            log.info("job %r: learner %d%s finished", self.job, w.rank, where)
            self.events.emit("learner_finished", rank=w.rank)
            return None
        how = f"exit {code}" if code > 0 else signal.Signals(-code).name
        if code == ARENA_LOST_EXIT:
            how += ", SIGBUS: its arena was truncated or replaced"
        return how

    def _policy(self) -> RestartPolicy:
        """A learner's (or virtual worker's) restart policy: ``learner_restart_policy``."""
        return learner_restart_policy(self.max_restarts)

    def _supervise_vws(self) -> None:
        """--stages: a stage that dies takes its virtual worker down (its peers would wait on it in their
        process group), and the whole virtual worker restarts after the back-off; the others go on. Its
        lives count as progress when any stage got further through its data than before."""
        now = time.monotonic()
        for vw in range(self.n // self.stages):
            members = self._vw_members(vw)
            dead = [(w, how) for w in members if w.state == WorkerState.RUNNING and (how := self._poll(w))]
            if dead:
                for w in members:  # the stages still running would wait on the dead one: stop them
                    if w.state == WorkerState.RUNNING and w.proc.poll() is None:
                        w.proc.kill()
                        w.proc.wait()
                progressed = [self._made_progress(w) for w in members]
                policy = self._vw_policies[vw]
                fruitless = policy.failed(progress=any(progressed))
                how = ", ".join(f"stage {w.rank % self.stages} {h}" for w, h in dead)
                for w, h in dead:
                    self.events.emit("learner_died", rank=w.rank, learner_pid=w.proc.pid, exit=h)
                left = members  # the whole virtual worker goes again, stages that had finished too
                if policy.exhausted:
                    for w in left:
                        w.state = WorkerState.FAILED
                        w.exit_code = dead[0][0].exit_code  # the dead stage's status, for psd run's own
                    log.error("job %r: virtual worker %d died %d times in a row without getting further through "
                              "its data (last: %s); giving up on it (ranks %s), the others go on "
                              "(--max-restarts %d)", self.job, vw, fruitless, how,
                              ", ".join(str(w.rank) for w in left), self.max_restarts)
                    for w in left:
                        self.events.emit("learner_failed", rank=w.rank, exit=how)
                    continue
                for w in left:
                    w.state = WorkerState.BACKOFF
                    w.restart_at = now + policy.delay()
                log.warning("job %r: virtual worker %d lost %s; restarting its stages", self.job, vw, how)
            if members and all(w.state != WorkerState.RUNNING for w in members) and any(
                    w.state == WorkerState.BACKOFF and now >= w.restart_at for w in members):
                self._start_vw(vw, restart=True)

    def _supervise_workers(self) -> None:
        if self.stages > 1:
            self._supervise_vws()
            return
        now = time.monotonic()
        died = []
        for w in self.workers:
            if w.state == WorkerState.RUNNING:
                how = self._poll(w)
                if how is None:
                    continue
                fruitless = w.restart_policy.failed(progress=self._made_progress(w))
                if w.restart_policy.exhausted:
                    w.state = WorkerState.FAILED
                    log.error("job %r: learner rank %d (%s) died %d times in a row without getting further "
                              "through its data than before (last: %s); giving up on rank %d, the other learners "
                              "go on (--max-restarts %d)", self.job, w.rank, " ".join(self.command), fruitless,
                              how, w.rank, self.max_restarts)
                    self.events.emit("learner_failed", rank=w.rank, exit=how)
                    continue
                w.state = WorkerState.BACKOFF
                w.restart_at = now + w.restart_policy.delay()
                died.append(f"{w.rank} ({how})")
                self.events.emit("learner_died", rank=w.rank, learner_pid=w.proc.pid, exit=how)
            if w.state == WorkerState.BACKOFF and now >= w.restart_at:  # a life that made progress: at once
                w.restarts += 1
                self._start_worker(w)
                log.warning("job %r: learner %d restarted (restart %d)", self.job, w.rank, w.restarts)
                self.events.emit("learner_restart", rank=w.rank, restart=w.restarts, learner_pid=w.proc.pid)
        if died:
            if not any(w.state == WorkerState.RUNNING for w in self.workers) and \
                    all(w.state != WorkerState.SUCCEEDED for w in self.workers):
                log.warning("job %r: every learner died (%s); restarting them all from the job's weights "
                            "(they are at least as new as the last checkpoint)", self.job, ", ".join(died))
            else:
                log.warning("job %r: learner %s died; restarting it alone", self.job, ", ".join(died))

    def _reap_orphans(self) -> None:
        """Reap adopted processes (a server orphaned by its watchdog) without stealing our children's status."""
        ours = {w.proc.pid for w in self.workers if w.proc is not None}
        ours.add(self.watchdog.pid)
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid in ours:
                return
            os.waitpid(info.si_pid, 0)

    # -- progress -----------------------------------------------------------

    def _arena_or_none(self) -> _native.Arena | None:
        a = self._watch.current()
        held = a is not None and a.state == _native.ARENA_READY  # the job held its model when the stop began
        if held:
            a.remap()
        return a

    def _progress(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now < self._next_progress:
            return
        self._next_progress = now + self._progress_every
        a = self._arena_or_none()
        if a is None or a.state != _native.ARENA_READY:
            return
        h = Header.read(a)  # one snapshot: the rate and the mean staleness from the same applied
        c = a.counters()
        t0, applied0 = self._last
        rate = (h.applied - applied0) / max(now - t0, 1e-9)
        self._last = (now, h.applied)
        losses = [s.last_loss for s in (SlotInfo.read(a, i) for i in range(h.n_slots))
                  if s.state != _native.SLOT_FREE and s.last_loss == s.last_loss]
        alive = sum(w.state == WorkerState.RUNNING for w in self.workers)
        done = sum(w.state == WorkerState.SUCCEEDED for w in self.workers)
        restarts = sum(w.restarts for w in self.workers)
        line = (f"psd run {self.job}: clock {c['clock']}  {rate:,.0f} grad/s  "
                f"loss {f'{sum(losses) / len(losses):.4f}' if losses else '-'}  "
                f"staleness {h.staleness_sum / h.applied if h.applied else 0:.1f}  "
                f"learners {alive} running, {done} done  restarts {restarts} (server {h.server_restarts})")
        if self._tty and not final:
            sys.stderr.write("\r\x1b[K" + line)
        else:
            sys.stderr.write(("\r\x1b[K" if self._tty else "") + line + "\n")
        sys.stderr.flush()

    # -- the whole run ------------------------------------------------------

    def run(self) -> int:
        """Run the job to the end; returns the exit status for the shell."""
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        recover_from_sigbus()  # a learner that truncates the arena faults the server, never the run
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, f: self._stop.set())
        signal.signal(signal.SIGCHLD, lambda s, f: self._stop.nudge())  # a learner or the watchdog died: look now
        interrupted = False
        self._found_arena = os.path.exists(shm_path(self.job))  # an earlier life's, left by a dead server
        try:
            self._start_watchdog()
            self._await_arena()
            if self._stop.is_set():
                return 130  # stopped (Ctrl-C, SIGTERM) while the job started: the finally below stops the watchdog
            if self._forks is not None:
                self._forks.start(dict(os.environ, OMP_NUM_THREADS=str(self.learner_threads),
                                       PSD_LEARNER_THREADS=str(self.learner_threads), PYTHONUNBUFFERED="1"))
            if self.stages > 1:
                for vw in range(self.n // self.stages):
                    self._start_vw(vw)
            else:
                for w in self.workers:
                    self._start_worker(w)
            log.info("job %r: %d learners started%s: %s", self.job, self.n,
                     " by the fork server" if self._forks is not None else "", " ".join(self.command))
            while not self._stop.is_set():
                try:
                    self._supervise_watchdog()
                    self._supervise_workers()
                    self._reap_orphans()
                    self._progress()
                except ArenaLost as e:
                    # Truncated while read: the server dies of SIGBUS, its watchdog restarts it, and the next
                    # look maps the new arena. What this tick did not finish, the next one does.
                    log.warning("job %r: %s", self.job, e)
                    self._watch.close()
                if all(w.state in (WorkerState.SUCCEEDED, WorkerState.FAILED) for w in self.workers):
                    break
                self._tick()
            interrupted = self._stop.is_set()
            with contextlib.suppress(ArenaLost):  # truncated at the end: the last line is not worth the run
                self._progress(final=True)
        finally:
            self._shutdown()
            self._run_dir.cleanup()
        if interrupted:
            return 130
        failed = [w for w in self.workers if w.state != WorkerState.SUCCEEDED]
        if failed:
            log.error("job %r: learner rank(s) %s gave up; the other learners finished", self.job,
                      ", ".join(str(w.rank) for w in failed))
            code = failed[0].exit_code
            return code if code and code > 0 else 1
        return 0

    def _shutdown(self) -> None:
        """Stop learners, then the watchdog (it applies what is pending, writes a last checkpoint and
        removes the arena). If the watchdog is dead or dies meanwhile, do its part here."""
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            if w.proc is not None:
                terminate(w.proc, deadline=10.0)
        if self._forks is not None:
            self._forks.close()
        a = self._watch.release()  # our mapping outlives the arena's name
        try:
            held = a is not None and a.state == _native.ARENA_READY  # the job held its model when the stop began
            if held:
                a.remap()
            allowance = checkpoint.write_allowance(HeaderView(a)) if held else 0.0
        except ArenaLost as e:  # truncated as the stop began: nothing in it to keep
            log.warning("job %r: %s", self.job, e)
            held, allowance = False, 0.0
        clean = False
        if self.watchdog is not None:
            # It writes the last checkpoint after the server stopped: that write at the slowest rate allowed for
            terminate(self.watchdog, deadline=60.0 + allowance)
            clean = self.watchdog.returncode == 0
        self._reap_orphans()
        if a is None:
            return
        try:
            h = HeaderView(a)
            server, start, n_params = h.server_pid, h.server_start_time, h.n_params  # before the server stops
            if _native.owner_alive(server, start):
                terminate(server, deadline=10.0)  # it applies what is pending, then stops
            if not clean and n_params and checkpoint.holds_model(a, held):
                snap = checkpoint.snapshot(a, self.job, {"learners": self.n})
                path = checkpoint.write(snap, self.config.ckpt_dir, self.config.keep)
                del snap
                log.warning("job %r: the watchdog died during the stop; wrote the last checkpoint %s", self.job, path)
        except ArenaLost as e:  # truncated during the stop: no last checkpoint from it; the last written stays
            log.warning("job %r: %s", self.job, e)
        finally:
            ident = a.identity()
            a.close()
        try:
            st = os.stat("/dev/shm" + shm_name(self.job))
            if (st.st_dev, st.st_ino) == ident and not self._gave_up:
                _native.unlink(shm_name(self.job))
        except FileNotFoundError:
            pass
