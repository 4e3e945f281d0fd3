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
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from psd.errors import Error

__all__ = ["CudaStreams", "DevicePipe", "SyncStreams", "check_device", "streams_for"]

log = logging.getLogger("psd.learner")


class SyncStreams:
    """The CPU stand-in for CUDA streams: copies happen when issued, events are always complete."""

    device = torch.device("cpu")
    compute = push = pull = None

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
        for offset, size, read_only in regions:
            page = 4096
            lo, hi = offset // page * page, -(-(offset + size) // page) * page
            flags = 8 if read_only else 0  # cudaHostRegisterReadOnly
            rc = torch.cuda.cudart().cudaHostRegister(base + lo, hi - lo, flags)
            if int(rc) != 0 and read_only:
                rc = torch.cuda.cudart().cudaHostRegister(base + lo, hi - lo, 0)  # no read-only support
            if int(rc) != 0:
                log.warning("cudaHostRegister of the arena failed (error %s); copies go through a bounce buffer",
                            int(rc))
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


def streams_for(device: torch.device):
    """CUDA streams for a CUDA device, the synchronous stand-in for the CPU."""
    check_device(device)
    return SyncStreams() if device.type == "cpu" else CudaStreams(device)


class DevicePipe:
    """The double-buffered push and pull pipeline of one learner whose model lives on ``streams.device``.

    ``entries`` are the host tensors of the learner's ring entries (``n_grad`` trainable elements)
    and ``weights`` the shared weights (``n``; both over the arena); ``publish(index, clock, batch,
    loss)`` advances the ring's tail past entry ``index`` (called by the push thread, in order, once
    the copy is complete). The caller makes sure entry ``index`` is free before ``push``.
    """

    def __init__(self, streams, n: int, entries: list[torch.Tensor], weights: torch.Tensor, publish,
                 n_grad: int | None = None) -> None:
        self.s = streams
        dev = streams.device
        self.entries, self.weights, self._publish = entries, weights, publish
        g = n if n_grad is None else n_grad  # gradients cover the trainable weights, a prefix of the n
        self.grad = [torch.zeros(g, device=dev), torch.zeros(g, device=dev)]  # staging, double-buffered
        self.w = [torch.empty(n, device=dev), torch.empty(n, device=dev)]  # weights: front / back
        self.cur = 0  # staging buffer the next backward writes
        self.front = 0
        self._grad_copied = [None, None]  # event: that staging buffer's push copy finished
        self._front_released = None  # event: the compute stream is done with the buffer now at the back
        self._pull = None  # (event, clock) of a pull in flight into the back buffer
        self.issued = 0  # ring entries whose copy was queued
        self._queue: queue.Queue = queue.Queue()
        self._done = threading.Condition()
        self.published = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._pusher, name="psd-push", daemon=True)
        self._thread.start()

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
        s.copy(self.entries[index % len(self.entries)], self.grad[b], s.push)
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

    def drain(self, timeout: float) -> None:
        """Wait until every queued gradient was copied and published."""
        with self._done:
            if not self._done.wait_for(lambda: self.published >= self.issued, timeout):
                raise Error(f"gradients were not copied off the device within {timeout:g} s")
        if self.error is not None:
            raise self.error

    # -- pull ---------------------------------------------------------------

    def maybe_swap(self) -> int | None:
        """If a pull finished, make its buffer the front; returns its clock (else None)."""
        if self._pull is None or not self._pull[0].query():
            return None
        event, clock = self._pull
        self._pull = None
        self.s.wait(self.s.compute, event)
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
        s.copy(self.w[1 - self.front], self.weights, s.pull)
        self._pull = (s.record(s.pull), clock)

    def pull_now(self) -> None:
        """Copy the shared weights into the front buffer, synchronously."""
        if self._pull is not None:
            self._pull[0].synchronize()
            self._pull = None
        self.s.synchronize()  # nothing queued still reads the front buffer
        self.w[self.front].copy_(self.weights)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.s.synchronize()

