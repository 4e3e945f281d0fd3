"""Partial attach: a learner that holds some of the job's parameters (a pipeline stage) pushes and pulls
only its own, matched by full name; anything that is not the job's is refused by name and the job goes on."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from conftest import HELPERS, read_line, spawn
from psd import learner
from psd.errors import SpecError, Timeout
from psd.learner.device import DeviceLearner, SyncStreams


class Net(torch.nn.Module):
    """Three layers with names of their own, as a model split into stages keeps them."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 2)
        self.to(dtype)


def stage(*keep: str, dtype: torch.dtype = torch.float32) -> Net:
    """The whole model with every layer but ``keep`` deleted (torch.distributed.pipelining's manual split)."""
    net = Net(dtype)
    for name in ("a", "b", "c"):
        if name not in keep:
            delattr(net, name)
    return net


def ones_grad(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = torch.ones_like(p)


@pytest.mark.parametrize("pull", ["copy", "view"])
def test_stages_push_and_pull_only_their_own_parameters(job, serve, pull):
    serve(job, "--no-watchdog", "--learners", "4", "--lr", "1")
    full = Net()
    start = {k: v.clone() for k, v in full.state_dict().items()}
    with learner.attach(full, job=job) as whole:  # declares the job's model
        first, second = stage("a"), stage("b", "c")
        with learner.attach(first, job=job, partial=True, pull=pull) as s1, \
                learner.attach(second, job=job, partial=True, pull=pull) as s2:
            assert s1.n_params == whole.n_params  # laid out over the whole model ...
            for _ in range(3):
                ones_grad(first)
                s1.step()
            for _ in range(2):
                ones_grad(second)
                s2.step()
            s1.flush()
            s2.flush()
            before = s1.pulled_bytes
            s1.pull()
            whole.pull()
            if pull == "copy":  # ... and copies in its own tensors alone (pull() takes the frozen ones too: none)
                assert s1.pulled_bytes - before == 4 * sum(p.numel() for p in first.parameters())
            theirs = learner.pull_state_dict(job)
            for k, v in theirs.items():  # each stage moved its own layers, by exactly its own steps
                expected = start[k].clone()
                for _ in range(3 if k.startswith("a.") else 2):
                    expected -= 1
                assert torch.equal(v, expected), k
            for k, v in first.state_dict().items():
                assert torch.equal(v, theirs[k]), k
            for k, v in full.state_dict().items():
                assert torch.equal(v, theirs[k]), k
            # A stage with the drop-in optimizer, at one process's lr 1 (the server's).
            opt = learner.Optimizer(stage("c"), job=job, partial=True, pull=pull)
            c_before = theirs["c.bias"].clone()
            ones_grad(opt.learner.model)
            opt.step()
            opt.learner.flush()
            assert torch.equal(learner.pull_state_dict(job)["c.bias"], c_before - 1)
            opt.close()


def test_a_module_that_is_not_part_of_the_job_is_refused_by_name_and_the_job_goes_on(job, serve):
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1")
    full = Net()
    with learner.attach(full, job=job) as whole:
        wrong_shape = stage("a")
        wrong_shape.a = torch.nn.Linear(4, 9)
        with pytest.raises(SpecError, match=r"'a.weight' is \[9, 4\] float32 \(param\) in this module but \[8, 4\]"):
            learner.attach(wrong_shape, job=job, partial=True)
        stranger = stage("a")
        stranger.z = torch.nn.Linear(2, 2)
        with pytest.raises(SpecError, match=r"'z.weight' \[2, 2\] float32 of this module is not in job"):
            learner.attach(stranger, job=job, partial=True)
        wrong_dtype = stage("b", dtype=torch.bfloat16)
        with pytest.raises(SpecError, match=r"'b.weight' is \[8, 8\] bfloat16"):
            learner.attach(wrong_dtype, job=job, partial=True)
        with_buffers = stage("a")
        with_buffers.register_buffer("seen", torch.zeros(1))
        with pytest.raises(SpecError, match=r"'seen' \[1\] float32 of this module is not in job"):
            learner.attach(with_buffers, job=job, partial=True)
        # Without partial=True a strict subset of the job's model is a mismatch, named.
        with pytest.raises(SpecError, match="this model has 2 tensors and the job 6"):
            learner.attach(stage("a"), job=job)
        ones_grad(full)  # the job went on: its slots are free, its learner steps
        whole.step()
        whole.flush()
        with learner.attach(stage("a"), job=job, partial=True) as s:
            assert s.clock == whole.pull() == 1  # the whole learner's one update


class BNNet(torch.nn.Module):
    """Three blocks with BatchNorm: a pipeline split gives each stage its own blocks' statistics."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.a_bn = torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)
        self.b, self.b_bn = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)
        self.c, self.c_bn = torch.nn.Linear(8, 2), torch.nn.BatchNorm1d(2)


def bn_stage(*keep: str) -> BNNet:
    net = BNNet()
    for name in ("a", "a_bn", "b", "b_bn", "c", "c_bn"):
        if name not in keep:
            delattr(net, name)
    return net


@pytest.mark.parametrize("on_device", [None, "first", "second"])
def test_stages_with_buffers_set_their_own_statistics_alone(job, serve, on_device):
    """Each stage's pushes set its own BatchNorm statistics and add its own batch counts; the other stages'
    stay as their own pushes left them: the first stage pulls, the second moves its statistics, then the
    first pushes (a push that set every statistic would put back what the first stage had pulled). With
    ``on_device``, that stage is a device learner (on the CPU, through the synchronous stream stand-in)."""
    serve(job, "--no-watchdog", "--learners", "3", "--lr", "0.1")
    stats = ("running_mean", "running_var")

    def attach(module: torch.nn.Module, which: str):
        if which == on_device:
            return DeviceLearner(module, job, partial=True, streams=SyncStreams())
        return learner.attach(module, job=job, partial=True)

    with learner.attach(BNNet(), job=job):  # declares the job's model
        first, second = bn_stage("a", "a_bn"), bn_stage("b", "b_bn", "c", "c_bn")
        with attach(first, "first") as s1, attach(second, "second") as s2:
            if on_device:
                assert isinstance(s1 if on_device == "first" else s2, DeviceLearner)
            for i in range(3):
                s1.pull()  # its stand-ins for the second stage's statistics: the job's now
                second.c_bn(second.c(second.b_bn(second.b(torch.randn(16, 8) + i)))).sum().backward()
                s2.step()
                s2.flush()
                theirs = learner.pull_state_dict(job)
                seconds = {f"{n}.{st}": theirs[f"{n}.{st}"] for n in ("b_bn", "c_bn") for st in stats}
                first.a_bn(first.a(torch.randn(16, 4) - i)).sum().backward()
                pushed = {f"a_bn.{st}": getattr(first.a_bn, st).clone() for st in stats}
                s1.step()
                s1.flush()
                theirs = learner.pull_state_dict(job)
                for k, v in {**seconds, **pushed}.items():
                    assert torch.equal(theirs[k], v), (i, k)
            initial = BNNet().state_dict()
            assert all(not torch.equal(theirs[k], initial[k]) for k in (*seconds, *pushed))  # they all moved
            assert [int(theirs[f"{n}.num_batches_tracked"]) for n in ("a_bn", "b_bn", "c_bn")] == [3, 3, 3]
            s1.pull()  # a stage takes the job's statistics of its own blocks
            assert torch.equal(first.a_bn.running_mean, theirs["a_bn.running_mean"])
            s2.pull()
            assert torch.equal(second.b_bn.running_var, theirs["b_bn.running_var"])


def test_a_stage_whose_statistics_are_not_one_run_of_the_jobs_is_refused_by_name(job, serve):
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "0.1")
    with learner.attach(BNNet(), job=job):
        with pytest.raises(SpecError, match=r"'a_bn.running_mean'.*'c_bn.running_mean'.*'b_bn.running_mean' of "
                                            r"another stage lies between them"):
            learner.attach(bn_stage("a", "a_bn", "c", "c_bn"), job=job, partial=True)
        with learner.attach(bn_stage("b", "b_bn"), job=job, partial=True) as s:  # the job goes on
            s.flush()


def test_a_partial_attach_waits_for_the_jobs_model_and_says_what_declares_it(job, serve):
    serve(job, "--no-watchdog", "--learners", "1")
    with pytest.raises(Timeout, match="partial attach takes part of the job's model, which a full attach"):
        learner.attach(stage("a"), job=job, partial=True, timeout=0.3)


def test_a_bfloat16_stage(job, serve):
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1")
    full = Net(torch.bfloat16)
    start = {k: v.float().clone() for k, v in full.state_dict().items()}
    with learner.attach(full, job=job):
        part = stage("b", dtype=torch.bfloat16)
        with learner.attach(part, job=job, partial=True) as s:
            ones_grad(part)
            s.step()
            s.flush()
            s.pull()
            theirs = learner.pull_state_dict(job)
            for k, v in theirs.items():  # float32 master weights, given back in the model's dtype
                moved = (start[k] - (1 if k.startswith("b.") else 0)).bfloat16()
                assert torch.equal(v, moved), k
            assert torch.equal(part.b.weight.float(), theirs["b.weight"].float())


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


@contextlib.contextmanager
def _stage_beside_wide(job: str):
    """A stage (``Wide`` without its 40 MB layer ``b``) of a job whose wide layer a full learner in another
    process declared and holds; yields the stage and this process's RSS before it attached."""
    sys.path.insert(0, str(HELPERS))
    from wide_learner import Wide

    holder = spawn("wide_learner.py", job)
    try:
        assert read_line(holder, timeout=60) == "ready"
        part = Wide()
        del part.b
        yield part, _rss_mib()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("flags", [[], ["--optimizer", "adam", "--predict"]], ids=["sgd", "adam-predict"])
def test_the_parameters_a_stage_does_not_hold_take_no_memory_in_it(job, serve, flags):
    """The wide layer lives in the job (a full learner in another process declared it); the stage that
    holds only the small one grows by far less than the wide layer's 40 MB, also when it extrapolates its
    weights (--predict: its own tensors alone)."""
    serve(job, "--no-watchdog", "--learners", "2", "--ring-depth", "2", *flags)
    with _stage_beside_wide(job) as (part, before):
        with learner.attach(part, job=job, partial=True) as s:
            for _ in range(6):
                ones_grad(part)
                s.step()
            s.flush()
            s.pull()
            if flags:  # extrapolate as a stage 2 updates behind would (one learner's own staleness varies)
                s._staleness.extend([2] * 16)
                s._predict()
                assert s.predicted_staleness == 2
            grown = _rss_mib() - before
        assert grown < 12, f"the stage grew by {grown} MiB"


def _turns(job: str, serve, first: torch.nn.Module, second: torch.nn.Module, partial: tuple[bool, bool],
           rounds: int) -> float:
    """Two learners push in turn, each one gradient a turn; the server's running mean of staleness after."""
    from psd.arena import open_job

    served = serve(job, "--no-watchdog", "--learners", "3", "--lr", "0.001", "--optimizer", "momentum")
    with learner.attach(Net(), job=job):  # declares the job's model
        with learner.attach(first, job=job, partial=partial[0]) as s1, \
                learner.attach(second, job=job, partial=partial[1]) as s2:
            for _ in range(rounds):
                for model, ps in ((first, s1), (second, s2)):
                    ones_grad(model)
                    ps.step()
                    ps.flush()
            a = open_job(job, role="reader")
            try:
                avg = a.header()["staleness_avg"]
            finally:
                a.close()
    served.stop()
    return avg


def test_a_stage_counts_as_stale_only_the_updates_that_moved_its_own_tensors(job, serve):
    """Two stages taking turns: between a stage's pull and its push the other stage's update moves the
    clock, but none of its tensors. The server's staleness (its running mean: what --async-momentum auto
    and --staleness-lr read) counts the updates that moved the entry's own tensors, so the stages' entries
    count about half what two whole-model learners taking turns the same way count."""
    whole = _turns(job, serve, Net(), Net(), partial=(False, False), rounds=150)
    staged = _turns(job, serve, stage("a"), stage("b", "c"), partial=(True, True), rounds=150)
    # A whole model beside a stage: every update moved some tensor of the whole model's entries (its own
    # pushes move them all), and the stage's layer `a` too, so both count the clock distance exactly.
    mixed = _turns(job, serve, Net(), stage("a"), partial=(False, True), rounds=150)
    print(f"staleness: whole {whole:.3f}, stages {staged:.3f}, whole beside a stage {mixed:.3f}")
    assert whole >= 0.9, whole  # the other learner's update: at least one tick each
    assert staged <= 0.65 * whole, (staged, whole)
    assert abs(mixed - whole) <= 0.05 * whole, (mixed, whole)


# -- a partial learner on a device (DeviceLearner), driven on the CPU through the synchronous stream stand-in


class RecordingStreams(SyncStreams):
    """Synchronous copies that remember what the learner asked to register as pinned memory."""

    def __init__(self) -> None:
        self.regions: list[tuple[int, int, bool]] = []

    def register(self, buf, regions: list[tuple[int, int, bool]]) -> None:
        self.regions = list(regions)


def frozen_net(*keep: str) -> Net:
    """``stage(*keep)`` (the whole model without ``keep``: all of it) with ``b.bias`` frozen, so that a stage
    holding ``b`` has a frozen tensor, which the job keeps after its trainable ones."""
    net = stage(*keep) if keep else Net()
    if hasattr(net, "b"):
        net.b.bias.requires_grad_(False)
    return net


def _steps(job: str) -> list[int]:
    """Each trainable tensor's optimizer steps, in the job's order."""
    from psd.arena import open_job
    from psd.state import pieces_view

    a = open_job(job, role="reader")
    try:
        a.remap()
        v = pieces_view(a, a.header())
        out = [int(s) for s in v[:, 0]]
        del v
        return out
    finally:
        a.close()


def test_a_partial_device_learner_pushes_and_pulls_its_own_tensors_alone(job, serve):
    """A stage on a device (its copies synchronous on the CPU) holding a trainable and a frozen tensor that are
    not consecutive in the job's weights: the device holds its own elements alone, its pushes move its own
    tensors by exactly its gradients and step no other tensor (the rest of its entries is marked absent, so
    not even the NaN left there is read), and a pull copies its own tensors alone."""
    serve(job, "--no-watchdog", "--learners", "3", "--lr", "1")
    full = frozen_net()
    start = {k: v.clone() for k, v in full.state_dict().items()}
    with learner.attach(full, job=job) as whole:  # declares the job's model: b.bias frozen, after c's
        part, other = frozen_net("b"), stage("a", "c")
        with DeviceLearner(part, job, partial=True, streams=SyncStreams()) as s1, \
                learner.attach(other, job=job, partial=True) as s2:
            own = part.b.weight.numel() + part.b.bias.numel()
            assert [w.numel() for w in s1._pipe.w] == [own, own]  # its weights, front and back
            assert [g.numel() for g in s1._pipe.grad] == [part.b.weight.numel()] * 2  # its gradients
            assert s1._pipe.pulls == [(40, 0, 64), (122, 64, 8)]  # b.weight among the trainable, b.bias frozen
            for entry in s1._entries:  # what another learner of this slot might have left in the ring
                entry.fill_(float("nan"))
            for _ in range(3):
                ones_grad(part)
                s1.step()
            for _ in range(2):
                ones_grad(other)
                s2.step()
            s1.flush()
            s2.flush()
            assert _steps(job) == [2, 2, 3, 2, 2]  # a.weight, a.bias, b.weight, c.weight, c.bias
            counters = s1._arena.counters()
            assert counters["applied"] == 5 and counters["rejected"] == 0, counters
            before = s1.pulled_bytes
            s1.pull()
            assert s1.pulled_bytes - before == 4 * own
            theirs = learner.pull_state_dict(job)
            for k, v in theirs.items():
                expected = start[k].clone()
                for _ in range(3 if k == "b.weight" else 0 if k == "b.bias" else 2):
                    expected -= 1
                assert torch.equal(v, expected), k
            assert torch.equal(part.b.weight, theirs["b.weight"]) and torch.equal(part.b.bias, theirs["b.bias"])
            assert part.b.weight.grad is not None and part.b.weight.grad.data_ptr() == \
                s1._pipe.grad[s1._pipe.cur].data_ptr()  # the next backward writes its staging buffer
            # The clock moved: a step starts a pull of its own tensors and the next swaps it in, counted as such.
            ones_grad(other)
            s2.step()
            s2.flush()
            before = s1.pulled_bytes
            ones_grad(part)
            s1.step()
            s1.flush()
            assert s1.pulled_bytes == before
            ones_grad(part)
            s1.step()
            assert s1.pulled_bytes - before == 4 * own
            whole.pull()


def _adam_stage(job: str, serve, on_device: bool) -> dict[str, torch.Tensor]:
    """Stage ``b`` (on a device learner, or a CPU partial one) and stage ``a``, ``c`` (CPU) push seeded random
    gradients in turn under Adam; the job's state after."""
    serve(job, "--no-watchdog", "--learners", "3", "--lr", "0.01", "--optimizer", "adam")
    with learner.attach(Net(), job=job):
        part, other = stage("b"), stage("a", "c")
        make = (lambda: DeviceLearner(part, job, partial=True, streams=SyncStreams())) if on_device else \
            (lambda: learner.attach(part, job=job, partial=True))
        g = torch.Generator().manual_seed(1)
        with make() as s1, learner.attach(other, job=job, partial=True) as s2:
            assert isinstance(s1, DeviceLearner) == on_device
            for _ in range(4):
                for model, ps in ((part, s1), (other, s2)):
                    for p in model.parameters():
                        p.grad = torch.randn(p.shape, generator=g)
                    ps.step()
                    ps.flush()
            s1.pull()
            theirs = learner.pull_state_dict(job)
            assert torch.equal(part.b.weight, theirs["b.weight"])
            return theirs


def test_a_partial_device_learner_trains_as_the_cpu_partial_learner_bit_for_bit(job, serve):
    on_cpu = _adam_stage(f"{job}-cpu", serve, on_device=False)
    on_device = _adam_stage(job, serve, on_device=True)
    start = Net().state_dict()
    for k, v in on_device.items():
        assert torch.equal(v, on_cpu[k]), k
        assert not torch.equal(v, start[k]), k  # every stage's tensors moved


def test_a_partial_device_learner_through_the_drop_in_optimizer(job, serve):
    """``psd.learner.Optimizer`` of a stage whose learner is on a device: its own tensors are all it steps."""
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1")
    with learner.attach(Net(), job=job):
        part = stage("c")
        opt = learner.Optimizer(part, learner=DeviceLearner(part, job, partial=True, streams=SyncStreams()))
        try:
            before = learner.pull_state_dict(job)
            ones_grad(part)
            opt.step()
            opt.zero_grad()
            opt.step()  # zeroed, not written: no update
            opt.learner.flush()
            after = learner.pull_state_dict(job)
            for k, v in after.items():
                assert torch.equal(v, before[k] - (1 if k.startswith("c.") else 0)), k
            assert opt.learner._arena.counters()["applied"] == 1
        finally:
            opt.close()


def test_a_partial_device_learner_without_buffers_of_its_own_pushes_none(job, serve):
    """In a job with BatchNorm statistics, a stage on a device that holds none of them pushes no buffers: the
    statistics and counts the other stage set stay as they are through its pushes."""
    serve(job, "--no-watchdog", "--learners", "3", "--lr", "0.1")
    with learner.attach(BNNet(), job=job):
        mine, rest = bn_stage("b"), bn_stage("a", "a_bn", "b_bn", "c", "c_bn")
        with DeviceLearner(mine, job, partial=True, streams=SyncStreams()) as s1, \
                learner.attach(rest, job=job, partial=True) as s2:
            rest.c_bn(rest.c(rest.b_bn(torch.randn(16, 8) + 3))).sum().backward()
            rest.a_bn(rest.a(torch.randn(16, 4))).sum().backward()
            s2.step()
            s2.flush()
            set_by_rest = {k: v for k, v in learner.pull_state_dict(job).items() if "_bn." in k}
            assert int(set_by_rest["b_bn.num_batches_tracked"]) == 1
            for _ in range(3):
                ones_grad(mine)
                s1.step()
            s1.flush()
            theirs = learner.pull_state_dict(job)
            assert s1._arena.counters()["applied"] == 4
            for k, v in set_by_rest.items():
                assert torch.equal(theirs[k], v), k


def test_a_partial_device_learner_holds_and_pins_its_own_tensors_alone(job, serve):
    """Beside a 40 MB layer it does not hold (declared by a learner in another process), a stage on a device
    sizes its device buffers to its own 40 elements, asks to pin only the pages of its own tensors (in the
    weights and in each ring entry), pulls its own bytes alone, and grows by far less than the wide layer."""
    serve(job, "--no-watchdog", "--learners", "2", "--ring-depth", "2")
    with _stage_beside_wide(job) as (part, before):
        streams = RecordingStreams()
        with DeviceLearner(part, job, partial=True, streams=streams) as s:
            own = sum(p.numel() for p in part.parameters())
            assert own == 40
            assert [t.numel() for t in (*s._pipe.w, *s._pipe.grad)] == [own] * 4
            h = s._arena.header()
            wide = (h["weights_off"] + 4 * own, 4 * (h["n_params"] - own))  # b's weights, after a's
            pinned = [(lo, size) for lo, size, read_only in streams.regions if read_only]
            assert sum(size for _, size in pinned) <= 4096 * 2
            assert all(lo + size <= wide[0] + 4096 for lo, size in pinned)  # a's page, none of b's beyond it
            ring = [(lo, size) for lo, size, read_only in streams.regions if not read_only]
            assert len(ring) == 2 and sum(size for _, size in ring) <= 4096 * 2 * 2  # a page of each entry
            assert all(lo // 4096 * 4096 <= s._arena.grad_offset(s.slot, k) < lo + size
                       for k, (lo, size) in enumerate(ring))
            pulled = s.pulled_bytes
            for _ in range(6):
                ones_grad(part)
                s.step()
            s.flush()
            s.pull()
            assert (s.pulled_bytes - pulled) % (4 * own) == 0 and s.pulled_bytes > pulled
            grown = _rss_mib() - before
        assert grown < 12, f"the stage grew by {grown} MiB"
