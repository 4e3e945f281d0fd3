"""The learner client: attach a PyTorch model to a psd job and train through it.

A learner claims one slot of the job's arena. Gradients are computed straight
into the slot's ring: before each backward pass every ``p.grad`` is a view into
the next free ring entry, so a push is only the store-release of the ring's
tail (no copy, and nothing left for a push thread to do). Weights come back
through a pull thread that copies the shared weights into a second private
buffer whenever the server's clock has moved; ``step()`` swaps that buffer in
by re-pointing the parameters, so a forward pass never sees weights change
under it. Both hand-offs are queues of one, as in GaDei.
"""

from __future__ import annotations

import math
import os
import threading

import torch

from psd import _native
from psd.arena import ParamSpec, decode_spec, default_job, encode_spec, first_difference, open_job
from psd.errors import ArenaBusy, Error, NoFreeSlot, OutOfSharedMemory, SpecError, StateError, Timeout

__all__ = ["Learner", "attach", "pull_state_dict"]


def _spec_of(model: torch.nn.Module) -> tuple[list[ParamSpec], list[torch.nn.Parameter]]:
    spec, params = [], []
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise SpecError(f"parameter {name!r} is {p.dtype}; psd trains float32 weights (call model.float())")
        if p.device.type != "cpu":
            raise SpecError(f"parameter {name!r} is on {p.device}; this psd learner trains on the CPU")
        spec.append(ParamSpec(name, tuple(p.shape)))
        params.append(p)
    if not params:
        raise SpecError("the model has no parameters to train")
    return spec, params


def _views(flat: torch.Tensor, spec: list[ParamSpec]) -> list[torch.Tensor]:
    out, off = [], 0
    for p in spec:
        out.append(flat[off:off + p.numel].view(p.shape))
        off += p.numel
    return out


def _wait_ready(arena: _native.Arena, job: str, spec: list[ParamSpec], n: int, params: list,
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
            if arena.set_spec(data, digest, n, me, _native.proc_start_time(me)):
                arena.wait_state(_native.ARENA_SPEC_OFFERED, deadline.left())
                if arena.state == _native.ARENA_WAITING_SPEC:
                    msg = arena.header()["fail_msg"]
                    raise (OutOfSharedMemory if "shared memory" in msg else SpecError)(
                        f"job {job!r} refused this model: {msg}")
                continue
        elif st == _native.ARENA_INIT_WEIGHTS and arena.header()["offer_pid"] == me:
            arena.remap()
            off = arena.header()["weights_off"]
            w = torch.frombuffer(arena, dtype=torch.float32, count=n, offset=off)
            torch.cat([p.detach().reshape(-1) for p in params], out=w)
            del w
            arena.set_state(_native.ARENA_READY)
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


class Learner:
    """A model attached to a psd job. Use ``attach()``; call ``step()`` after each backward pass."""

    def __init__(self, model: torch.nn.Module, job: str | None = None, *, timeout: float = 60.0,
                 slot_timeout: float = 0.0) -> None:
        self.job = job or default_job()
        self.model = model
        self.timeout = timeout
        spec, params = _spec_of(model)
        self._spec, self._params = spec, params
        self.n_params = n = sum(p.numel for p in spec)
        arena = open_job(self.job)
        self._arena = arena
        try:
            if arena.state != _native.ARENA_READY:
                _wait_ready(arena, self.job, spec, n, params, timeout)
            arena.remap()
            theirs = decode_spec(arena.spec())
            mismatch = first_difference(self.job, spec, theirs)
            if mismatch:
                raise mismatch
            self._claim(slot_timeout)
        except BaseException:
            arena.close()
            raise
        self._setup_buffers()

    def _claim(self, slot_timeout: float) -> None:
        me = os.getpid()
        deadline = _Deadline(slot_timeout)
        while True:
            try:
                self.slot, self._claim_token = self._arena.claim(me, _native.proc_start_time(me))
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
            except StateError:
                raise Error(f"job {self.job!r} is not accepting learners (state {self._arena.state})") from None

    def _setup_buffers(self) -> None:
        a, n, spec = self._arena, self.n_params, self._spec
        h = a.header()
        self._k = h["ring_k"]
        self._weights = torch.frombuffer(a, dtype=torch.float32, count=n, offset=h["weights_off"])
        self._entries = [
            torch.frombuffer(a, dtype=torch.float32, count=n, offset=a.grad_offset(self.slot, k))
            for k in range(self._k)
        ]
        self._entry_views = [_views(e, spec) for e in self._entries]
        # Two private weight buffers: the model trains on `front`; the pull thread fills `back`.
        self._front = torch.empty(n, dtype=torch.float32)
        self._back = torch.empty(n, dtype=torch.float32)
        self.clock = a.clock()
        self._front.copy_(self._weights)
        self._front_views = _views(self._front, spec)
        self._back_views = _views(self._back, spec)
        with torch.no_grad():
            for p, v in zip(self._params, self._front_views, strict=True):
                p.data = v
        self.pushed = 0
        self._tail = a.tail(self.slot)
        self._arm_entry()
        # Pull thread hand-off (a queue of one): `_want` asks for a pull; `_fresh`
        # says `back` holds newer weights that step() has not swapped in yet.
        self._cv = threading.Condition()
        self._want = False
        self._fresh = False
        self._back_clock = self.clock
        self._closing = False
        self._pull_error: BaseException | None = None
        self._puller = threading.Thread(target=self._pull_loop, name=f"psd-pull-{self.job}", daemon=True)
        self._puller.start()

    # -- gradients ----------------------------------------------------------

    def _arm_entry(self) -> None:
        """Point every p.grad at the (zeroed) ring entry the next gradient goes to."""
        views = self._entry_views[self._tail % self._k]
        self._entries[self._tail % self._k].zero_()
        for p, v in zip(self._params, views, strict=True):
            p.grad = v

    def _collect(self) -> None:
        """Bring gradients that are not in the ring entry (user reset p.grad) into it."""
        views = self._entry_views[self._tail % self._k]
        for p, v in zip(self._params, views, strict=True):
            g = p.grad
            if g is None:
                v.zero_()
            elif g.data_ptr() != v.data_ptr():
                v.copy_(g)

    def step(self, loss: float | torch.Tensor | None = None, batch_size: int = 1) -> None:
        """Push this mini-batch's gradient and swap in newer weights; replaces ``optimizer.step()``.

        Gradients are zeroed for the next mini-batch (as ``zero_grad(set_to_none=False)``), so do
        not call ``zero_grad()`` yourself. ``loss`` and ``batch_size`` are recorded with the gradient.
        """
        if self._closing:
            raise Error("this learner is detached; attach again to keep training")
        if self._pull_error is not None:
            raise self._pull_error
        self._collect()
        lv = math.nan if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        a = self._arena
        a.push(self.slot, self.clock, int(batch_size), lv)
        self._tail += 1
        self.pushed += 1
        if not a.has_space(self.slot):
            a.wait_space(self.slot, self._claim_token, self.timeout)
        self._arm_entry()
        with self._cv:
            if self._fresh:
                self._swap_in()
            self._want = True
            self._cv.notify()

    # -- weights ------------------------------------------------------------

    def _swap_in(self) -> None:
        self._front, self._back = self._back, self._front
        self._front_views, self._back_views = self._back_views, self._front_views
        with torch.no_grad():
            for p, v in zip(self._params, self._front_views, strict=True):
                p.data = v
        self.clock = self._back_clock
        self._fresh = False

    def _pull_loop(self) -> None:
        a = self._arena
        try:
            while True:
                with self._cv:
                    while not self._closing and not (self._want and not self._fresh):
                        self._cv.wait()
                    if self._closing:
                        return
                    self._want = False
                    current = self.clock
                clock = a.clock()
                if clock == current:
                    a.note_pull(self.slot, clock, True)
                    continue
                self._back.copy_(self._weights)  # releases the GIL
                a.note_pull(self.slot, clock, False)
                with self._cv:
                    self._back_clock = clock
                    self._fresh = True
        except BaseException as e:  # surfaced by the next step()
            self._pull_error = e

    def pull(self) -> int:
        """Copy the current shared weights into the model now; returns their clock."""
        with self._cv:
            self._fresh = False
            clock = self._arena.clock()
            self._front.copy_(self._weights)
            self.clock = clock
        self._arena.note_pull(self.slot, clock, False)
        return clock

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the server has applied every gradient this learner pushed."""
        self._arena.wait_drained(self.slot, self._claim_token, self.timeout if timeout is None else timeout)

    # -- detaching ----------------------------------------------------------

    def close(self, flush: bool = True) -> None:
        """Detach: wait for pushed gradients to be applied (if ``flush``), free the slot, unmap."""
        if self._closing:
            return
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._puller.join()
        a = self._arena
        try:
            if flush:
                self.flush()
            a.release(self.slot, self._claim_token)
            if flush:  # the slot is usable by the next learner when close() returns
                a.wait_freed(self.slot, self._claim_token, self.timeout)
        finally:
            for p in self._params:
                p.grad = None
            del self._weights, self._entries, self._entry_views
            try:
                a.close()
            except ArenaBusy:
                pass  # the user still holds a tensor over the arena; it unmaps when that goes

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # After an error, still hand back the slot, but do not wait on a server that may be gone.
        self.close(flush=exc_type is None)

    def __repr__(self) -> str:
        return f"<psd.learner.Learner job={self.job!r} slot={self.slot} pushed={self.pushed} clock={self.clock}>"


def attach(model: torch.nn.Module, job: str | None = None, *, timeout: float = 60.0,
           slot_timeout: float = 0.0) -> Learner:
    """Attach ``model`` to the psd job ``job`` (default: $PSD_JOB, else ``default``).

    Claims a learner slot and pulls the job's current weights into the model. If
    the job has no model yet, this model's parameter names, shapes and values
    become the job's. ``timeout`` bounds every wait on the server;
    ``slot_timeout`` is how long to wait for a free slot when all are taken.
    Use as a context manager, and call ``step()`` where ``optimizer.step()`` was.
    """
    return Learner(model, job, timeout=timeout, slot_timeout=slot_timeout)


def pull_state_dict(job: str | None = None) -> dict[str, torch.Tensor]:
    """A copy of the job's current weights as a state_dict, without claiming a slot."""
    job = job or default_job()
    arena = open_job(job)
    try:
        if arena.state != _native.ARENA_READY:
            raise StateError(f"job {job!r} has no weights yet (no learner has attached)")
        arena.remap()
        spec = decode_spec(arena.spec())
        h = arena.header()
        w = torch.frombuffer(arena, dtype=torch.float32, count=h["n_params"], offset=h["weights_off"]).clone()
        return {p.name: v.clone() for p, v in zip(spec, _views(w, spec), strict=True)}
    finally:
        arena.close()

