"""Attaching a learner: bring the job to READY with this model (or wait for the job's, a partial attach), check
what the job runs, claim a slot, come back after the server dies, and unmap.

``Connection`` is the part of :class:`psd.learner.Learner` that does it; the learner's state (its slot, its
claim token, its mapping) stays on the learner, which every part of a step reads.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from psd import _native
from psd.arena import (
    SET_BUFFER_DTYPES,
    ArenaWatch,
    ParamSpec,
    arena_spec,
    encode_spec,
    first_difference,
    model_sizes,
    open_job,
    shm_path,
)
from psd.choices import ASYNC_MOMENTUM, OPTIMIZERS
from psd.errors import (
    Error,
    Evicted,
    JobNotFound,
    NoFreeSlot,
    OutOfSharedMemory,
    ServerGone,
    SpecError,
    StateError,
    Timeout,
)
from psd.learner.resume import life_start, note_resumed
from psd.state import buffers_view, model_spec, torch_dtype, weights_view

__all__ = ["Connection"]

log = logging.getLogger("psd.learner")


class _Replaced(Exception):
    """The job's file no longer holds the arena a learner waits on (a new server started over on a new one)."""


def _check_held(arena: _native.Arena, job: str) -> None:
    """Raise _Replaced where the job's file is gone or holds another arena than ``arena``: a server that starts
    over from --init or a checkpoint unlinks a dead server's arena that never held the job's weights and makes
    a new one (psd/server.py ``Server.start``); the old mapping never becomes READY."""
    try:
        st = os.stat(shm_path(job))
    except FileNotFoundError:
        raise _Replaced from None
    if (st.st_dev, st.st_ino) != arena.identity():
        raise _Replaced


def _wait_ready(arena: _native.Arena, job: str, spec: list[ParamSpec], params: list, buffers: list,
                deadline: _Deadline, timeout: float) -> None:
    """Bring the arena to READY: offer our spec if it has none, and if ours is taken, write our weights."""
    me = os.getpid()
    while True:
        st = arena.state
        if st == _native.ARENA_READY:
            return
        if st == _native.ARENA_STOPPED:
            raise Error(f"job {job!r} is stopping; start its server again with `psd serve --job {job}`")
        if st == _native.ARENA_WAITING_SPEC:
            data, digest = encode_spec(spec)
            if arena.set_spec(data, digest, model_sizes(spec), me, _native.proc_start_time(me)):
                while arena.state == _native.ARENA_SPEC_OFFERED and not deadline.expired():
                    _check_held(arena, job)  # the server that takes the offer may be another's, on a new arena
                    arena.wait_state(_native.ARENA_SPEC_OFFERED, min(deadline.left(), 0.5))
                if arena.state == _native.ARENA_WAITING_SPEC:
                    msg = arena.header()["fail_msg"]
                    raise (OutOfSharedMemory if "shared memory" in msg else SpecError)(
                        f"job {job!r} refused this model: {msg}")
                continue
        elif st == _native.ARENA_INIT_WEIGHTS and arena.header()["offer_pid"] == me:
            _check_held(arena, job)  # not the weights of an arena a new server has replaced
            arena.remap()
            h = arena.header()
            arena.offer_window(True)  # the weights, the buffers and the state: writable only meanwhile
            try:
                w, b = weights_view(arena, h), buffers_view(arena, h)
                w.copy_(torch.cat([p.detach().reshape(-1).float() for p in params]))  # the model may be on a GPU
                if buffers:
                    b.copy_(torch.cat([t.detach().reshape(-1).double() for t in buffers]))
                del w, b
                arena.set_state(_native.ARENA_READY)
            finally:
                arena.offer_window(False)
            return
        if deadline.expired():
            raise Timeout(f"job {job!r} did not become ready within {timeout:g} s (state {st}); "
                          f"is its server running? (`psd status --job {job}`)")
        _check_held(arena, job)
        arena.wait_state(st, min(deadline.left(), 0.5))


class _Deadline:
    def __init__(self, seconds: float) -> None:
        import time

        self._clock = time.monotonic
        self._end = self._clock() + seconds

    def left(self) -> float:
        return max(0.0, self._end - self._clock())

    def expired(self) -> bool:
        return self.left() <= 0


def _by_name(p: ParamSpec) -> str:
    return p.name


class Connection:
    """How a learner attaches, claims, reconnects and unmaps. A part of
    :class:`psd.learner.Learner` (one of its base classes); what it reads and writes lives on the learner.
    Its mapping is watched by ``_watch`` (psd.arena.ArenaWatch, the learner's own, made by ``Learner``):
    ``_connect`` adopts the mapping it opened, ``_unmap`` drops it, and ``_await_server`` looks there whether
    the job's file still holds it, holds none, or holds a new arena; ``_watch.arena`` is None while this
    learner maps none (lost with its arena, or closed)."""

    # Whether this kind of learner pulls right after its push whatever the job's --overlap (a learner on a
    # GPU: its copies run beside the device's work).
    HAND_OFF = False

    _watch: ArenaWatch

    def _check_sparse(self, arena: _native.Arena) -> None:
        if not self._sparse:
            return
        t, h = arena.training(), arena.header()
        if t["optimizer"] not in ("sgd", "momentum", "nesterov", "adagrad") or h["weight_decay"]:
            names = ", ".join(repr(self._spec[k].name) for k in self._sparse)
            raise SpecError(f"job {self.job!r} trains with --optimizer {t['optimizer']}"
                            f"{' and weight decay' if h['weight_decay'] else ''}, which does not take the sparse "
                            f"gradients of {names} (nn.Embedding(sparse=True)); serve the job with --optimizer sgd, "
                            f"momentum, nesterov or adagrad and no --weight-decay (as torch.optim), or make the "
                            f"embedding dense")

    def _check_pull(self, arena: _native.Arena) -> None:
        if self.pull_mode == "view" and arena.header()["cfg_flags"] & _native.CFG_PREDICT:
            raise SpecError(f"job {self.job!r} runs with --predict, which extrapolates a private copy of the "
                            f"weights; {self._pull_source} trains on the shared weights themselves: pull a copy "
                            f"(pull='copy', PSD_PULL=copy, psd run --pull copy), or serve the job without --predict")

    def _connect(self, slot_timeout: float) -> None:
        """Open the job's arena, bring it to READY, claim a slot, map the ring, pull the weights."""
        arena = self._open_ready()
        try:
            if self.partial:
                arena.remap()
                self._layout(self._partial_state(arena_spec(arena)))
            arena.remap()
            theirs = arena_spec(arena)
            if self._spec != theirs and sorted(self._spec, key=_by_name) == sorted(theirs, key=_by_name):
                # The same tensors in another order (a job started from a file that lists them by name,
                # as safetensors does): tensors are matched by name, so lay this learner out in the job's.
                self._layout(model_spec(self.model, order=[p.name for p in theirs]))
            mismatch = first_difference(self.job, self._spec, theirs)
            if mismatch:
                raise mismatch
            self._check_sparse(arena)
            self._check_pull(arena)
            if self.partial and self._buf_range is not None:
                arena.set_push_buffers(*self._buf_range)
            self._arena = arena
            self._claim(slot_timeout)
        except BaseException:
            arena.close()
            raise
        self._watch.adopt(arena)  # this life's arena: what _await_server compares the job's file with
        h = arena.header()
        self.sync = arena.training()["sync"]
        self.push_every = h["push_every"]
        # Where this life goes on (in mini-batches: each applied push was a wave of them): the rank's
        # progress when this process first attached, not what a reconnect finds this life added.
        if self.rank >= 0:
            applied, every = life_start(self.job, self.rank, lambda: (self._rank_progress(), self.push_every))
            self._resume_step = applied * every
        else:
            self._resume_step = 0
        self.predict = bool(h["cfg_flags"] & _native.CFG_PREDICT)
        # --overlap off (and auto, any optimizer) an asp / ssp
        # learner takes newer weights only once the server applied its push: its next gradient always
        # holds its last one. kasync applies a gradient only with K others (a learner waiting for its
        # own could wait for itself), bsp waits for the round already. A learner on a GPU keeps the
        # hand-off (HAND_OFF).
        self.waits_for_own = h["learners_wait_for_their_own"] and not self.HAND_OFF  # psd_layout.h decides
        # Sharpness is measured (with a closure) only where the server uses it: momentum under
        # --async-momentum auto (psd/gain.py).
        self.measures_sharpness = (OPTIMIZERS[h["optimizer"]] in ("momentum", "nesterov") and h["momentum"] > 0
                                   and ASYNC_MOMENTUM[h["async_momentum"]] == "auto")
        # --grad-dtype bf16: dense gradients go into the ring as bfloat16 (the server widens them).
        self._store = _native.DTYPE_BF16 if h["cfg_flags"] & _native.CFG_GRAD_BF16 else _native.DTYPE_F32
        self._wave = 0
        self._wave_loss = 0.0
        self._wave_batch = 0
        self._acc = None  # --push-every: the wave's summed gradients (dense, then sparse ones by piece)
        self._acc_sparse: dict[int, torch.Tensor] = {}
        self._map_buffers()

    def _open_ready(self) -> _native.Arena:
        """The job's arena, brought to READY with this model (a partial attach: once the job's model is
        declared), within the attach's timeout. A learner waiting on an arena its file no longer holds (a new
        server started over on a new one) follows the file to the new arena; one whose arena is marked STOPPED
        meanwhile (a stop unlinks a weightless arena first) is told the job stopped."""
        deadline = _Deadline(self.timeout)
        left = None  # the mapping the file no longer holds, kept until the file holds another
        try:
            while True:
                try:
                    arena = open_job(self.job, role="learner")
                except JobNotFound:
                    if left is None:
                        raise
                    if left.state == _native.ARENA_STOPPED:
                        raise Error(f"job {self.job!r} is stopping; start its server again with "
                                    f"`psd serve --job {self.job}`") from None
                    if deadline.expired():
                        raise Timeout(f"job {self.job!r}: its arena was removed while this learner waited for it "
                                      f"to become ready, and no new one came within {self.timeout:g} s; is its "
                                      f"server running? (`psd status --job {self.job}`)") from None
                    time.sleep(0.01)  # the new server unlinks, then creates: milliseconds
                    continue
                if left is not None:
                    left.close()
                    left = None
                try:
                    if self.partial:
                        self._await_model(arena, deadline)
                    elif arena.state != _native.ARENA_READY:
                        buffers = [self._bcur[lo:hi] for lo, hi, _ in self._bgroups]
                        _wait_ready(arena, self.job, self._spec, self._params, buffers, deadline, self.timeout)
                    return arena
                except _Replaced:
                    left = arena
                    log.info("job %r: the arena this learner waited on was replaced (a new server); attaching to "
                             "the new one", self.job)
                except BaseException:
                    arena.close()
                    raise
        finally:
            if left is not None:
                left.close()

    def _await_model(self, arena: _native.Arena, deadline: _Deadline) -> None:
        """A partial attach: wait for the job's model to be declared (it never offers one itself)."""
        while (state := arena.state) != _native.ARENA_READY:
            if state == _native.ARENA_STOPPED:
                raise Error(f"job {self.job!r} was stopped; start it again (`psd serve --job {self.job} --resume`) "
                            f"before attaching a stage to it")
            if deadline.expired():
                raise Timeout(f"job {self.job!r} has no model yet (state {state}) after {self.timeout:g} s: a "
                              f"partial attach takes part of the job's model, which a full attach "
                              f"(psd.learner.attach(model)), `psd serve --init` or `--resume` declares first")
            _check_held(arena, self.job)
            arena.wait_state(state, min(deadline.left(), 0.1))  # until the state moves on

    def _partial_state(self, theirs: list[ParamSpec]) -> tuple:
        """The layout state (``model_spec``'s form) of a partial attach: the job's spec, with this module's
        tensors where it holds them (matched by full name, shape, dtype and kind) and empty stand-ins for
        the rest, which this learner never copies in and never pushes a gradient for."""
        spec_m, params_m, owners_m = self._mine
        mine = {p.name: (p, t) for p, t in zip(spec_m, params_m, strict=False)}
        my_buffers = dict(zip((p.name for p in spec_m if p.kind == "buffer"), owners_m, strict=True))
        job = {p.name: p for p in theirs}
        for p in spec_m:
            q = job.get(p.name)
            if q is None:
                raise SpecError(f"{p.name!r} {list(p.shape)} {p.dtype} of this module is not in job {self.job!r}'s "
                                f"model; a partial attach takes a module whose parameters are some of the job's, "
                                f"by their full names (build the whole model and delete the layers other stages "
                                f"hold, as torch.distributed.pipelining's manual split does)")
            if (q.shape, q.dtype, q.kind) != (p.shape, p.dtype, p.kind):
                raise SpecError(f"{p.name!r} is {list(p.shape)} {p.dtype} ({p.kind}) in this module but "
                                f"{list(q.shape)} {q.dtype} ({q.kind}) in job {self.job!r}'s model")
        params, owners, present = [], [], []
        boff, mine_set, where = 0, [], {}  # mine_set: where this module's real-valued buffers lie among the job's
        for q in theirs:
            if q.kind == "buffer":
                where[q.name] = boff
                if q.name in my_buffers:
                    owners.append(my_buffers[q.name])
                    if q.dtype in SET_BUFFER_DTYPES:
                        mine_set.append((boff, boff + q.numel, q.name))
                else:  # the job's other buffers: a stand-in holds each (its counters never move, its
                    holder = torch.nn.Module()  # values are never taken: outside the pushed range)
                    holder.register_buffer("b", torch.zeros(q.shape, dtype=torch_dtype(q.dtype)))
                    owners.append((holder, "b"))
                boff += q.numel
                continue
            held = mine.get(q.name)
            present.append(held is not None)
            if held is not None:
                params.append(held[1])
            else:  # no memory: a view of one element, re-pointed at the weights buffer like the others
                params.append(torch.nn.Parameter(torch.zeros((), dtype=torch_dtype(q.dtype)).expand(q.shape),
                                                 requires_grad=q.kind != "frozen"))
        self._present = present
        self._buf_range = None
        if my_buffers:  # its real-valued buffers must be one run of the job's, which its pushes set
            lo, hi = (min(a for a, _, _ in mine_set), max(b for _, b, _ in mine_set)) if mine_set else (0, 0)
            if sum(b - a for a, b, _ in mine_set) != hi - lo:
                others = [q.name for q in theirs if q.kind == "buffer" and q.dtype in SET_BUFFER_DTYPES
                          and q.name not in my_buffers and lo <= where[q.name] < hi]
                names = ", ".join(repr(n) for *_, n in mine_set)
                raise SpecError(f"this module's real-valued buffers ({names}) are not one run of job {self.job!r}'s: "
                                f"{others[0]!r} of another stage lies between them (the job lists its buffers "
                                f"by dtype, then in model order, so a stage whose layers are consecutive but "
                                f"whose buffers have several dtypes can be split too). Hold consecutive layers "
                                f"whose real-valued buffers share a dtype, or make the others non-persistent "
                                f"(register_buffer(..., persistent=False))")
            self._buf_range = (lo, hi)
        return theirs, params, owners

    @property
    def resume_step(self) -> int:
        """How many of this rank's mini-batches the job had applied before this process attached: a
        restarted learner (``psd run``) skips that many to go on without replaying any. 0 without a
        rank. Reading it tells ``psd run`` that this life resumes (its crash-loop rule then counts
        the rank's applied total as this life's progress)."""
        if self._resume_step:
            note_resumed()
        return self._resume_step

    def _claim(self, slot_timeout: float) -> None:
        """Ask the server for a slot (a request its update loop answers), waiting up to ``slot_timeout``
        for one to be free and up to ``timeout`` for a server that is restarting to answer."""
        me = os.getpid()
        deadline = _Deadline(slot_timeout)
        answer = _Deadline(max(self.timeout, slot_timeout))
        while True:
            try:
                self.slot, self._claim_token = self._arena.claim(
                    me, _native.proc_start_time(me), self.rank, max(0.05, min(answer.left(), 5.0)))
                break
            except NoFreeSlot:
                # A restarted learner (psd run restarts one at once) may ask before its last life's slot is
                # free: that slot is its rank's, freed within milliseconds of that life's end, and a DRAINING
                # slot is free once its ring is applied. It waits for such a slot up to its timeout, whatever
                # slot_timeout says (the wait for a slot held by a live learner).
                if deadline.expired() and not (answer.left() > 0 and self._slot_coming_free()):
                    h = self._arena.header()
                    pids = [self._arena.slot_info(i)["pid"] for i in range(h["n_slots"])]
                    mine = (f"; rank {self.rank}'s own slot is still held after {max(self.timeout, slot_timeout):g} s "
                            f"(another learner of rank {self.rank}? give each learner its own rank, PSD_RANK)"
                            if self._predecessor_holds_a_slot() else "")
                    raise NoFreeSlot(
                        f"job {self.job!r} has {h['n_slots']} learner slot(s) and all are in use "
                        f"(pids {', '.join(map(str, pids))}){mine}: start its server with more --learners, "
                        f"or pass slot_timeout= to wait for a slot"
                    ) from None
                # Slots free without a signal of their own: recheck every 20 ms (or when the arena's state
                # changes, e.g. the server stops). A restarted learner waits here for its last life's slot,
                # which the server frees within milliseconds of that life's end.
                self._arena.wait_state(_native.ARENA_READY, min(deadline.left(), 0.02))
            except Evicted:
                raise Evicted(f"job {self.job!r} evicted this process (pid {me}) earlier: something in it wrote "
                              f"into its slot what no learner writes (a stray pointer, a wrong tensor view); "
                              f"`psd status --job {self.job}` shows the rule it broke. Fix that and start a new "
                              f"process: this one gets no slot again") from None
            except (ServerGone, Timeout) as e:
                # Nobody answered: the server is restarting, or its loop is not running yet.
                if answer.expired() or self._arena.state == _native.ARENA_STOPPED:
                    raise ServerGone(f"job {self.job!r}: no server answered the claim of a learner slot "
                                     f"within {max(self.timeout, slot_timeout):g} s ({e}); check it with "
                                     f"`psd status --job {self.job}`") from None
                time.sleep(0.05)
            except StateError:
                raise Error(f"job {self.job!r} is not accepting learners (state {self._arena.state})") from None
            except OSError as e:  # refused: the server found no such live process, or a rank out of range
                raise Error(f"job {self.job!r}: the server refused this process (pid {me}, rank {self.rank}) a "
                            f"learner slot: {e.strerror or e}. If this process runs in another PID namespace than "
                            f"the server, start the server with --liveness lease; see `psd doctor --job "
                            f"{self.job}`") from None

    def _slot_coming_free(self) -> bool:
        """Whether a slot is FREE now (freed since the claim looked: ask again) or on its way: DRAINING (its
        owner gone or released, its ring being applied), or held for this learner's rank by an earlier life of
        it that the server has not yet found dead (the server's records)."""
        a = self._arena
        for i in range(a.header()["n_slots"]):
            s = a.slot_info(i)
            # a FREE slot's rank is -1: a rank's slot counts here only while held
            if s["state"] in (_native.SLOT_FREE, _native.SLOT_DRAINING) or (self.rank >= 0 and s["rank"] == self.rank):
                return True
        return False

    def _predecessor_holds_a_slot(self, mine: int | None = None) -> bool:
        """Whether a slot other than ``mine`` (this learner's, once it holds one) is held for its rank (the
        server's record: an earlier life of this rank still attached, or draining since it died)."""
        if self.rank < 0:
            return False
        a = self._arena
        for i in range(a.header()["n_slots"]):
            s = a.slot_info(i)
            if i != mine and s["rank"] == self.rank and s["state"] != _native.SLOT_FREE:
                return True
        return False

    def _rank_progress(self) -> int:
        """Gradients this rank had applied before this attach (0 without a rank).

        A restarted learner's earlier incarnation may still be draining; its
        gradients count once they are applied, so wait for that first.
        """
        if self.rank < 0:
            return 0
        a = self._arena
        deadline = _Deadline(self.timeout)
        while self._predecessor_holds_a_slot(self.slot):
            if deadline.expired():
                raise Timeout(f"job {self.job!r}: another learner with rank {self.rank} is still attached; "
                              f"give each learner its own rank (PSD_RANK)")
            a.wait_state(_native.ARENA_READY, 0.02)  # a slot frees without a signal of its own
        ranks = a.ranks()
        return ranks[self.rank] if self.rank < len(ranks) else 0

    def _unmap(self) -> None:
        """Drop every tensor over the arena, stop the pull thread, unmap."""
        if self._stepper is not None:
            self._push_ns = self._stepper.push_ns
            self._stepper.close()
            self._stepper = None
        self._steps_view = self._steps_arena = None  # a view of the arena's piece table (_own_share)
        for p in self._params:
            p.grad = None
        if self._pull is not None:
            self._pull.unmap()  # stops the pull thread; a view learner's model goes on private memory
            self._pull = None
        self._weights = self._entries = self._arena_buffers = None
        # Unmapped, and forgotten by the watch; a tensor the user still holds over the arena (ArenaBusy) keeps
        # the mapping until it goes.
        self._watch.close()

    def _await_server(self, cause: Error) -> None:
        """The server died: wait for its successor, on this arena or (after a loss) on a new one."""
        log.warning("job %r: %s; waiting up to %g s for the server to come back", self.job, cause,
                    self.reconnect_timeout)
        deadline = _Deadline(self.reconnect_timeout)
        watch = self._watch
        while not deadline.expired():
            seen = watch.look()  # the arena this learner maps, none, or a new one
            mapped = watch.arena is not None
            if mapped and self._arena.state == _native.ARENA_STOPPED:
                raise ServerGone(f"job {self.job!r} was stopped (`psd stop` or Ctrl-C on its server); "
                                 f"start it again to go on: `psd serve --job {self.job} --resume`") from cause
            if seen == "same":
                if self._arena.server_alive():
                    log.warning("job %r: server is back (generation %d)", self.job, self._arena.generation())
                    self.reconnects += 1
                    return
            elif seen == "new":  # the arena was lost; a server started over from a checkpoint
                if mapped:
                    self._unmap()
                try:
                    self._connect(slot_timeout=self.timeout)
                except Error as e:
                    log.warning("job %r: cannot attach to the new arena yet: %s", self.job, e)
                else:
                    log.warning("job %r: attached to the restarted job (clock %d)", self.job, self.clock)
                    self.reconnects += 1
                    return
            # Nothing in shared memory announces a new server: recheck every 50 ms.
            time.sleep(0.05)
        raise ServerGone(f"the server of job {self.job!r} did not come back within {self.reconnect_timeout:g} s "
                         f"({cause}); check its watchdog (`psd status --job {self.job}`) or restart it with "
                         f"`psd serve --job {self.job} --resume`") from cause

    def _with_server(self, call, *args):
        """Run an arena wait; if the server dies meanwhile, wait for it to come back and retry."""
        while True:
            try:
                return call(*args)
            except ServerGone as e:
                before = self._watch.arena
                self._await_server(e)
                if self._watch.arena is not before:
                    return None  # a new arena: the old ring and what was in it are gone

    def _wait_sync(self, call, what: str, *args) -> None:
        """A bsp round or the ssp bound (``call``, one of the arena's sync waits, taking ``args`` and a timeout):
        it waits for the slowest peer as long as that one lives. Each wait of ``timeout`` that ends with this
        learner's arena and its server alive is logged and waited again, since a peer may be evaluating, saving
        or restarting for minutes; a dead peer is reaped by the server and waited for no longer, and a server
        gone is waited for by ``_with_server``. A server that has not beaten for ``timeout`` ends it with the
        Timeout."""
        a = self._arena
        waited = 0.0
        while True:
            try:
                self._with_server(call, *args, self.timeout)
                return
            except Timeout:
                # A server that has not beaten for the timeout is hung (its watchdog would have replaced it by
                # then): that is no slow peer
                if self._arena is not a or not a.server_alive(self.timeout):
                    raise
                waited += self.timeout
                who = f"rank {self.rank}" if self.rank >= 0 else f"slot {self.slot}"
                log.warning("job %r, %s: waited %.0f s for %s; a peer is slower (evaluating, saving or "
                            "restarting?); waiting on", self.job, who, waited, what)

    def wait_for_peers(self, n: int, timeout: float | None = None) -> None:
        """Wait until ``n`` learners (this one included) are attached, or training has started.

        A start line for learners launched together: under ``bsp`` call it before the first step,
        so that the first round already waits for everyone (``attach`` does it for you when
        ``psd run`` set PSD_WORLD). Once any learner pushed a gradient it returns at once, so a
        learner that joins or restarts later never waits for peers that finished.
        """
        a = self._arena
        deadline = _Deadline(self.timeout if timeout is None else timeout)
        while True:
            c = a.counters()
            active = c["active_learners"]
            if active >= n or c["pushed"] > 0:
                return
            if deadline.expired():
                raise Timeout(f"job {self.job!r}: {active} of {n} learners attached after "
                              f"{self.timeout if timeout is None else timeout:g} s; are the others running?")
            a.wait_state(_native.ARENA_READY, min(deadline.left(), 0.05))  # claims signal nothing
