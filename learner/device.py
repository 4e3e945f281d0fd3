"""GPU learners: GaDei's on-device double buffering, on CUDA streams.

A model on a GPU stays there. Each ``step()``:

1. the gradient is already in an on-device staging buffer (every ``p.grad`` is
   a view of it, so backward writes it there; no gather);
2. a copy of that buffer into the next free ring entry is queued on the *push*
   stream, after an event that marks the end of backward; the push thread
   waits for the copy's event and only then advances the ring's tail, so the
   server never sees a half-copied gradient. The next backward writes the
   other staging buffer at once: the compute stream waits (on the GPU, never
   the CPU) only if that buffer's previous copy is still in flight;
3. when the server's clock has moved, a copy of the shared weights into the
   back weight buffer is queued on the *pull* stream; once its event completed,
   ``step()`` swaps it in by re-pointing the parameters (no copy), and the
   compute stream waits for that event on the GPU.

The arena's weights and this learner's ring entries are registered as pinned
host memory (cudaHostRegister), so the copies are DMA straight between the GPU
and shared memory. The same state machine runs on the CPU with ``SyncStreams``
(every copy complete at once), which is how it is tested without a GPU.

A partial learner (``partial=True``: a pipeline stage) keeps its own tensors
alone on the device, packed (``Layout._own_runs``): pulls copy its own runs of
the shared weights, pushes copy each gradient run into its place in the ring
entry and publish it with the other tensors marked absent (``psd_push_present``),
and only its own spans of the arena are registered as pinned memory.
"""

from __future__ import annotations

import logging
import math
import queue
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from psd.errors import Error, SpecError
from psd.learner.client import Learner
from psd.state import split

__all__ = ["CudaStreams", "DeviceLearner", "DevicePipe", "SyncStreams", "check_device", "streams_for"]

log = logging.getLogger("psd.learner")


class SyncStreams:
    """The CPU stand-in for CUDA streams: copies happen when issued, events are always complete."""

    device = torch.device("cpu")
    compute = push = pull = None
    weights_pinned = True  # whether copies from the shared weights are DMA (else a pinned bounce buffer)

    class _Done:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    def record(self, stream) -> SyncStreams._Done:
        return self._Done()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        dst.copy_(src)

    def wait(self, stream, event) -> None:
        pass

    def register(self, buf, regions: list[tuple[int, int, bool]]) -> None:
        pass

    def unregister(self, buf) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaStreams:
    """A compute stream (the device's current one), and side streams for pushes and pulls."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.push = torch.cuda.Stream(device)
        self.pull = torch.cuda.Stream(device)
        self._registered: list[int] = []
        self.weights_pinned = True  # False once registering the weights failed: pulls then stage them

    def record(self, stream) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def register(self, buf, regions: list[tuple[int, int, bool]]) -> None:
        """Pin regions of the arena mapping in place, (offset, bytes, read_only) each: copies then DMA with
        no bounce buffer. A learner maps most of the arena read-only, so the weights are registered
        read-only (cudaHostRegisterReadOnly) and only its own slot writable."""
        base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        self.weights_pinned = True
        for offset, size, read_only in regions:
            page = 4096
            lo, hi = offset // page * page, -(-(offset + size) // page) * page
            flags = 8 if read_only else 0  # cudaHostRegisterReadOnly
            rc = torch.cuda.cudart().cudaHostRegister(base + lo, hi - lo, flags)
            if int(rc) != 0 and read_only:
                rc = torch.cuda.cudart().cudaHostRegister(base + lo, hi - lo, 0)  # no read-only support
            if int(rc) != 0:
                log.warning("cudaHostRegister of the arena's %s (%d bytes) failed with CUDA error %d; %s",
                            "weights" if read_only else "ring", hi - lo, int(rc),
                            "pulls stage them through a pinned bounce buffer" if read_only else
                            "gradient copies into it block the push thread (pageable memory)")
                if read_only:
                    self.weights_pinned = False
                continue
            self._registered.append(base + lo)

    def unregister(self, buf) -> None:
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()

    def synchronize(self) -> None:
        self.push.synchronize()
        self.pull.synchronize()
        self.compute.synchronize()


def check_device(device: torch.device) -> None:
    """Raise an Error saying what to do if a learner cannot train on ``device``."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise Error(f"a learner on {device} needs a CUDA build of PyTorch and a visible GPU "
                    f"(torch {torch.__version__} reports none): install torch for your CUDA version "
                    f"(https://pytorch.org/get-started/locally/), or train on the CPU")
    if device.type not in ("cpu", "cuda"):
        raise Error(f"psd learners run on the CPU or a CUDA device, not {device}")


def _page_runs(spans: list[tuple[int, int]], page: int = 4096) -> list[tuple[int, int]]:
    """Byte ``spans`` (offset, size) widened to whole pages, sorted, and those that share a page merged:
    (offset, size) each, disjoint (a page registered twice is an error)."""
    out: list[tuple[int, int]] = []
    for off, size in sorted(spans):
        if size <= 0:
            continue
        lo, hi = off // page * page, -(-(off + size) // page) * page
        if out and lo <= out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][0] + out[-1][1], hi) - out[-1][0])
        else:
            out.append((lo, hi - lo))
    return out


def streams_for(device: torch.device):
    """CUDA streams for a CUDA device, the synchronous stand-in for the CPU."""
    check_device(device)
    return SyncStreams() if device.type == "cpu" else CudaStreams(device)


class _Staged:
    """A pull through the bounce buffer: done once the helper thread queued the copy and the copy completed."""

    def __init__(self, future: Future) -> None:
        self.future = future

    @property
    def event(self):
        return self.future.result()

    def query(self) -> bool:
        return self.future.done() and self.future.result().query()

    def synchronize(self) -> None:
        self.future.result().synchronize()


class DevicePipe:
    """The double-buffered push and pull pipeline of one learner whose model lives on ``streams.device``.

    ``entries`` are the host tensors of the learner's ring entries (the job's trainable elements) and
    ``weights`` the shared weights (both over the arena); ``publish(index, clock, batch, loss)`` advances
    the ring's tail past entry ``index`` (called by the push thread, in order, once the copy is complete).
    The caller makes sure entry ``index`` is free before ``push``.

    On the device the learner's weights are ``n`` elements (twice: front and back) and its gradients
    ``n_grad`` (twice: the staging buffers), packed: ``pulls`` lists the runs a pull copies, (offset in
    ``weights``, offset in the device buffer, length), and ``pushes`` the runs a push copies, (offset in
    an entry, offset in the staging buffer, length). By default the whole model, one run each (a partial
    learner's own tensors: ``Layout._own_runs``).
    """

    def __init__(self, streams, n: int, entries: list[torch.Tensor], weights: torch.Tensor, publish,
                 n_grad: int | None = None, *, pulls: list[tuple[int, int, int]] | None = None,
                 pushes: list[tuple[int, int, int]] | None = None) -> None:
        self.s = streams
        dev = streams.device
        self.entries, self.weights, self._publish = entries, weights, publish
        g = n if n_grad is None else n_grad  # gradients cover the trainable weights, a prefix of the n
        self.n, self.n_grad = n, g
        self.pulls = [(0, 0, n)] if pulls is None else pulls
        self.pushes = [(0, 0, g)] if pushes is None else pushes
        if sum(r[2] for r in self.pulls) != n or sum(r[2] for r in self.pushes) != g:
            raise ValueError(f"the runs copied ({sum(r[2] for r in self.pulls)} weights, "
                             f"{sum(r[2] for r in self.pushes)} gradients) are not the device buffers' "
                             f"{n} and {g} elements")
        self.grad = [torch.zeros(g, device=dev), torch.zeros(g, device=dev)]  # staging, double-buffered
        self.w = [torch.empty(n, device=dev), torch.empty(n, device=dev)]  # weights: front / back
        self.cur = 0  # staging buffer the next backward writes
        self.front = 0
        self._grad_copied = [None, None]  # event: that staging buffer's push copy finished
        self._front_released = None  # event: the compute stream is done with the buffer now at the back
        self._pull = None  # (event, clock) of a pull in flight into the back buffer
        self.issued = 0  # ring entries whose copy was queued
        # Weights that could not be registered as pinned memory: a pull copies them into a pinned bounce
        # buffer on a helper thread (a copy from pageable memory would block this thread for all of it),
        # which then queues the copy to the device. One pull is in flight at a time, and the next starts
        # only after the last one's copy to the device completed, so one bounce buffer does.
        self._bounce = self._stager = None
        if not getattr(streams, "weights_pinned", True):
            self._bounce = torch.empty(n, pin_memory=dev.type == "cuda")
            self._stager = ThreadPoolExecutor(1, thread_name_prefix="psd-stage")
        self._queue: queue.Queue = queue.Queue()
        self._done = threading.Condition()
        self.published = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._pusher, name="psd-push", daemon=True)
        self._thread.start()

    def _gather(self, dst: torch.Tensor, stream) -> None:
        """Queue the copies of the pulled runs of the shared weights into ``dst`` (packed) on ``stream``: one
        copy for a whole model."""
        for src, at, length in self.pulls:
            self.s.copy(dst[at:at + length], self.weights[src:src + length], stream)

    # -- push ---------------------------------------------------------------

    def _pusher(self) -> None:
        """The push thread: wait for each copy's event, then advance the tail, in order."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, index, clock, batch, loss = item
            try:
                event.synchronize()  # releases the GIL while the DMA runs
                self._publish(index, clock, batch, float(loss))
            except BaseException as e:  # surfaced by the next step()
                self.error = e
            with self._done:
                self.published += 1
                self._done.notify_all()

    def push(self, index: int, clock: int, batch: int, loss: float | torch.Tensor) -> None:
        """Queue the copy of the current staging buffer into ring entry ``index`` and switch buffers."""
        if self.error is not None:
            raise self.error
        s, b = self.s, self.cur
        backward_done = s.record(s.compute)
        s.wait(s.push, backward_done)
        entry, staged = self.entries[index % len(self.entries)], self.grad[b]
        for at, src, length in self.pushes:  # each run into its place in the entry (the rest is marked absent)
            s.copy(entry[at:at + length], staged[src:src + length], s.push)
        if isinstance(loss, torch.Tensor):  # to the host on the push stream, read after the event
            host = torch.empty((), dtype=loss.dtype, pin_memory=loss.is_cuda)
            s.copy(host, loss.reshape(()), s.push)
            loss = host
        ev = s.record(s.push)
        self._grad_copied[b] = ev
        self.issued += 1
        self._queue.put((ev, index, clock, batch, loss))
        self.cur = 1 - b
        # The next backward writes the other buffer: on the GPU, after its last copy finished.
        prev = self._grad_copied[self.cur]
        if prev is not None and not prev.query():
            s.wait(s.compute, prev)
        with torch.no_grad():
            self.grad[self.cur].zero_()  # queued on the compute stream, after that wait

    def drain(self, timeout: float, upto: int | None = None) -> None:
        """Wait until every queued gradient (or the first ``upto`` of them) was copied and published; raise
        what the push thread met."""
        n = self.issued if upto is None else upto
        with self._done:
            if not self._done.wait_for(lambda: self.published >= n or self.error is not None, timeout):
                raise Error(f"gradients were not copied off the device within {timeout:g} s")
        if self.error is not None:
            raise self.error

    # -- pull ---------------------------------------------------------------

    def maybe_swap(self) -> int | None:
        """If a pull finished, make its buffer the front; returns its clock (else None)."""
        if self._pull is None:
            return None
        try:
            if not self._pull[0].query():
                return None
        except BaseException:
            self._pull = None  # a staged pull that failed: raised once, and the next pull starts afresh
            raise
        event, clock = self._pull
        self._pull = None
        self.s.wait(self.s.compute, event.event if isinstance(event, _Staged) else event)
        self._front_released = self.s.record(self.s.compute)  # the old front's last reader
        self.front = 1 - self.front
        return clock

    def start_pull(self, clock: int) -> None:
        """Queue a copy of the shared weights (at ``clock`` or newer) into the back buffer."""
        if self._pull is not None:
            return
        s = self.s
        if self._front_released is not None:
            s.wait(s.pull, self._front_released)  # kernels still reading it came first
        dst = self.w[1 - self.front]
        if self._bounce is None:
            self._gather(dst, s.pull)
            self._pull = (s.record(s.pull), clock)
        else:
            self._pull = (_Staged(self._stager.submit(self._stage, dst)), clock)

    def _stage(self, dst: torch.Tensor):
        """Helper thread: the shared weights into the bounce buffer (torch's copy lets go of the GIL), then
        the bounce buffer to ``dst`` on the pull stream; returns that copy's event."""
        for src, at, length in self.pulls:
            self._bounce[at:at + length].copy_(self.weights[src:src + length])
        self.s.copy(dst, self._bounce, self.s.pull)
        return self.s.record(self.s.pull)

    def pull_now(self) -> None:
        """Copy the shared weights into the front buffer, synchronously."""
        if self._pull is not None:
            self._pull[0].synchronize()
            self._pull = None
        self.s.synchronize()  # nothing queued still reads the front buffer
        for src, at, length in self.pulls:
            self.w[self.front][at:at + length].copy_(self.weights[src:src + length])

    def close(self) -> None:
        if self._stager is not None:
            self._stager.shutdown(wait=True)
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.s.synchronize()


class DeviceLearner(Learner):
    """A learner whose model stays on its device (a GPU): pushes and pulls on side streams.

    ``step()`` queues the copy of the gradient (already in an on-device staging buffer) into the
    ring on the push stream and returns; the push thread advances the ring's tail once the copy
    completed. Weights come back on the pull stream into a second on-device buffer that ``step()``
    swaps in when its copy has completed. See psd.learner.device. ``streams`` (tests): the stream
    implementation, by default CUDA streams for a CUDA model and the synchronous stand-in for CPU.
    ``partial=True`` (passed on to ``Learner``): a module holding some of the job's tensors, whose device
    buffers hold those alone.
    """

    HAND_OFF = True  # its step pulls right after the push, --overlap or not (docs/training.md)

    def __init__(self, model: torch.nn.Module, job: str | None = None, *, streams=None, **kw) -> None:
        dev = next(iter(model.parameters())).device
        dtype = next(iter(model.parameters())).dtype
        if dtype != torch.float32:
            raise SpecError(f"a learner on {dev} trains a float32 model for now (this one is {dtype}): call "
                            f"model.float() and train with torch.autocast for bfloat16 / float16 speed")
        self._streams = streams if streams is not None else streams_for(dev)
        self._pipe = None
        super().__init__(model, job, **kw)
        if self.predict:
            log.warning("job %r: --predict is not applied by learners on %s yet; this one trains on the "
                        "pulled weights", self.job, dev)
            self.predict = False

    def _map_buffers(self) -> None:
        a = self._arena
        h = self._map_shared()
        self._entries = [torch.frombuffer(a, dtype=torch.float32, count=self.n_train,
                                          offset=a.grad_offset(self.slot, k)) for k in range(self._k)]
        # Buffer deltas, one per ring entry: the push thread publishes them with their gradient (a partial
        # learner without buffers of its own pushes none).
        self._buffers_pushed = bool(self.n_buffers) and not (self.partial and self._buf_range is None)
        self._bstages = [torch.empty(self.n_buffers, dtype=torch.float64) for _ in range(self._k)]
        # What lives on the device: the whole model, or a partial learner's own tensors alone, packed
        # (Layout._own_runs: its trainable ones first, the frozen ones after them).
        pulls = self._own_runs()
        pushes = self._own_runs(frozen=False)  # (offset in an entry, in the staging buffer, length)
        present = self._present if self._present is not None else [True] * len(self._wspec)
        self._dev_params = [p for p, mine in zip(self._params, present, strict=True) if mine]
        self._dev_train = [p for p, mine in zip(self._train, present[:self.n_pieces], strict=True) if mine]
        own = [p for p, mine in zip(self._wspec, present, strict=True) if mine]
        if self.partial:
            # Its tensors' places in the ring: the push marks the others absent (psd_push_present).
            self._push_pieces = (bytes(present[:self.n_pieces]), struct.pack(f"={self.n_pieces}Q", *self._numels))
        else:
            self._push_pieces = (None, None)
        self._streams.register(a, self._pinned_regions(h, pulls, pushes))
        self._pipe = p = DevicePipe(self._streams, sum(r[2] for r in pulls), self._entries, self._weights,
                                    self._publish, sum(r[2] for r in pushes), pulls=pulls, pushes=pushes)
        self._tail = a.tail(self.slot)
        self.clock = a.clock()
        p.pull_now()
        self._pull_buffers()
        self._staging_views = [split(g, own[:len(self._dev_train)]) for g in p.grad]
        self._w_views = [split(w, own) for w in p.w]
        self._point_device()
        self._arm_device()
        self._pull = None  # its own pull path (DevicePipe)

    def _pinned_regions(self, h: dict, pulls: list[tuple[int, int, int]],
                        pushes: list[tuple[int, int, int]]) -> list[tuple[int, int, bool]]:
        """The parts of the arena the copies read and write, (offset, bytes, read_only) each, to register as
        pinned memory: this learner's slot and the weights; for a partial learner only its own tensors' spans
        of the weights and of each ring entry, whole pages, so that the pages of the others' are never
        touched (registering locks them in memory)."""
        if not self.partial:
            return [(h["slots_off"] + self.slot * h["slot_stride"], h["slot_stride"], False),
                    (h["weights_off"], h["weights_bytes"], True)]
        a = self._arena
        weights = [(h["weights_off"] + 4 * off, 4 * length) for off, _, length in pulls]
        ring = [(a.grad_offset(self.slot, k) + 4 * off, 4 * length) for k in range(self._k)
                for off, _, length in pushes]
        return [(lo, size, True) for lo, size in _page_runs(weights)] + \
               [(lo, size, False) for lo, size in _page_runs(ring)]

    def _publish(self, index: int, clock: int, batch: int, loss: float) -> None:
        """Push thread: the copy into entry ``index`` is complete; advance the tail past it."""
        delta = self._bstages[index % self._k].data_ptr() if self._buffers_pushed else None
        self._arena.push(self.slot, clock, batch, loss, 1.0, delta, *self._push_pieces)

    def _point_device(self) -> None:
        with torch.no_grad():
            for p, v in zip(self._dev_params, self._w_views[self._pipe.front], strict=True):
                p.data = v

    def _arm_device(self) -> None:
        for prm, v in zip(self._dev_train, self._grad_views(), strict=True):
            prm.grad = v
        self.note_armed()

    def note_armed(self) -> None:
        """Remember the staging buffer's version: a step that finds it unchanged (no backward wrote
        into it since) carries no gradient. ``Optimizer.zero_grad()`` calls it after zeroing."""
        self._armed_version = self._pipe.grad[self._pipe.cur]._version

    def _grad_views(self) -> list[torch.Tensor]:
        """Where the next gradient goes: the current on-device staging buffer."""
        return self._staging_views[self._pipe.cur]

    def _collect(self, add: bool) -> bool:
        """Bring gradients that are not where they go (user reset p.grad) into the staging buffer; with
        ``add`` (a --push-every wave goes on) add them to what it holds. Returns whether there was any."""
        got = False
        written = self._pipe.grad[self._pipe.cur]._version != self._armed_version  # views share the version
        for p, v in zip(self._dev_train, self._grad_views(), strict=True):
            g = p.grad
            if g is None:
                if not add:
                    v.zero_()
                continue
            if g.data_ptr() == v.data_ptr():
                got = got or written
            else:
                got = True
                g = g.to_dense() if g.layout != torch.strided else g
                v.add_(g) if add else v.copy_(g)
        return got

    def _unmap(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
            self._streams.unregister(self._arena)
            self._pipe = None
        self._staging_views = self._w_views = None
        super()._unmap()

    def step(self, loss: float | torch.Tensor | None = None, batch_size: int = 1, *,
             only: tuple[int, ...] | None = None, closure: Callable[[], Any] | None = None) -> None:
        """As ``Learner.step``, without waiting for the copies (see the class docstring); ``only`` must
        be None (every trained tensor) on a device learner."""
        if only is not None:
            raise Error("a learner on a device steps all of its model's parameters at once (only=None)")
        if self._closing:
            raise Error("this learner is detached; attach again to keep training")
        self._measure_if_due(closure)
        if not self._collect(add=self._wave > 0):
            return  # no gradient at all: no update
        # A loss tensor stays on the device (float() would wait for the GPU); the push thread reads it.
        lv = math.nan if loss is None else (loss.detach() if isinstance(loss, torch.Tensor) else float(loss))
        wave = self._end_of_wave(lv, batch_size)
        if wave is None:
            # The wave's sum stays in the staging buffer: the next backward writes fresh gradients (a
            # zero_grad() in between cannot touch the sum), and the next step adds them in.
            for p in self._dev_train:
                p.grad = None
            return
        lv, batch_size, size = wave
        a, pipe = self._arena, self._pipe
        if size > 1:
            with torch.no_grad():
                pipe.grad[pipe.cur].mul_(1.0 / size)  # the wave's mean, on the device
        if self._tail - a.head(self.slot) >= self._k:  # the entry to copy into is not free yet
            # Wait for the server to take that entry alone: its copy is the oldest in flight. Waiting for
            # every copy to land (as a CPU learner's full ring does) would wait for the GPU to finish all
            # the work queued ahead of it, and the GPU would then sit idle while the server catches up.
            # First that copy's publication (what the push thread met on the way is raised here, not
            # left to look like a server that never took the entry).
            pipe.drain(self.timeout, upto=pipe.issued - self._k + 1)  # entry tail - k: push issued - k + 1
            self._with_server(a.wait_head, self.slot, self._claim_token, self._tail - self._k + 1, self.timeout)
            if self._arena is not a:
                return
        rounds = a.rounds() if self.sync == "bsp" else 0
        if self._buffers_pushed:
            self._buffer_delta()
            self._bstages[self._tail % self._k].copy_(self._bdelta)
        pipe.push(self._tail, self.clock, int(batch_size), lv)
        self._tail += 1
        self.pushed += 1
        self._arm_device()
        if self.sync in ("bsp", "ssp"):
            pipe.drain(self.timeout)  # the server must see the gradient before anyone waits on it
            if self.sync == "bsp":
                self._wait_sync(a.wait_round, "the bsp round", self.slot, self._claim_token, rounds)
                self.pull()
                return
            self._wait_sync(a.wait_ssp, "the ssp bound", self.slot, self._claim_token)
        clock = pipe.maybe_swap()
        if clock is not None:
            self.clock = clock
            self.pulled_bytes += 4 * pipe.n
            self._point_device()
            self._pull_buffers()
            a.note_pull(self.slot, clock, False)
        current = a.clock()
        if current != self.clock:
            pipe.start_pull(current)

    def pull(self) -> int:
        """Copy the current shared weights into the model now; returns their clock."""
        clock = self._arena.clock()
        self._pipe.pull_now()
        self.pulled_bytes += 4 * self._pipe.n
        self.clock = clock
        self._pull_buffers()
        self._arena.note_pull(self.slot, clock, False)
        return clock

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every gradient left the device and the server applied it."""
        if self._pipe is not None:
            self._pipe.drain(self.timeout if timeout is None else timeout)
        super().flush(timeout)
