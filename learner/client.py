"""The learner client: attach a PyTorch model to a psd job and train through it.

A learner claims one slot of the job's arena. ``step()`` copies the
mini-batch's gradients (``p.grad``, in the model's dtype; sparse embedding
gradients as their rows) into the next free entry of the slot's ring in one C
pass that converts and checks them, with how far the model's buffers (BatchNorm
statistics) moved since they were last pulled, then store-releases the ring's
tail. Then (asp and ssp under the job's ``--overlap off`` or ``auto``, any
optimizer; not on a GPU) it waits until the server has
applied that gradient and copies the shared weights into the model's private
buffer, so the next gradient is computed on weights that hold this one.
Otherwise (GaDei's hand-off) it takes newer weights right after the
push instead: for a large model, a pull thread copies the shared weights into a
second private buffer whenever the server's clock has moved, and ``step()``
swaps that buffer in by re-pointing the parameters, so a forward pass never sees
weights change under it, and takes the job's merged buffers with it; both
hand-offs are then queues of one, as in GaDei.

With ``pull="view"`` there is no pull at all: the parameters are read-only views
of the shared weights themselves, as in torch's Hogwild example, so the model
always computes on the newest weights, and a forward pass may see an update land
halfway through it.

The ``Learner`` is put together from one part per role, each its own module
and base class: ``Connection`` (learner/connection.py: bring the job to READY,
claim a slot, reconnect, unmap), ``Layout`` (learner/layout.py: the private
buffers over the job's spec, the model's buffers), ``Weights`` and the pull
modes (learner/pull.py), ``Pushing`` (learner/push.py: gradients into the ring,
the waits after a push) and ``Waves`` (learner/waves.py: ``--push-every`` and
``--predict``). This module holds the learner itself: its construction, the
choice of its pull mode and of the native ``Stepper``, ``step()`` and ``close()``.
"""

from __future__ import annotations

import collections
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from psd import _native
from psd.arena import ArenaWatch, arena_spec, default_job, open_job
from psd.choices import PULL_MODES
from psd.errors import Error, ServerGone, SlotLost, SpecError, StateError  # noqa: F401 (re-exported, below)
from psd.learner.connection import Connection
from psd.learner.layout import Layout
from psd.learner.pull import InlinePull, Pull, ThreadPull, ViewPull, Weights
from psd.learner.push import Pushing
from psd.learner.resume import _env_rank
from psd.learner.sharpness import SharpnessProbe
from psd.learner.waves import STALENESS_WINDOW, Waves
from psd.state import buffers_view, model_spec, state_dict_of, weights_view

__all__ = ["Learner", "pull_state_dict"]
# ServerGone and SpecError, which a learner raises from its parts, stay reachable as psd.learner.client.X.

log = logging.getLogger("psd.learner")

# Models up to this size pull between steps, in the training thread; larger ones in a native thread,
# where a core is left for it (pull_thread_has_a_core).
INLINE_PULL_BYTES = 256 * 1024


class Learner(Connection, Layout, Weights, Pushing, Waves):
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
        self.sharpness = SharpnessProbe([p for p in model.parameters() if p.requires_grad], module=model)
        self._watch = ArenaWatch(self.job, role="learner")  # this learner's mapping, adopted by _connect
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

    # -- copying, mapping ----------------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copying or pickling is refused with what to do instead: a learner holds a slot of a live job."""
        raise TypeError(f"a psd Learner cannot be copied or pickled: it holds a learner slot of job {self.job!r} "
                        f"and views of its shared memory. Attach the copy of the model itself "
                        f"(psd.learner.attach(model_copy, job=...)), or save the model's state_dict")

    def _plain(self) -> bool:
        """Whether this is a CPU ``Learner`` itself, not a subclass (``DeviceLearner``, whose steps are its own):
        the native ``Stepper``, pulls of the changed rows and the push of an open wave at close are its alone."""
        return type(self) is Learner

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
        # a thread. Larger ones under the hand-off (--overlap) use the native pull thread (it never waits for
        # the GIL): step() asks it for a pull and, at the next step, takes the buffer it filled if the
        # clock had moved. A learner that waits for its own update pulls once it is applied, so nothing
        # is left for a thread to do beside the step.
        if self.pull_mode == "view":
            self._pull = ViewPull(self)
        elif (n * 4 > INLINE_PULL_BYTES and not self._rows_pull and not self.partial and not self.waits_for_own
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
                or not self._plain()):
            return
        front = None if self.pull_mode == "view" else self._bufs[self._front].numpy()
        self._stepper = self._arena.stepper(self.slot, tuple(self._train), self.dtype, self._dtype_code,
                                            torch.strided, front, self._store, self.waits_for_own,
                                            self._claim_token)

    # -- a step ---------------------------------------------------------------

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
        self._measure_if_due(closure)
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
                else:  # the ring is full, or the push is not applied yet: wait (_after_push), then pull
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

    def _measure_if_due(self, closure: Callable[[], Any] | None) -> None:
        """``step``'s measurement: with a closure, in a job that uses it, on the probe's schedule."""
        if closure is not None and self.measures_sharpness and self.sharpness.due():
            self.measure_sharpness(closure)

    # -- detaching ----------------------------------------------------------

    def close(self, flush: bool = True) -> None:
        """Detach: push an unfinished ``--push-every`` wave's mean and wait for every pushed gradient to be
        applied (if ``flush``), free the slot, unmap."""
        if self._closing:
            return
        self._closing = True
        if self._watch.arena is None:
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
