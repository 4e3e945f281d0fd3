"""GPU learners: the double-buffered push/pull state machine, on the CPU and (where one exists) a GPU.

On the CPU the pipeline runs with stand-ins for CUDA streams: SyncStreams (every copy complete at
once) and, to see the states in between, DeferredStreams, whose copies happen only when the test
completes them, as a GPU's would when its DMA finishes. The servers run without a watchdog: nothing here
needs one, and its last checkpoint costs seconds at each stop.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch

from psd import learner
from psd.errors import Error
from psd.learner.device import DeviceLearner, DevicePipe, SyncStreams


class DeferredStreams(SyncStreams):
    """Copies are queued; ``complete()`` carries them out and marks their events done."""

    def __init__(self) -> None:
        self.pending: list = []

    class _Event:
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            deadline = time.monotonic() + 30
            while not self.done:  # the test thread completes it
                assert time.monotonic() < deadline, "a copy never completed"
                time.sleep(0.001)

    def copy(self, dst, src, stream) -> None:
        self.pending.append((dst, src.clone(), None))

    def record(self, stream):
        ev = self._Event()
        if self.pending and self.pending[-1][2] is None:
            dst, src, _ = self.pending[-1]
            self.pending[-1] = (dst, src, ev)
        else:
            ev.done = True  # an event after no copy: complete
        return ev

    def complete(self, count: int | None = None) -> None:
        """Carry out the queued copies, or the oldest ``count`` of them (and the events after each)."""
        n = len(self.pending) if count is None else count
        for dst, src, ev in self.pending[:n]:
            dst.copy_(src)
            if ev is not None:
                ev.done = True
        del self.pending[:n]

    def synchronize(self) -> None:
        self.complete()


def tiny():
    torch.manual_seed(0)
    return torch.nn.Linear(5, 3), torch.randn(4, 5)


def test_gradients_pushed_equal_gradients_computed_bit_for_bit(job, serve):
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.1", "--ring-depth", "4")
    model, x = tiny()
    with learner.attach(model, job=job, device="cpu") as ps:  # a plain learner on the CPU...
        assert type(ps) is learner.Learner
    model, x = tiny()
    with DeviceLearner(model, job) as ps:  # ... and the device pipeline, with synchronous copies
        for t in range(12):
            (model(x) ** 2).sum().backward()
            computed = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
            ps.step()
            ps._pipe.drain(10)
            assert torch.equal(ps._entries[t % ps._k], computed), f"gradient {t} changed on its way"
        ps.flush()
        assert ps._arena.counters()["applied"] == 12
    served.stop()


def test_tail_waits_for_the_copy_and_weights_swap_only_when_whole(job, serve):
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.5")
    model, x = tiny()
    streams = DeferredStreams()
    ps = DeviceLearner(model, job, streams=streams)
    try:
        w0 = model.weight.detach().clone()
        (model(x) ** 2).sum().backward()
        ps.step()  # returns with the copy still in flight
        assert ps._arena.tail(ps.slot) == 0, "the tail moved before the gradient was copied"
        assert (ps._pipe.issued, ps._pipe.published) == (1, 0)
        streams.complete()
        ps.flush()  # published and applied: the server's clock is 1, the learner's 0
        assert ps._arena.tail(ps.slot) == 1 and ps._arena.clock() == 1
        (model(x) ** 2).sum().backward()
        ps.step()  # queues a pull into the back buffer; the model keeps training on the front one
        assert ps._pipe._pull is not None
        assert torch.equal(model.weight.detach(), w0), "weights changed while their copy was in flight"
        assert ps.clock == 0
        streams.complete()  # the pull lands in the back buffer, whole
        ps.flush()
        (model(x) ** 2).sum().backward()
        ps.step()  # the pull completed: swapped in by re-pointing the parameters
        assert ps.clock == 1
        at_two = learner.pull_state_dict(job)  # the server is at clock 2; the model holds clock 1
        assert not torch.equal(model.weight.detach(), w0)
        assert not torch.equal(model.weight.detach(), at_two["weight"])
        model2, _ = tiny()
        (model2(x) ** 2).sum().backward()
        expected = w0 - 0.5 * model2.weight.grad
        assert torch.equal(model.weight.detach(), expected), "the swapped-in weights are those of clock 1"
    finally:
        streams.complete()
        ps.close()
    served.stop()


def test_a_full_ring_waits_for_the_oldest_copy_alone(job, serve):
    """A device learner whose ring is full waits for its oldest copy to land and be taken, not for all of
    them: copies still in flight behind it (GPU work queued ahead) do not hold the next step back."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.1", "--ring-depth", "4")
    model, x = tiny()
    streams = DeferredStreams()
    ps = DeviceLearner(model, job, streams=streams, timeout=30)
    try:
        for _ in range(4):  # four copies queued, none landed: the ring is full from the learner's side
            (model(x) ** 2).sum().backward()
            ps.step()
        assert (ps._pipe.issued, ps._pipe.published) == (4, 0)
        done = threading.Event()

        def fifth() -> None:
            (model(x) ** 2).sum().backward()
            ps.step()
            done.set()

        t = threading.Thread(target=fifth)
        t.start()
        assert not done.wait(0.3), "a step found room in a ring whose every entry is still being copied"
        streams.complete(1)  # the oldest copy lands; the server takes it
        assert done.wait(20), "the step waited for more than the oldest copy"
        t.join()
        assert (ps._pipe.issued, ps._pipe.published) == (5, 1)  # three old copies and the new one in flight
        streams.complete()
        ps.flush()
        assert ps._arena.counters()["applied"] == 5
    finally:
        streams.complete()
        ps.close()
    served.stop()


def test_a_full_ring_raises_what_the_push_thread_met_at_once(job, serve):
    """The oldest copy's publication failed (a CUDA error, say): the step that waits for its entry raises
    that error, instead of waiting out the timeout for a server that can never take the entry."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.1", "--ring-depth", "4")
    model, x = tiny()
    streams = DeferredStreams()
    ps = DeviceLearner(model, job, streams=streams, timeout=30)
    try:
        for _ in range(4):
            (model(x) ** 2).sum().backward()
            ps.step()

        def broken(*args) -> None:
            raise RuntimeError("the copy's event reported an error")

        ps._pipe._publish = broken
        streams.complete(1)  # the oldest copy lands; publishing it fails
        (model(x) ** 2).sum().backward()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="event reported an error"):
            ps.step()
        assert time.monotonic() - t0 < 10, "the error waited for the timeout"
    finally:
        streams.complete()
        ps._pipe.error = None
        ps.close(flush=False)
    served.stop()


class BounceStreams(SyncStreams):
    """Synchronous copies, as if registering the shared weights as pinned memory had failed."""

    weights_pinned = False


def test_unpinned_weights_are_pulled_through_the_bounce_buffer_whole():
    n = 1000
    weights = torch.arange(n, dtype=torch.float32)
    pipe = DevicePipe(BounceStreams(), n, [torch.zeros(n)], weights, lambda *a: None)
    try:
        assert pipe._bounce is not None
        pipe.start_pull(5)
        event, clock = pipe._pull
        event.synchronize()  # the helper thread staged the weights and copied them on
        at_pull = weights.clone()
        weights.add_(1)  # the server moves on: a pull that already happened does not see it
        assert pipe.maybe_swap() == 5 and clock == 5
        assert torch.equal(pipe.w[pipe.front], at_pull)
        pipe.start_pull(6)
        pipe._pull[0].synchronize()
        weights.add_(1)
        pipe.pull_now()  # takes the pull in flight off the books, then copies the current weights
        assert pipe._pull is None and pipe.maybe_swap() is None  # the staged pull is not swapped in later
        assert torch.equal(pipe.w[pipe.front], weights)
    finally:
        pipe.close()


@pytest.mark.parametrize("streams", [SyncStreams, BounceStreams])
def test_a_pipe_of_some_tensors_copies_their_runs_alone(streams):
    """A partial learner's pipe: the device holds the pulled runs packed, a pull copies them alone (also through
    the bounce buffer), and a push puts each gradient run in its place in the entry and writes nothing else."""
    weights = torch.arange(100, dtype=torch.float32)
    entry = torch.full((60,), -1.0)
    pulls, pushes = [(10, 0, 5), (50, 5, 20)], [(10, 0, 5), (40, 5, 3)]
    with pytest.raises(ValueError, match="not the device buffers' 24 and 8 elements"):
        DevicePipe(streams(), 24, [entry], weights, lambda *a: None, 8, pulls=pulls, pushes=pushes)
    published = []
    pipe = DevicePipe(streams(), 25, [entry], weights, lambda *a: published.append(a), 8, pulls=pulls,
                      pushes=pushes)
    try:
        assert [w.numel() for w in pipe.w] == [25, 25] and [g.numel() for g in pipe.grad] == [8, 8]
        pipe.pull_now()
        assert torch.equal(pipe.w[pipe.front], torch.cat([weights[10:15], weights[50:70]]))
        weights.add_(1000)
        pipe.start_pull(3)
        pipe._pull[0].synchronize()
        assert pipe.maybe_swap() == 3
        assert torch.equal(pipe.w[pipe.front], torch.cat([weights[10:15], weights[50:70]]))
        pipe.grad[pipe.cur].copy_(torch.arange(100, 108, dtype=torch.float32))
        pipe.push(0, 3, 1, 0.5)
        pipe.drain(10)
        assert published == [(0, 3, 1, 0.5)]
        expected = torch.full((60,), -1.0)
        expected[10:15], expected[40:43] = torch.arange(100, 105), torch.arange(105, 108)
        assert torch.equal(entry, expected)
    finally:
        pipe.close()


def test_the_pages_to_pin_are_whole_and_each_once():
    from psd.learner.device import _page_runs

    spans = [(8192 + 100, 40), (4096 * 5, 4096), (8192 + 4000, 200), (0, 0), (4096 * 6 - 4, 8)]
    assert _page_runs(spans) == [(8192, 8192), (4096 * 5, 8192)]


@pytest.mark.parametrize("streams", [SyncStreams, BounceStreams])
def test_a_device_learner_trains_a_real_model(job, serve, streams):
    from psd.workloads import evaluate, make_classification, make_mlp, shard

    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.02", "--optimizer", "momentum")
    data = make_classification(0)
    x, y = shard(data, 0, 1)
    model = make_mlp(data.dim, data.classes)
    with DeviceLearner(model, job, streams=streams()) as ps:
        assert (ps._pipe._bounce is not None) == (streams is BounceStreams)
        for i in range(0, len(x), 8):
            torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).backward()
            ps.step()
        ps.flush()
        ps.pull()
        acc = evaluate(model, data)
    print(f"one epoch through the device pipeline: accuracy {acc:.4f}")
    assert acc > 0.9
    served.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_cuda_device_without_cuda_says_what_to_install(job):
    with pytest.raises(Error, match="CUDA build of PyTorch"):
        learner.attach(torch.nn.Linear(2, 2), job=job, device="cuda:0")


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@needs_gpu
def test_gpu_gradients_arrive_bit_for_bit(job, serve):
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.1")
    model, x = tiny()
    model, x = model.cuda(), x.cuda()
    with learner.attach(model, job=job) as ps:
        assert isinstance(ps, DeviceLearner)
        for t in range(20):
            (model(x) ** 2).sum().backward()
            computed = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()
            ps.step()
            ps._pipe.drain(10)
            assert torch.equal(ps._entries[t % ps._k], computed)
    served.stop()


@needs_gpu
def test_gpu_step_does_not_wait_for_its_copies(job, serve):
    """A step hands the gradient's copy to the host to a side stream and returns: while the ring has room,
    ``step()`` takes well under what that copy takes (a step that waited for it would take at least as
    long). Step time against no communication at all depends on the host's memory speed (the server's update
    of 16.8M weights); it is a benchmark figure with its target, benchmarks/gpu_job.py, not asserted here."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.001")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()  # 16.8M params
    x = torch.randn(4096, 2048, device="cuda")
    n = sum(p.numel() for p in model.parameters())
    dev, host = torch.empty(n, device="cuda"), torch.empty(n, pin_memory=True)
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    copy = (time.perf_counter() - t0) / 5
    in_step: list[float] = []
    with learner.attach(model, job=job) as ps:
        for _ in range(6):
            ps.flush()  # the ring empty: its k - 1 next steps find room
            for _ in range(ps._k - 1):
                model(x).square().mean().backward()
                torch.cuda.synchronize()  # the gradient is there: what step() costs is step() alone
                t0 = time.perf_counter()
                ps.step()
                in_step.append(time.perf_counter() - t0)
        ps.flush()
    step = statistics.median(in_step)
    print(f"step() {step * 1e3:.3f} ms (median of {len(in_step)}), the gradient's copy {copy * 1e3:.3f} ms")
    assert step < 0.5 * copy, f"step() took {step * 1e3:.3f} ms, the copy it should not wait for {copy * 1e3:.3f}"
    served.stop()


class GpuStageNet(torch.nn.Module):
    """A small layer, a wide one (4 MB), then BatchNorm twice: a stage of ``a`` and ``a_bn`` holds two runs of
    the job's trainable weights (the wide layer between them) and some of its statistics (``z_bn``'s are
    another stage's: stand-ins on the CPU beside its own on the GPU)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 64)
        self.wide = torch.nn.Linear(1024, 1024)
        self.a_bn = torch.nn.BatchNorm1d(64)
        self.z_bn = torch.nn.BatchNorm1d(8)


@needs_gpu
def test_gpu_stage_holds_pushes_and_pulls_its_own_tensors_alone(job, serve):
    """attach(stage.cuda(), partial=True) is a DeviceLearner on the GPU: it takes device memory for its own
    tensors alone (weights and gradient staging, twice each), its gradients arrive in their places of the
    entry bit for bit, the wide layer it does not hold is never stepped, its BatchNorm statistics on the
    GPU become the job's, and a pull brings the job's weights of its own tensors to the GPU."""
    served = serve(job, "--no-watchdog", "--learners", "3", "--lr", "0.5")
    with learner.attach(GpuStageNet(), job=job):  # declares the job's model (on the CPU)
        part = GpuStageNet()
        del part.wide, part.z_bn
        part.cuda()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with learner.attach(part, job=job, partial=True) as s:
            assert isinstance(s, DeviceLearner) and s.partial and s._pipe.w[0].is_cuda
            own = sum(p.numel() for p in part.parameters())
            assert [t.numel() for t in (*s._pipe.w, *s._pipe.grad)] == [own] * 4
            assert len(s._pipe.pushes) == 2  # a, then a_bn after the wide layer
            assert [flat.device.type for *_, flat in s._bgroups] == ["cuda", "cpu", "cuda", "cpu"]  # by dtype
            grown = torch.cuda.memory_allocated() - before
            assert grown < 4 * own * 4 + 64 * 1024, f"the stage took {grown} bytes of device memory"
            x = torch.randn(32, 64, device="cuda")
            for t in range(6):
                part.a_bn(part.a(x + t)).square().mean().backward()
                computed = torch.cat([p.grad.reshape(-1) for p in part.parameters()]).cpu()
                s.step()
                s._pipe.drain(10)
                entry = s._entries[t % s._k]
                arrived = torch.cat([entry[off:off + n] for off, _, n in s._pipe.pushes])
                assert torch.equal(arrived, computed), f"gradient {t} changed on its way"
            s.flush()
            theirs = learner.pull_state_dict(job)
            start = GpuStageNet().state_dict()
            for k in ("wide.weight", "z_bn.weight", "z_bn.running_mean", "z_bn.running_var",
                      "z_bn.num_batches_tracked"):
                assert torch.equal(theirs[k], start[k]), k  # the other stage's, untouched
            for k in ("a.weight", "a_bn.bias", "a_bn.running_mean", "a_bn.running_var"):
                assert not torch.equal(theirs[k], start[k]), k
            assert int(theirs["a_bn.num_batches_tracked"]) == 6
            s.pull()
            for k, v in part.state_dict().items():
                assert v.is_cuda and torch.equal(v.cpu(), theirs[k]), k
    served.stop()
