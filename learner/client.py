"""The learner client: attach a PyTorch model to a psd job and train through it.

A learner claims one slot of the job's arena. ``step()`` copies the
mini-batch's gradients (``p.grad``, in the model's dtype; sparse embedding
gradients as their rows) into the next free entry of the slot's ring in one C
pass that converts and checks them, with how far the model's buffers (BatchNorm
statistics) moved since they were last pulled, then store-releases the ring's
tail. Weights come back through a pull thread that copies the shared weights
into a second private buffer whenever the server's clock has moved; ``step()``
swaps that buffer in by re-pointing the parameters, so a forward pass never sees
weights change under it, and takes the job's merged buffers with it. Both
hand-offs are queues of one, as in GaDei.

With ``pull="view"`` there is no pull at all: the parameters are read-only views
of the shared weights themselves, as in torch's Hogwild example, so the model
always computes on the newest weights, and a forward pass may see an update land
halfway through it.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import struct
import time
from collections.abc import Callable
from typing import Any

import torch

from psd import _native
from psd.arena import (
    SET_BUFFER_DTYPES,
    ParamSpec,
    arena_spec,
    buffers_set,
    default_job,
    encode_spec,
    first_difference,
    model_sizes,
    open_job,
    piece_geometry,
    shm_path,
)
from psd.choices import ASYNC_MOMENTUM, OPTIMIZERS, PULL_MODES
from psd.errors import (
    ArenaBusy,
    Error,
    Evicted,
    NoFreeSlot,
    OutOfSharedMemory,
    ServerGone,
    SlotLost,
    SpecError,
    StateError,
    Timeout,
)
from psd.learner.pull import InlinePull, Pull, ThreadPull, ViewPull
from psd.learner.resume import _env_rank, life_start, note_resumed
from psd.learner.sharpness import SharpnessProbe
from psd.state import (
    PARAM_DTYPES,
    buffer_groups,
    buffers_view,
    model_spec,
    pieces_view,
    split,
    state_dict_of,
    torch_dtype,
    weights_view,
)

__all__ = ["Learner", "pull_state_dict"]

log = logging.getLogger("psd.learner")

# Models up to this size pull between steps, in the training thread; larger ones in a native thread,
# where a core is left for it (pull_thread_has_a_core).
INLINE_PULL_BYTES = 256 * 1024
# Weight prediction extrapolates by the median staleness of this many recent gradients.
STALENESS_WINDOW = 64


def _sparse_tensors(model: torch.nn.Module, train: list[torch.Tensor]) -> list[int]:
    """Indices (among the trainable tensors) of embedding tables that get sparse gradients."""
    sparse = {id(m.weight) for m in model.modules()
              if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse}
    return [k for k, p in enumerate(train) if id(p) in sparse]


def _wait_ready(arena: _native.Arena, job: str, spec: list[ParamSpec], params: list, buffers: list,
                timeout: float) -> None:
    """Bring the arena to READY: offer our spec if it has none, and if ours is taken, write our weights."""
    me = os.getpid()
    deadline = _Deadline(timeout)
    while True:
        st = arena.state
        if st == _native.ARENA_READY:
            return
        if st == _native.ARENA_STOPPED:
            raise Error(f"job {job!r} is stopping; start its server again with `psd serve --job {job}`")
        if st == _native.ARENA_WAITING_SPEC:
            data, digest = encode_spec(spec)
            if arena.set_spec(data, digest, model_sizes(spec), me, _native.proc_start_time(me)):
                arena.wait_state(_native.ARENA_SPEC_OFFERED, deadline.left())
                if arena.state == _native.ARENA_WAITING_SPEC:
                    msg = arena.header()["fail_msg"]
                    raise (OutOfSharedMemory if "shared memory" in msg else SpecError)(
                        f"job {job!r} refused this model: {msg}")
                continue
        elif st == _native.ARENA_INIT_WEIGHTS and arena.header()["offer_pid"] == me:
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


class Learner:
    """A model attached to a psd job. Use ``attach()``; call ``step()`` after each backward pass."""

    def __init__(self, model: torch.nn.Module, job: str | None = None, *, timeout: float = 60.0,
                 slot_timeout: float = 0.0, rank: int | None = None, reconnect_timeout: float = 60.0,
                 pull: str | None = None, partial: bool = False) -> None:
        self.job = job or default_job()
        self.pull_mode, self._pull_source = _pull_mode(pull)
        inner = getattr(model, "_orig_mod", None)  # a torch.compile'd model trains the module it wraps
        model = inner if isinstance(inner, torch.nn.Module) else model
        self.model = model
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.rank = _env_rank() if rank is None else rank
        self.device = next(iter(model.parameters()), torch.empty(0)).device
        threads = os.environ.get("PSD_LEARNER_THREADS")  # set by `psd run` so N learners share the cores
        if threads and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        self.partial = partial
        self._present: list[bool] | None = None  # partial: which of the job's weight tensors the model holds
        if partial:
            self._mine = model_spec(model)  # laid out over the job's spec once it is read (_connect)
            self._buf_range: tuple[int, int] | None = None  # the job's real-valued buffers this one sets
        else:
            self._layout(model_spec(model))
        self.pushed = 0
        self._push_ns = 0
        self.reconnects = 0
        self._closing = False
        self._pull: Pull | None = None  # how this mapping takes the job's weights (learner/pull.py)
        self._stepper = None
        self.predicted_staleness = 0.0
        self._staleness: collections.deque[int] = collections.deque(maxlen=STALENESS_WINDOW)
        self.sharpness = SharpnessProbe([p for p in model.parameters() if p.requires_grad], list(model.buffers()))
        self._connect(slot_timeout)

    @property
    def push_ns(self) -> int:
        """How long the last push took: the copy into the ring and the publish, in nanoseconds."""
        return self._stepper.push_ns if self._stepper is not None else self._push_ns

    @push_ns.setter
    def push_ns(self, ns: int) -> None:
        if self._stepper is not None:
            self._stepper.push_ns = ns
        self._push_ns = ns

    # -- connecting ---------------------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copying or pickling is refused with what to do instead: a learner holds a slot of a live job."""
        raise TypeError(f"a psd Learner cannot be copied or pickled: it holds a learner slot of job {self.job!r} "
                        f"and views of its shared memory. Attach the copy of the model itself "
                        f"(psd.learner.attach(model_copy, job=...)), or save the model's state_dict")

    def _layout(self, state: tuple) -> None:
        """Lay out the private buffers for the model's state in spec order (``model_spec``'s result)."""
        spec, params, owners = state
        self._spec, self._params = spec, params  # params: the trainable ones, then the frozen ones
        self.n_params, self.n_train, self.n_buffers, self.n_pieces = model_sizes(spec)
        n = self.n_params
        self._train = params[:self.n_pieces]
        self._numels = tuple(p.numel for p in spec[:self.n_pieces])
        geometry = piece_geometry(spec)
        self._row_lens = tuple(r for _, r in geometry)
        offs = [0]
        for length, _ in geometry:
            offs.append(offs[-1] + length)
        # The job's trainable tensors as (off, len, row_len), for pulls of the rows that changed.
        self._piece_table = struct.pack(f"<{3 * len(geometry)}Q", *[v for k, (length, r) in enumerate(geometry)
                                                                    for v in (offs[k], length, r)])
        self.dtype = params[0].dtype
        self._dtype_code = PARAM_DTYPES[self.dtype]
        self._sparse = _sparse_tensors(self.model, self._train)
        # A model with sparse gradients pulls only the rows and tensors the updates since its last pull
        # changed (the server's rows log), not the whole table (copy pulls, inline).
        self._rows_pull = bool(self._sparse) and self.pull_mode == "copy" and type(self) is Learner
        self._log_pos = self._epoch = 0
        self.pulled_bytes = 0
        self._wspec = wspec = [p for p in spec if p.kind != "buffer"]
        # The ranges of the weights this learner copies in (all of them, unless a partial attach holds some).
        self._own: list[tuple[int, int, bool]] = []  # (offset, length, frozen)
        off = 0
        for i, p in enumerate(wspec):
            if self._present is None or self._present[i]:
                self._own.append((off, p.numel, p.kind == "frozen"))
            off += p.numel
        # Two private float32 weight buffers: the model trains on the front one; the pull thread fills
        # the other. A bfloat16 / float16 model trains on its own copy of the front, in its dtype.
        self._bufs = [torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)]
        self._buf_views = [split(b, wspec) for b in self._bufs]
        self._lowp = None if self.dtype == torch.float32 else torch.empty(n, dtype=self.dtype)
        if self.pull_mode == "view" and (self._lowp is not None or self.device.type != "cpu"):
            raise SpecError(f"{self._pull_source} makes the parameters views of the job's float32 weights in "
                            f"shared memory, so it needs a float32 model on the CPU (this one is {self.dtype} on "
                            f"{self.device}): pull a copy instead (pull='copy', PSD_PULL=copy, psd run --pull copy)")
        self._front = 0
        self._adopt_buffers(spec, owners)

    def _adopt_buffers(self, spec: list[ParamSpec], owners: list[tuple[torch.nn.Module, str]]) -> None:
        """Make the model's buffers views of one private tensor per dtype, so that pushing how far they
        moved and taking the job's merged values are one copy per dtype, not one per buffer."""
        self._bgroups = []
        self._bcur = torch.empty(self.n_buffers, dtype=torch.float64)  # this learner's values now
        self._bbase = torch.empty(self.n_buffers, dtype=torch.float64)  # ... when it last pulled them
        self._bdelta = torch.empty(self.n_buffers, dtype=torch.float64)  # what is pushed
        self._bset = buffers_set(spec)
        specs = [p for p in spec if p.kind == "buffer"]
        i = 0
        for lo, hi, dt in buffer_groups(spec):  # the spec lists buffers grouped by dtype
            members = []
            while i < len(specs) and torch_dtype(specs[i].dtype) == dt:
                members.append((specs[i], owners[i]))
                i += 1
            old = [getattr(mod, attr) for _, (mod, attr) in members]
            flat = torch.cat([t.detach().reshape(-1) for t in old]).to(dt)
            for (_, (mod, attr)), v in zip(members, split(flat, [p for p, _ in members]), strict=True):
                setattr(mod, attr, v)
            self._bgroups.append((lo, hi, flat))
        self._bbase.copy_(self._buffers_now())

    def _buffers_now(self) -> torch.Tensor:
        """This learner's buffer values, as float64 (into its own tensor)."""
        for lo, hi, flat in self._bgroups:
            self._bcur[lo:hi].copy_(flat)
        return self._bcur

    def _buffer_delta(self) -> int | None:
        """The address of this learner's buffers as pushed (None: no buffers): the values of the
        real-valued ones (they become the job's), then how far the counters moved since they were
        last pulled (the job adds that, so counters count every learner's batches)."""
        if not self.n_buffers or (self.partial and self._buf_range is None):  # a stage without buffers
            return None
        torch.sub(self._buffers_now(), self._bbase, out=self._bdelta)
        self._bdelta[:self._bset].copy_(self._bcur[:self._bset])
        if self.partial:  # the other stages' values are not pushed (a non-finite one would flag the entry)
            lo, hi = self._buf_range
            self._bdelta[:lo] = 0.0
            self._bdelta[hi:self._bset] = 0.0
        self._bbase.copy_(self._bcur)
        return self._bdelta.data_ptr()

    def _pull_buffers(self) -> None:
        """Take the job's merged buffers into the model (with the weights that came with them)."""
        if not self.n_buffers:
            return
        self._bbase.copy_(self._arena_buffers)
        for lo, hi, flat in self._bgroups:
            flat.copy_(self._bbase[lo:hi])

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
        arena = open_job(self.job, role="learner")
        try:
            if self.partial:
                self._await_model(arena)
                arena.remap()
                self._layout(self._partial_state(arena_spec(arena)))
            elif arena.state != _native.ARENA_READY:
                buffers = [self._bcur[lo:hi] for lo, hi, _ in self._bgroups]
                _wait_ready(arena, self.job, self._spec, self._params, buffers, self.timeout)
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
        self._identity = arena.identity()
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

    def _await_model(self, arena: _native.Arena) -> None:
        """A partial attach: wait for the job's model to be declared (it never offers one itself)."""
        deadline = _Deadline(self.timeout)
        while (state := arena.state) != _native.ARENA_READY:
            if state == _native.ARENA_STOPPED:
                raise Error(f"job {self.job!r} was stopped; start it again (`psd serve --job {self.job} --resume`) "
                            f"before attaching a stage to it")
            if deadline.expired():
                raise Timeout(f"job {self.job!r} has no model yet (state {state}) after {self.timeout:g} s: a "
                              f"partial attach takes part of the job's model, which a full attach "
                              f"(psd.learner.attach(model)), `psd serve --init` or `--resume` declares first")
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
                if deadline.expired():
                    h = self._arena.header()
                    pids = [self._arena.slot_info(i)["pid"] for i in range(h["n_slots"])]
                    raise NoFreeSlot(
                        f"job {self.job!r} has {h['n_slots']} learner slot(s) and all are in use "
                        f"(pids {', '.join(map(str, pids))}): start its server with more --learners, "
                        f"or pass slot_timeout= to wait for a slot"
                    ) from None
                # Slots free without a signal of their own: recheck every 0.1 s (or when the
                # arena's state changes, e.g. the server stops).
                self._arena.wait_state(_native.ARENA_READY, min(deadline.left(), 0.1))
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

    def _rank_progress(self) -> int:
        """Gradients this rank had applied before this attach (0 without a rank).

        A restarted learner's earlier incarnation may still be draining; its
        gradients count once they are applied, so wait for that first.
        """
        if self.rank < 0:
            return 0
        a = self._arena
        deadline = _Deadline(self.timeout)

        def predecessor_busy() -> bool:
            for i in range(a.header()["n_slots"]):
                s = a.slot_info(i)
                if i != self.slot and s["rank"] == self.rank and s["state"] != _native.SLOT_FREE:
                    return True
            return False

        while predecessor_busy():
            if deadline.expired():
                raise Timeout(f"job {self.job!r}: another learner with rank {self.rank} is still attached; "
                              f"give each learner its own rank (PSD_RANK)")
            a.wait_state(_native.ARENA_READY, 0.02)  # a slot frees without a signal of its own
        ranks = a.ranks()
        return ranks[self.rank] if self.rank < len(ranks) else 0

    def _map_shared(self) -> dict:
        """Views of the job's weights and buffers, and the ring depth; returns the header it read them from."""
        a, h = self._arena, self._arena.header()
        self._k = h["ring_k"]
        self._weights = weights_view(a, h)
        self._arena_buffers = buffers_view(a, h)
        return h

    def _map_buffers(self) -> None:
        a, n = self._arena, self.n_params
        h = self._map_shared()
        # Small models pull inline, between steps: a copy of a few hundred KB costs less than waking
        # a thread. Larger ones use the native pull thread (it never waits for the GIL): step() asks
        # it for a pull and, at the next step, takes the buffer it filled if the clock had moved.
        if self.pull_mode == "view":
            self._pull = ViewPull(self)
        elif (n * 4 > INLINE_PULL_BYTES and not self._rows_pull and not self.partial
              and pull_thread_has_a_core(h["n_slots"], h["threads"])):
            self._pull = ThreadPull(self)
        else:
            self._pull = InlinePull(self)
        self._pull.map(a)
        self._sync_model()
        self._tail = a.tail(self.slot)
        for p in self._params:
            p.grad = None  # a gradient from before attaching is not this job's
        self._make_stepper()

    def _make_stepper(self) -> None:
        """The native whole-step call, for jobs whose step needs no Python: one push per call (no
        --push-every), asp or kasync, no --predict, no buffers, no sparse rows, a float32 model
        that pulls inline or views the shared weights. Others take the general path in step(), and so
        do subclasses (DeviceLearner's step is its own)."""
        self._stepper = None
        if (self.push_every != 1 or self.sync not in ("asp", "kasync") or self.predict or self.n_buffers
                or self._sparse or self._lowp is not None or isinstance(self._pull, ThreadPull) or self.partial
                or type(self) is not Learner):
            return
        front = None if self.pull_mode == "view" else self._bufs[self._front].numpy()
        self._stepper = self._arena.stepper(self.slot, tuple(self._train), self.dtype, self._dtype_code,
                                            torch.strided, front, self._store)

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
        try:
            self._arena.close()
        except ArenaBusy:
            pass  # the user still holds a tensor over the arena; it unmaps when that goes

    def _await_server(self, cause: Error) -> None:
        """The server died: wait for its successor, on this arena or (after a loss) on a new one."""
        log.warning("job %r: %s; waiting up to %g s for the server to come back", self.job, cause,
                    self.reconnect_timeout)
        deadline = _Deadline(self.reconnect_timeout)
        path = shm_path(self.job)
        while not deadline.expired():
            try:
                st = os.stat(path)
                ident = (st.st_dev, st.st_ino)
            except FileNotFoundError:
                ident = None
            if self._identity is not None and self._arena.state == _native.ARENA_STOPPED:
                raise ServerGone(f"job {self.job!r} was stopped (`psd stop` or Ctrl-C on its server); "
                                 f"start it again to go on: `psd serve --job {self.job} --resume`") from cause
            if ident is not None and ident == self._identity:
                if self._arena.server_alive():
                    log.warning("job %r: server is back (generation %d)", self.job, self._arena.generation())
                    self.reconnects += 1
                    return
            elif ident is not None:  # the arena was lost; a server started over from a checkpoint
                if self._identity is not None:
                    self._unmap()
                    self._identity = None
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
                before = self._identity
                self._await_server(e)
                if self._identity != before:
                    return None  # a new arena: the old ring and what was in it are gone

    # -- gradients ----------------------------------------------------------

    def _grads_of(self, mask: tuple[int, ...] | None) -> list[torch.Tensor | None]:
        """This mini-batch's gradients of the trained tensors (all, or those in ``mask``: None for the
        others), each ``p.grad`` of them reset to None, as ``zero_grad()`` does: the next backward pass
        writes fresh gradients instead of adding into zeroed ones, which saves a pass over the model."""
        out: list[torch.Tensor | None] = [None] * len(self._train)
        for k in range(len(self._train)) if mask is None else mask:
            p = self._train[k]
            out[k] = p.grad
            p.grad = None
        return out

    def _has_gradient(self, mask: tuple[int, ...] | None) -> bool:
        train = self._train
        return any(train[k].grad is not None for k in (range(len(train)) if mask is None else mask))

    def _accumulate(self, mask: tuple[int, ...] | None) -> None:
        """--push-every: add this mini-batch's gradients into the wave's sums, in psd's own buffer, so
        that whatever the caller does to ``p.grad`` before the next step (``zero_grad()``, a framework's
        ``model.zero_grad()``) the wave pushes every mini-batch of it."""
        if self._acc is None:
            self._acc = torch.empty(sum(self._numels), dtype=torch.float32 if self._lowp is not None else self.dtype)
            self._acc_views = [v.view(p.shape) for v, p in zip(self._acc.split(self._numels), self._train,
                                                                 strict=True)]
            self._acc_has = [False] * len(self._train)
            self._acc_count = [0] * len(self._train)
        for k in range(len(self._train)) if mask is None else mask:
            self._acc_count[k] += 1  # a step of this tensor's optimizer, with a gradient for it or not
        for k, g in enumerate(self._grads_of(mask)):
            if g is None:
                continue
            if g.layout == torch.sparse_coo:
                s = self._acc_sparse.get(k)
                self._acc_sparse[k] = g.detach().clone() if s is None else s + g.detach()
                continue
            if g.layout != torch.strided:
                g = g.to_dense()
            v = self._acc_views[k]
            if self._acc_has[k]:
                v.add_(g.detach())
            else:
                v.copy_(g.detach())
                self._acc_has[k] = True

    def _wave_grads(self) -> list[torch.Tensor | None]:
        """The wave's mean gradients, and a new wave begins. Each tensor's sum is divided by the steps
        of its optimizer within the wave: W, unless several optimizers of some of the parameters each
        (``Optimizer(params=...)``) stepped within it (then each tensor by its own optimizer's steps)."""
        out: list[torch.Tensor | None] = [None] * len(self._train)
        for k in range(len(self._train)):
            s = self._acc_sparse.pop(k, None)
            n, self._acc_count[k] = self._acc_count[k], 0
            if self._acc_has[k]:
                g = self._acc_views[k]
                if s is not None:
                    g.add_(s.to_dense())
                out[k] = g.div_(n) if n > 1 else g
                self._acc_has[k] = False
            elif s is not None:
                out[k] = s / n if n > 1 else s
        return out

    def _take_gradients(self, gs: list[torch.Tensor | None]) -> tuple[list, list[int], list | None]:
        """The gradients ``gs`` as the push takes them (kept alive for the copy), their addresses (0:
        none) and the sparse ones' rows ((tensor index, rows address, row count, row length), or
        None). A tensor without a gradient gets no update from this push at all, as in torch.optim."""
        keep, ptrs, sparse = [], [], None
        for k, g in enumerate(gs):
            if g is None:
                ptrs.append(0)
                continue
            if g.layout == torch.sparse_coo and k in self._sparse and g.sparse_dim() == 1:
                g = g.coalesce()  # repeated rows add up first (Adagrad squares the sum)
                rows, vals = g.indices()[0].contiguous(), g.values().to(self.dtype).contiguous()
                if rows.numel() == 0:
                    ptrs.append(0)
                    continue
                keep += [rows, vals]
                ptrs.append(vals.data_ptr())
                sparse = (sparse or []) + [(k, rows.data_ptr(), rows.numel(), self._row_lens[k])]
                continue
            if g.layout != torch.strided:
                g = g.to_dense()  # sparse (any layout) or mkldnn
            if g.dtype != self.dtype:
                g = g.to(self.dtype)
            if not g.is_contiguous():
                g = g.contiguous()
            keep.append(g)
            ptrs.append(g.data_ptr())
        return keep, ptrs, sparse

    def step(self, loss: float | torch.Tensor | None = None, batch_size: int = 1, *,
             only: tuple[int, ...] | None = None, closure: Callable[[], Any] | None = None) -> None:
        """Push this mini-batch's gradient and swap in newer weights; replaces ``optimizer.step()``.

        The gradients (``p.grad``) are copied into this learner's ring and reset to None, as
        ``optimizer.zero_grad()`` does, so no ``zero_grad()`` call is needed (one is harmless).
        ``loss`` and ``batch_size`` are recorded with the gradient. A step without any gradient
        pushes nothing: it is no update, and counts toward no wave, clock or ``kasync`` group.
        ``only`` (the indices of trained tensors, in the job's order): push those tensors' gradients
        and leave the others' ``p.grad`` alone (``psd.learner.Optimizer(params=...)``).
        If the server dies, this waits (up to ``reconnect_timeout``) for the watchdog's new server.
        ``closure`` (optional, torch.optim's convention): recomputes this mini-batch's loss and gradients
        (zero the gradients, forward, backward). With it, in a job of momentum under ``--async-momentum
        auto`` (``measures_sharpness``), every ``sharpness.every``-th step (50) first
        measures the loss's sharpness (learner/sharpness.py; weights, gradients and buffers are left as
        they were) for the server: with momentum and ``--async-momentum auto``, a job that measures keeps
        as much of one process's momentum gain as its staleness safely allows; without, it keeps a tenth.

        The job's sync mode decides what else happens: with ``--push-every W`` only every W-th call
        pushes: the mean of the W mini-batches' gradients, which add up in psd's own buffer (so a
        ``zero_grad()`` between them loses nothing); under ``ssp:S`` a learner S pushes ahead of the
        slowest live one waits here; under ``bsp`` it waits for the round (one gradient from every
        learner) to be applied. Non-finite gradients are pushed flagged, and the server rejects them
        (``rejected`` in ``psd status``).
        """
        if self._closing:
            raise Error("this learner is detached; attach again to keep training")
        if closure is not None and self.measures_sharpness and self.sharpness.due():
            self.measure_sharpness(closure)
        lv = math.nan if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        st = self._stepper
        if st is not None and only is None:  # the whole step in one native call, where the job allows
            r = st.step(self.clock, lv, int(batch_size))
            if r is not None:
                self._tail += 1
                self.pushed += 1
                if r >= 0:
                    if r != self.clock and self.pull_mode == "copy":  # the step copied the weights in
                        self.pulled_bytes += 4 * self.n_train
                    self.clock = r
                else:  # the ring is full: wait for space, then pull
                    self._after_push(self._arena, 0)
                return
        if not self._has_gradient(only):
            if self.sync in ("asp", "kasync") or self.push_every > 1:
                self._take_newer(self._arena)  # nothing to push, no update: only newer weights
                return
            # bsp / ssp: the peers wait on this learner's steps. The empty push is its step (a round's
            # member, its ssp progress), and the server applies it as no update.
        if self.push_every > 1:
            self._accumulate(only)
        wave = self._end_of_wave(lv, batch_size)
        if wave is None:
            return
        lv, batch_size, _ = wave
        self._push(lv, batch_size, self._wave_grads() if self.push_every > 1 else self._grads_of(only))

    def measure_sharpness(self, closure: Callable[[], Any]) -> float:
        """Measure the loss's sharpness now with ``closure`` (see ``step``) and report it to the server;
        returns it (NaN: the closure gave no usable gradient)."""
        value = self.sharpness.measure(closure)
        self._arena.note_sharpness(self.slot, value)
        return value

    def _push_open_wave(self) -> None:
        """--push-every: push the mean of an unfinished wave's mini-batches (at close: nothing is lost)."""
        if self.push_every > 1 and self._wave and self._acc is not None and type(self) is Learner:
            lv, batch, n = self._wave_loss / self._wave, self._wave_batch, self._wave
            self._wave, self._wave_loss, self._wave_batch = 0, 0.0, 0
            log.info("job %r: pushing the unfinished wave of %d mini-batch(es) at close", self.job, n)
            self._push(lv, batch, self._wave_grads())

    def _push(self, lv: float, batch_size: int, gs: list[torch.Tensor | None]) -> None:
        """Push the gradients ``gs``, then wait for ring space and the sync mode, and pull."""
        a = self._arena
        if self.predict and self._tail >= self._k:
            self._sample_staleness(self._tail - self._k)
        rounds = a.rounds() if self.sync == "bsp" else 0
        grads, ptrs, sparse = self._take_gradients(gs)
        t0 = time.perf_counter_ns()
        a.push_from(self.slot, self.clock, int(batch_size), lv, 1.0, ptrs, self._numels, self._dtype_code,
                    self._buffer_delta(), sparse, self._store)
        self.push_ns = time.perf_counter_ns() - t0
        del grads
        self._tail += 1
        self.pushed += 1
        self._after_push(a, rounds)

    def _after_push(self, a: _native.Arena, rounds: int) -> None:
        """What follows a push: wait for ring space and for the sync mode, then take newer weights."""
        if not a.has_space(self.slot):
            self._with_server(self._arena.wait_space, self.slot, self._claim_token, self.timeout)
            if self._arena is not a:
                return  # reattached to a new arena: weights pulled
        if self.sync == "bsp":
            self._with_server(a.wait_round, self.slot, self._claim_token, rounds, self.timeout)
        elif self.sync == "ssp":
            self._with_server(a.wait_ssp, self.slot, self._claim_token, self.timeout)
        if self._arena is not a:
            return
        self._take_newer(a)

    def _take_newer(self, a: _native.Arena) -> None:
        """Swap in newer weights, if the job has them (the pull after a push, or an empty step)."""
        before = self.clock
        copied = self._pull.take_newer(a)
        if self.clock != before or copied:  # (copied: weights written outside an update, same clock)
            if self.predict:
                self._predict()
            self._sync_model(frozen=False)

    def _end_of_wave(self, loss, batch_size: int):
        """Count one mini-batch of the wave (``--push-every``): None while the wave goes on, else
        (mean loss, summed batch size, mini-batches in the wave), and a new wave starts."""
        if self.push_every == 1:
            return loss, int(batch_size), 1
        self._wave += 1
        self._wave_loss = self._wave_loss + loss
        self._wave_batch += int(batch_size)
        if self._wave < self.push_every:
            return None
        out = (self._wave_loss / self._wave, self._wave_batch, self._wave)
        self._wave, self._wave_loss, self._wave_batch = 0, 0.0, 0
        return out

    def _sample_staleness(self, seq: int) -> None:
        """Note the exact staleness of gradient ``seq`` (its ring entry is about to be reused)."""
        meta = self._arena.entry_meta(self.slot, seq)
        if meta is not None and meta["outcome"] == _native.OUTCOME_APPLIED:
            self._staleness.append(meta["applied_clock"] - meta["clock"])

    def _predict(self) -> None:
        """Extrapolate the fresh front weights by this learner's staleness (PipeOptim).

        The staleness used is the median over this learner's last gradients, not their mean: on a
        busy machine staleness is bursty (mostly small, sometimes large), and a mean then moves
        the weights further than most gradients travel; the median minimises the expected distance,
        so prediction is never worse than none.
        """
        if self._staleness:
            self.predicted_staleness = float(sorted(self._staleness)[len(self._staleness) // 2])
            if self.predicted_staleness > 0 and self._present is None:
                self._arena.predict_into(self._front_array, self.predicted_staleness)
            elif self.predicted_staleness > 0:  # a partial learner: its own tensors, by their own staleness
                self.predicted_staleness *= self._own_share()
                for off, length, frozen in self._own:
                    if not frozen:
                        self._arena.predict_into(self._front_array, self.predicted_staleness, off, off + length)

    def _own_share(self) -> float:
        """A partial learner: the share of the job's updates that moved its own tensors lately (PipeOptim
        extrapolates a stage by its own in-flight depth; the clock's staleness counts every stage's
        updates). Measured on its first trainable tensor's step count over the last STALENESS_WINDOW pulls,
        each count paired with the clock read around it (the update loop may apply more while this runs)."""
        k = next((i for i in range(self.n_pieces) if self._present[i]), None)
        if k is None:
            return 1.0
        if getattr(self, "_steps_view", None) is None or self._steps_arena is not self._arena:
            self._steps_view, self._steps_arena = pieces_view(self._arena, self._arena.header()), self._arena
            self._shares = collections.deque(maxlen=STALENESS_WINDOW)
        for _ in range(8):  # a pair from one moment: the clock the same before and after the count
            clock = self._arena.clock()
            steps = int(self._steps_view[k, 0])
            if self._arena.clock() == clock:
                break
        else:
            return 1.0  # the job moves too fast to pair them: no correction this time
        # The loop counts a tensor's step before it stores the clock: an update in flight may be counted
        # already, and no tensor moved more often than the clock.
        self._shares.append((clock, min(steps, clock)))
        (c0, s0), (c1, s1) = self._shares[0], self._shares[-1]
        return min(1.0, max(0.0, (s1 - s0) / (c1 - c0))) if c1 > c0 else 1.0

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

    # -- weights ------------------------------------------------------------

    def _point(self, index: int) -> None:
        """Make buffer ``index`` the front: a float32 model's parameters become views of it."""
        self._front = index
        self._front_array = self._bufs[index].numpy()
        if self._lowp is None:
            # The trainable parameters follow the front buffer; the frozen ones stay views of buffer 0's
            # copy (pulls move only the trainable weights), so a local write to one survives every swap.
            t = len(self._train)
            self._set_params(self._buf_views[index][:t] + self._buf_views[0][t:])

    def _set_params(self, views: list[torch.Tensor]) -> None:
        """Make the parameters (trainable, then frozen) these views, without copying."""
        with torch.no_grad():
            for p, v in zip(self._params, views, strict=True):
                p.data = v

    def _sync_model(self, frozen: bool = True) -> None:
        """New weights are in the front buffer: bring them to a low-precision model, with the job's buffers.

        ``frozen=False`` (a step's pull, which moved only the trainable weights) leaves the model's frozen
        weights as they are."""
        if self._lowp is not None:
            front = self._bufs[self._front]
            for off, length, is_frozen in self._own:
                if frozen or not is_frozen:
                    self._lowp[off:off + length].copy_(front[off:off + length])
        self._pull_buffers()

    def _copy_own(self, dst: torch.Tensor, trainable: bool = True, frozen: bool = False) -> int:
        """Copy this learner's weights (all, or a partial attach's own) from the job's into ``dst``; the bytes."""
        if self._present is None:  # the whole model: the trainable prefix, the frozen rest, or both, in one copy
            lo, hi = 0 if trainable else self.n_train, self.n_params if frozen else self.n_train
            dst[lo:hi].copy_(self._weights[lo:hi])
            return 4 * (hi - lo)
        done = 0
        for off, length, is_frozen in self._own:
            if (frozen if is_frozen else trainable):
                dst[off:off + length].copy_(self._weights[off:off + length])
                done += 4 * length
        return done

    def pull(self) -> int:
        """Copy the current shared weights into the model now; returns their clock.

        With ``pull="view"`` the model computes on the shared weights already: this only takes the
        job's buffers and the clock."""
        if self._pull is None:
            raise Error(f"this learner of job {self.job!r} is closed (or lost its job and could not reattach): "
                        f"attach the model again (psd.learner.attach)")
        return self._pull.now()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the server has applied every gradient this learner pushed."""
        self._with_server(self._arena.wait_drained, self.slot, self._claim_token,
                          self.timeout if timeout is None else timeout)

    # -- detaching ----------------------------------------------------------

    def close(self, flush: bool = True) -> None:
        """Detach: push an unfinished ``--push-every`` wave's mean and wait for every pushed gradient to be
        applied (if ``flush``), free the slot, unmap."""
        if self._closing:
            return
        self._closing = True
        if self._identity is None:
            return  # lost with its arena (see _await_server), nothing left to release
        try:
            self._closing = False
            try:
                self._push_open_wave()  # nothing lost, even when closing without waiting (at exit)
            except Error as e:
                log.warning("job %r: the unfinished wave could not be pushed at close: %s", self.job, e)
            finally:
                self._closing = True
            if flush:
                self.flush()
            try:
                self._arena.release(self.slot, self._claim_token)
            except SlotLost:
                log.warning("job %r: slot %d was taken back by the server (see its log); nothing to release",
                            self.job, self.slot)
                return
            if flush:  # the slot is usable by the next learner when close() returns
                self._with_server(self._arena.wait_freed, self.slot, self._claim_token, self.timeout)
        finally:
            self._unmap()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # After an error, still hand back the slot, but do not wait on a server that may be gone.
        self.close(flush=exc_type is None)

    def __repr__(self) -> str:
        return f"<psd.learner.Learner job={self.job!r} slot={self.slot} pushed={self.pushed} clock={self.clock}>"


def pull_thread_has_a_core(learners: int, loop_threads: int, cpus: int | None = None) -> bool:
    """Whether a learner's pull thread would get a core of its own: the job's learners (its slots) and
    the update loop's threads leave at least one free. Where they do not, the thread only takes turns
    with the training thread and the loop, and an inline copy between steps is faster (measured on 2
    cores: 1e5 parameters, 1 learner, 15K updates/s with the thread, 35K inline; 1e6: 3.1K and 4.1K)."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return cpus > learners + max(1, loop_threads)


def _pull_mode(pull: str | None) -> tuple[str, str]:
    """``pull`` as given, else $PSD_PULL (set by ``psd run --pull``), else "copy"; and where it came from,
    as the user wrote it (for error messages)."""
    env = os.environ.get("PSD_PULL")
    mode, src = (pull, f"pull={pull!r}") if pull is not None else (env, f"PSD_PULL={env!r}") if env else ("copy", "")
    if mode not in PULL_MODES:
        raise Error(f"{src} is not a pull mode: use one of {', '.join(PULL_MODES)}")
    return mode, src


def pull_state_dict(job: str | None = None) -> dict[str, torch.Tensor]:
    """A copy of the job's current state as a state_dict, without claiming a slot.

    It holds every parameter (trained and frozen) and every persistent buffer (BatchNorm's
    statistics, counters), each in the model's own dtype, so ``model.load_state_dict(...)`` takes
    it with the default ``strict=True``.
    """
    job = job or default_job()
    arena = open_job(job, role="reader")
    try:
        if arena.state != _native.ARENA_READY:
            raise StateError(f"job {job!r} has no weights yet (no learner has attached)")
        arena.remap()
        spec = arena_spec(arena)
        h = arena.header()
        w, b = weights_view(arena, h), buffers_view(arena, h)
        try:
            return state_dict_of(spec, w, b)
        finally:
            del w, b
    finally:
        arena.close()

