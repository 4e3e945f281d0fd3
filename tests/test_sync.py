"""Sync modes, staleness control, weight prediction and non-finite gradients, with real processes.

The servers run without a watchdog: nothing here needs one, and its last checkpoint costs seconds at each stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import forked
import pytest
import torch

from conftest import HELPERS, arena_header, child_env, finish, kill, read_line, spawn, wait_until
from psd import _native, learner
from psd.arena import open_job, shm_path


def header(job: str) -> dict:
    a = open_job(job)
    try:
        return dict(a.header(), **{"counters": a.counters()})
    finally:
        a.close()


# -- bsp ---------------------------------------------------------------------


def test_bsp_equals_one_learner_with_the_combined_batch_bit_for_bit(job, serve):
    import sys

    sys.path.insert(0, str(__import__("conftest").HELPERS))
    from sync_learner import exact_problem

    steps, lr = 4, 2.0 ** -4
    model, x, y = exact_problem()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref64 = torch.zeros(4, 1, dtype=torch.float64)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref64 -= lr * 2 * x.double().T @ (x.double() @ ref64 - y.double()) / len(x)
    ref = model.weight.detach().reshape(-1)
    assert torch.equal(ref.double(), ref64.reshape(-1)), "the problem must be exact in float32"
    assert ref.abs().sum() > 0

    served = serve(job, "--no-watchdog", "--learners", "2", "--sync", "bsp", "--lr", repr(lr))
    procs = [forked.start([sys.executable, str(HELPERS / "sync_learner.py"), "bsp", "--job", job, "--rank", str(r),
                           "--world", "2", "--steps", str(steps)], child_env()) for r in range(2)]
    outs = [json.loads(finish(p).strip().splitlines()[-1]) for p in procs]
    for out in outs:
        assert torch.equal(torch.tensor(out), ref), f"bsp {out} != one learner {ref.tolist()}"
    h = header(job)
    assert (h["clock"], h["rounds"], h["counters"]["applied"]) == (steps, steps, 2 * steps)
    assert h["staleness_max"] == 0, "in bsp every gradient is computed on the current weights"
    served.stop()


@pytest.mark.parametrize("sync", ["bsp", "ssp:1"])
def test_a_peer_slower_than_the_timeout_is_waited_for(job, serve, sync):
    """A rank that pauses longer than attach's timeout (rank 0's evaluation, a save) before its step: the other
    waits for it, logging, instead of failing its step with Timeout after the timeout (60 s by default; 1 s here,
    a pause of 2.5 s). Under bsp the result is still one learner's with the combined batch, bit for bit."""
    sys.path.insert(0, str(HELPERS))
    from sync_learner import exact_problem

    steps, lr = 4, 2.0 ** -4
    model, x, y = exact_problem()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    ref = model.weight.detach().reshape(-1)
    served = serve(job, "--no-watchdog", "--learners", "2", "--sync", sync, "--lr", repr(lr))
    procs = [forked.start([sys.executable, str(HELPERS / "sync_learner.py"), "bsp", "--job", job, "--rank", str(r),
                           "--world", "2", "--steps", str(steps), "--timeout", "1", "--pause-at", "2",
                           "--pause", "2.5" if r == 1 else "0"], child_env()) for r in range(2)]
    outs = [json.loads(finish(p).strip().splitlines()[-1]) for p in procs]
    if sync == "bsp":
        for out in outs:
            assert torch.equal(torch.tensor(out), ref), f"bsp {out} != one learner {ref.tolist()}"
    assert header(job)["counters"]["applied"] == 2 * steps
    served.stop()


def test_a_round_waited_on_a_hung_server_ends_in_timeout(job, serve):
    """Waiting past the timeout is for a slower live peer, not for a hung server: with the server stopped
    (SIGSTOP, no watchdog to replace it) a learner's bsp wait ends in Timeout once the server has not beaten for
    the timeout, where it would otherwise wait without end."""
    served = serve(job, "--no-watchdog", "--learners", "2", "--sync", "bsp")
    server = header(job)["server_pid"]
    procs = [forked.start([sys.executable, str(HELPERS / "sync_learner.py"), "bsp", "--job", job, "--rank", str(r),
                           "--world", "2", "--steps", "4", "--timeout", "1", "--pause-at", "2",
                           "--pause", "30" if r == 1 else "0"], child_env()) for r in range(2)]
    try:
        wait_until(lambda: header(job)["rounds"] >= 2, what="two rounds")
        os.kill(server, signal.SIGSTOP)
        out, err = procs[0].communicate(timeout=60)
        assert procs[0].returncode != 0 and "Timeout" in err, (out, err)
    finally:
        os.kill(server, signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    served.stop()


def test_bsp_goes_on_when_a_learner_is_killed(job, serve):
    served = serve(job, "--no-watchdog", "--learners", "3", "--sync", "bsp")
    procs = [spawn("sync_learner.py", "pace", "--job", job, "--world", "3", "--steps", "400",
                   "--delay", "0.002" if r == 2 else "0") for r in range(3)]
    for p in procs:
        assert read_line(p) == "started"
    wait_until(lambda: header(job)["rounds"] >= 20, what="20 bsp rounds")
    kill(procs[2])
    for p in procs[:2]:
        assert "done" in finish(p, timeout=60)
    assert header(job)["rounds"] >= 400
    served.stop()


# -- ssp ---------------------------------------------------------------------


def ssp_gap(a) -> tuple[int, int]:
    """(fastest - slowest clock over active learners, active learners): the maxima are read first, then
    the minima, so a true gap can only look smaller, never larger."""
    n = a.header()["n_slots"]
    first = [a.slot_info(i) for i in range(n)]
    hi = max((s["ssp_base"] + s["tail"] for s in first if s["state"] == _native.SLOT_ACTIVE), default=0)
    second = [a.slot_info(i) for i in range(n)]
    active = [s["ssp_base"] + s["tail"] for s in second if s["state"] == _native.SLOT_ACTIVE]
    return (hi - min(active), len(active)) if active else (0, 0)


@pytest.mark.parametrize("bound", [0, 2])
def test_ssp_bound_is_never_exceeded_with_one_learner_five_times_slower(job, serve, bound):
    served = serve(job, "--no-watchdog", "--learners", "3", "--sync", f"ssp:{bound}", "--ring-depth", "8")
    delays = ["0.001", "0.001", "0.005"]
    procs = [spawn("sync_learner.py", "pace", "--job", job, "--world", "3", "--steps", "150", "--delay", d)
             for d in delays]
    for p in procs:
        assert read_line(p) == "started"
    a = open_job(job)
    worst, samples = 0, 0
    try:
        while any(p.poll() is None for p in procs):
            gap, active = ssp_gap(a)
            if active >= 2:
                worst = max(worst, gap)
                samples += 1
            # A learner computes only while at most `bound` ahead; its push then makes it bound + 1.
            assert gap <= bound + 1, f"a learner ran {gap} pushes ahead of the slowest (ssp:{bound})"
    finally:
        a.close()
    for p in procs:
        assert "done" in finish(p)
    assert samples > 100
    assert worst == bound + 1, f"the fast learners never reached the bound ({worst}): nothing was tested"
    served.stop()


def test_ssp_does_not_deadlock_when_the_slowest_learner_is_killed(job, serve):
    served = serve(job, "--no-watchdog", "--learners", "3", "--sync", "ssp:1")
    victim = spawn("sync_learner.py", "pace", "--job", job, "--world", "3", "--steps", "100000", "--delay", "0.05")
    others = [spawn("sync_learner.py", "pace", "--job", job, "--world", "3", "--steps", "300") for _ in range(2)]
    for p in [victim, *others]:
        assert read_line(p) == "started"
    kill(victim)  # SIGKILL: it leaves the minimum without saying so
    t0 = time.monotonic()
    for p in others:
        assert "done" in finish(p, timeout=60)
    print(f"the others finished {time.monotonic() - t0:.2f} s after the kill")
    served.stop()


# -- kasync, push-every -------------------------------------------------------


def linear_problem():
    torch.manual_seed(3)
    model = torch.nn.Linear(6, 2)
    x, y = torch.randn(12, 6), torch.randn(12, 2)
    return model, x, y


def run_steps(ps, model, x, y, steps):
    for i in range(steps):
        torch.nn.functional.mse_loss(model(x[i:i + 2]), y[i:i + 2]).backward()
        ps.step()
        ps.flush()
        ps.pull()  # deterministic: the next gradient sees every update that is due


def reference(groups: list[int], lr: float, reduce: str = "mean"):
    """SGD where each update is the mean (or sum) of len(group) gradients all computed on the same weights."""
    model, x, y = linear_problem()
    i = 0
    for size in groups:
        grads = []
        for _ in range(size):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[i:i + 2]), y[i:i + 2]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            i += 1
        with torch.no_grad():
            for j, p in enumerate(model.parameters()):
                stacked = torch.stack([g[j] for g in grads])
                p -= lr * (stacked.sum(0) if reduce == "sum" else stacked.mean(0))
    return model.state_dict()


@pytest.mark.parametrize("flags, groups, clock, reduce", [
    (["--sync", "kasync:3"], [3, 3], 2, "sum"),  # each gradient one process's step, as asp
    (["--push-every", "2"], [2, 2, 2], 3, "mean"),  # a wave: the mean of its mini-batches, as accumulation
])
def test_grouped_updates_match_the_reference(job, serve, flags, groups, clock, reduce):
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.1", *flags)
    model, x, y = linear_problem()
    with learner.attach(model, job=job) as ps:
        run_steps(ps, model, x, y, sum(groups))
        assert ps.clock == clock
        ours = learner.pull_state_dict(job)
    ref = reference(groups, 0.1, reduce)
    for k, v in ref.items():
        assert torch.allclose(ours[k], v, rtol=1e-6, atol=1e-7), k
    served.stop()


def kasync_adagrad_reference(model, batches, k: int, lr: float, weight_decay: float, lr_decay: float = 0.0):
    """torch's Adagrad as kasync:K takes it: K gradients a round, all on the round's weights, each with its
    weight decay; each gradient's square into the sum, the round's sum as one step (a tensor's step count
    moving only with the rounds that moved it). ``batches``: a callable per mini-batch that computes the loss
    and its gradients. Returns the sums of the squares and, to tell the two rules apart, the squares of the
    rounds' sums."""
    params = dict(model.named_parameters())
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    squared_sums = {n: torch.zeros_like(p) for n, p in params.items()}
    steps = dict.fromkeys(params, 0)
    for r in range(len(batches) // k):
        acc = {}
        for loss_and_grads in batches[k * r:k * r + k]:
            model.zero_grad(set_to_none=True)
            loss_and_grads()
            for n, p in params.items():
                if p.grad is not None:
                    d = p.grad + weight_decay * p.detach()
                    acc[n] = acc.get(n, 0) + d
                    sums[n] += d * d
        with torch.no_grad():
            for n, d in acc.items():
                steps[n] += 1
                squared_sums[n] += d * d
                params[n] -= lr / (1 + (steps[n] - 1) * lr_decay) * d / (sums[n].sqrt() + 1e-10)
    return sums, squared_sums


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_kasync_adagrad_takes_each_gradients_square(job, serve, weight_decay):
    """kasync:3 with Adagrad: each gradient is one process's step, so Adagrad's sum takes each gradient's
    square (as three steps of one process would), not the square of the three's sum, which counts
    correlated gradients up to three times over and shrinks every later step. With weight decay each
    gradient carries its decay, square included (the weights do not move within a round); an input that
    is always 0 leaves its weights only the decay, whose steps must stay about the lr (a decay outside the
    sum divided by a sum of 0 threw them to 1e13)."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.1", "--optimizer", "adagrad",
                   "--sync", "kasync:3", "--weight-decay", str(weight_decay))
    model, x, y = linear_problem()
    x[:, 0] = 0.0  # the weights of input 0 get no gradient
    with learner.attach(model, job=job) as ps:
        run_steps(ps, model, x, y, 6)
        assert ps.clock == 2
        ours = learner.pull_state_dict(job)
    ref = linear_problem()[0]
    batches = [lambda i=i: torch.nn.functional.mse_loss(ref(x[i:i + 2]), y[i:i + 2]).backward() for i in range(6)]
    sums, squared_sums = kasync_adagrad_reference(ref, batches, 3, 0.1, weight_decay)
    for k, v in ref.state_dict().items():
        assert not torch.allclose(sums[k], squared_sums[k], rtol=1e-3), k  # the two rules differ on this problem
        assert torch.allclose(ours[k], v, rtol=1e-5, atol=1e-6), k
        assert ours[k].abs().max() < 10, k  # no weight thrown far: each step is at most sqrt(3) x the lr
    served.stop()


def kasync_adam_reference(optimizer: str, k: int, lr: float, weight_decay: float, rule: str, bf16: bool = False):
    """torch.optim's Adam (AdamW) on linear_problem's 6 mini-batches as kasync:K takes them, K gradients a
    round, all on the round's weights: ``rule`` "each" steps torch's optimizer once per gradient (one
    process's K steps), "sum" once per round on the sum of its K gradients (what Adam of the sum does);
    ``bf16``: each gradient rounded to bfloat16 first, as ``--grad-dtype bf16`` pushes it."""
    model, x, y = linear_problem()
    l2 = weight_decay if optimizer == "adam" else 0.0  # Adam's decay: on the round's weights, added below
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    opt = cls(model.parameters(), lr=lr, weight_decay=weight_decay - l2)
    for r in range(6 // k):
        grads = []
        for i in range(k * r, k * r + k):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[i:i + 2]), y[i:i + 2]).backward()
            grads.append([(p.grad.bfloat16().float() if bf16 else p.grad) + l2 * p.detach()
                          for p in model.parameters()])
        for gs in (grads if rule == "each" else [[sum(g) for g in zip(*grads, strict=True)]]):
            for p, g in zip(model.parameters(), gs, strict=True):
                p.grad = g
            opt.step()
    return model.state_dict()


@pytest.mark.parametrize("optimizer,weight_decay,dtype", [("adam", 0.0, "float32"), ("adam", 0.01, "float32"),
                                                          ("adamw", 0.01, "float32"), ("adamw", 0.01, "bf16")])
def test_kasync_adam_takes_each_gradient_as_a_step(job, serve, optimizer, weight_decay, dtype):
    """kasync:3 with Adam or AdamW: each gradient is one process's step, so the moments take each gradient
    and the round moves the weights by the three steps one process would make on them. Adam of the three's
    sum normalises it to one step's size: a third of the movement (the CNN under kasync:2 lost 0.8-2.5
    points to it in one process, benchmarks/results/matrix/README.md). With weight decay, the round's
    weights stand for the weights within it: Adam's L2 decay is taken on them (the reference does the same),
    and AdamW's decay applied three times where torch decays the weights of each step in turn (within
    1e-5). A bfloat16 gradient is widened as it is taken (the reference rounds its gradients the same way).
    Every tensor is in every gradient here: one that some gradients leave out takes Adam's step count as if
    they had not (native/update.c accumulate)."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.01", "--optimizer", optimizer,
                   "--sync", "kasync:3", "--weight-decay", str(weight_decay), "--threads", "2",
                   "--grad-dtype", dtype, "--async-momentum", "off")
    model, x, y = linear_problem()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    with learner.attach(model, job=job) as ps:
        run_steps(ps, model, x, y, 6)
        assert ps.clock == 2
        ours = learner.pull_state_dict(job)
    each = kasync_adam_reference(optimizer, 3, 0.01, weight_decay, "each", dtype == "bf16")
    summed = kasync_adam_reference(optimizer, 3, 0.01, weight_decay, "sum", dtype == "bf16")
    for k, v in each.items():
        moved, moved_by_sum = (v - init[k]).abs().max(), (summed[k] - init[k]).abs().max()
        assert moved > 2 * moved_by_sum, k  # the two rules differ on this problem: 3 steps against 1
        assert torch.allclose(ours[k], v, rtol=0, atol=1e-5), (k, (ours[k] - v).abs().max())
    served.stop()


class TwoLayers(torch.nn.Module):
    """A 300 x 300 layer (90,300 floats: the update loop's kernels split it across threads) and a head that
    only some mini-batches use (a tensor absent from some gradients of a round, and from whole rounds)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(300, 300)
        self.b = torch.nn.Linear(300, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return h.sum(1, keepdim=True) * 0 + (self.b(h) if use_b else h[:, :4])


USES_B = [True, False, True, False, False, False, True, True, False]


def train_two_layers(job, model, x, y, uses=USES_B, start=0):
    """TwoLayers ``model`` attached to ``job``, one step a mini-batch of ``uses`` (mini-batch ``start`` on), each
    pulled before the next (deterministic): the job's final weights."""
    with learner.attach(model, job=job) as ps:
        for i, use_b in enumerate(uses, start):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x[2 * i:2 * i + 2], use_b), y[2 * i:2 * i + 2]).backward()
            ps.step()
            ps.flush()
            ps.pull()
        return learner.pull_state_dict(job)


def adagrad_job(job, serve, sync, dtype="float32"):
    """TwoLayers trained through a one-learner Adagrad job (weight decay, lr decay, 2 update threads) on
    USES_B's mini-batches: its initial weights, its data and the job's final weights."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.05", "--optimizer", "adagrad", "--sync", sync,
                   "--weight-decay", "0.01", "--lr-decay", "0.1", "--threads", "2", "--grad-dtype", dtype,
                   "--async-momentum", "off")
    torch.manual_seed(5)
    model = TwoLayers()
    x, y = torch.randn(40, 300), torch.randn(40, 4)
    x[:, :50] = 0.0  # weights that only ever see their decay
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ours = train_two_layers(job, model, x, y)
    served.stop()
    return init, (x, y), ours


def test_kasync_adagrad_on_threads_matches_the_reference(job, serve):
    """kasync:3, Adagrad with weight and lr decay, a tensor split across 2 update threads and one that some
    gradients leave out: each gradient (with its decay) in the round's sum and its square in Adagrad's."""
    init, (x, y), ours = adagrad_job(job, serve, "kasync:3")
    ref = TwoLayers()
    ref.load_state_dict(init)
    batches = [lambda i=i, b=b: torch.nn.functional.mse_loss(ref(x[2 * i:2 * i + 2], b), y[2 * i:2 * i + 2]).backward()
               for i, b in enumerate(USES_B)]
    kasync_adagrad_reference(ref, batches, 3, 0.05, 0.01, lr_decay=0.1)
    for k, v in ref.state_dict().items():
        assert torch.allclose(ours[k], v, rtol=1e-4, atol=1e-5), k


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_kasync_1_adagrad_is_asp_bit_for_bit(job, serve, dtype):
    """kasync:1 takes each gradient (decay included) and its square as it comes, then steps without adding
    either: the same operations as asp's one step, to the bit, on 2 threads, float32 or bfloat16."""
    asp = adagrad_job(job, serve, "asp", dtype)[2]
    k1 = adagrad_job(job + "-k1", serve, "kasync:1", dtype)[2]
    for k, v in asp.items():
        assert torch.equal(k1[k], v), k


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_kasync_adam_counts_a_tensor_s_own_steps_when_some_gradients_leave_it_out(job, serve, optimizer):
    """kasync:3 with Adam or AdamW on TwoLayers and USES_B's mini-batches (its head in some gradients of a round
    only, its first layer through the head): torch.optim steps each tensor once per gradient that carries it, its
    bias correction counts those steps, and AdamW decays it once for each. psd counts the gradients each tensor
    took (struct psd_piece's taken, round_taken). Before, every tensor a round moved counted every gradient of
    the round: the head's and, through it, the first layer's weights drifted from torch's (0.017 of 0.078 of
    movement)."""
    served = serve(job, *kasync_adam_flags(optimizer))
    torch.manual_seed(5)
    model = TwoLayers()
    x, y = torch.randn(40, 300), torch.randn(40, 4)
    ref = TwoLayers()
    ref.load_state_dict(model.state_dict())
    ours = train_two_layers(job, model, x, y)
    served.stop()
    two_layers_adam_reference(ref, torch_adam(optimizer, ref), x, y, USES_B, 3)
    for k, v in ref.state_dict().items():
        assert torch.allclose(ours[k], v, rtol=0, atol=1e-5), (k, (ours[k] - v).abs().max())


def kasync_adam_flags(optimizer: str) -> tuple[str, ...]:
    """psd serve's flags for kasync:3 ``optimizer`` (adam, or adamw at weight decay 0.1) at lr 0.01."""
    wd = ("--weight-decay", "0.1") if optimizer == "adamw" else ()
    return ("--no-watchdog", "--learners", "1", "--lr", "0.01", "--optimizer", optimizer, "--sync", "kasync:3",
            "--async-momentum", "off", *wd)


def torch_adam(optimizer: str, ref: torch.nn.Module) -> torch.optim.Optimizer:
    """torch.optim's twin of kasync_adam_flags' optimizer for ``ref``."""
    if optimizer == "adamw":
        return torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    return torch.optim.Adam(ref.parameters(), lr=0.01)


def two_layers_adam_reference(ref, opt, x, y, uses, k):
    """kasync:``k`` of torch.optim ``opt`` on TwoLayers ``ref``: each round's ``k`` gradients of ``uses``'s
    mini-batches computed on the round's weights, then one step of ``opt`` per gradient."""
    for r in range(len(uses) // k):
        grads = []
        for i in range(k * r, k * r + k):  # the round's gradients, all on its weights
            ref.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ref(x[2 * i:2 * i + 2], uses[i]), y[2 * i:2 * i + 2]).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in ref.parameters()])
        for gs in grads:  # one torch step per gradient: a tensor without one does not step
            for p, g in zip(ref.parameters(), gs, strict=True):
                p.grad = g
            opt.step()


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize("written", ["layout 17", "before layout 17"])
def test_kasync_adam_s_step_counts_survive_a_checkpoint_taken_mid_round(job, serve, tmp_path, written, optimizer):
    """kasync:3 Adam or AdamW on TwoLayers, checkpointed (`psd checkpoint`) two gradients into its second round,
    stopped and resumed from it: the tensors' own step counts (and AdamW's count of the round's decay) come back
    with the moments and the open round, and the job ends where torch.optim does (USES_B: the head in some
    gradients only). A checkpoint written before layout 17 (its per-tensor rows without the counts) restores them
    as those builds counted, exact where every gradient carries every tensor (that case here): restored as 0, the
    bias correction would start again (0.003 off)."""
    uses = USES_B if written == "layout 17" else [True] * len(USES_B)
    args = kasync_adam_flags(optimizer)
    first = serve(job, *args)
    torch.manual_seed(5)
    model = TwoLayers()
    x, y = torch.randn(40, 300), torch.randn(40, 4)
    ref = TwoLayers()
    ref.load_state_dict(model.state_dict())
    train_two_layers(job, model, x, y, uses[:5])
    subprocess.run([sys.executable, "-m", "psd.cli", "checkpoint", "--job", job, "--checkpoint-dir", str(tmp_path)],
                   env=child_env(), check=True, capture_output=True, timeout=60)
    first.stop()
    from psd.watchdog import checkpoint

    (path,) = checkpoint.list_checkpoints(tmp_path)
    ckpt = checkpoint.load(path)
    assert ckpt.optim["acc_count"] == 2 and tuple(ckpt.pieces.shape) == (4, _native.PIECE_WORDS)
    if written == "before layout 17":
        ckpt.pieces = ckpt.pieces[:, :2].clone()
        path.unlink()
        checkpoint.write(ckpt, tmp_path)
    second = serve(job, *args, "--resume", str(tmp_path))
    ours = train_two_layers(job, model, x, y, uses[5:], start=5)
    second.stop()
    two_layers_adam_reference(ref, torch_adam(optimizer, ref), x, y, uses, 3)
    for k, v in ref.state_dict().items():
        assert torch.allclose(ours[k], v, rtol=0, atol=1e-5), (k, (ours[k] - v).abs().max())


def test_kasync_1_adam_is_asp_bit_for_bit(job, serve):
    """kasync:1 with AdamW: a round's sum is its one gradient, so the loop steps Adam on it as asp does (the
    take of each gradient into the moments is for K > 1), to the bit."""
    out = {}
    for sync in ("asp", "kasync:1"):
        served = serve(f"{job}-{sync[0]}", "--no-watchdog", "--learners", "1", "--lr", "0.01", "--optimizer",
                       "adamw", "--sync", sync, "--async-momentum", "off")
        model, x, y = linear_problem()
        with learner.attach(model, job=f"{job}-{sync[0]}") as ps:
            run_steps(ps, model, x, y, 6)
            out[sync] = learner.pull_state_dict(f"{job}-{sync[0]}")
        served.stop()
    for k, v in out["asp"].items():
        assert torch.equal(out["kasync:1"][k], v), k


def test_a_round_without_its_first_squares_steps_within_the_lr(job, serve):
    """A kasync round whose first gradient's square is missing from Adagrad's sum (a round begun by a server
    of a build that took no squares, restored mid-round): the sum's floor, the round's sum squared over K,
    keeps the step within sqrt(K) x the lr (without it: 1 / eps, weights thrown to 45 on this problem)."""
    args = ("--no-watchdog", "--learners", "1", "--lr", "0.1", "--optimizer", "adagrad", "--sync", "kasync:2")
    first = serve(job, *args)
    model, x, y = linear_problem()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with learner.attach(model, job=job) as ps:
        torch.nn.functional.mse_loss(model(x[0:2]), y[0:2]).backward()
        ps.step()
        ps.flush()
        a = open_job(job)
        try:
            h = a.header()
            assert h["acc_count"] == 1  # the round is in flight
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait()
            state = torch.frombuffer(a, dtype=torch.float32, count=h["n_train"], offset=h["optstate_off"])
            state.zero_()  # the first gradient's square, gone
            del state
        finally:
            a.close()
        second = serve(job, *args)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[2:4]), y[2:4]).backward()
        ps.step()
        ps.flush()
        ps.pull()
        assert ps.clock == 1  # the round, applied by the second server
        ours = learner.pull_state_dict(job)
    for k, v in ours.items():
        assert (v - before[k]).abs().max() <= 0.1 * 2 ** 0.5 * 1.001, k
    second.stop()


@pytest.mark.parametrize("stage", ["before", "after", "closed"])
@pytest.mark.parametrize("sync", ["kasync:2", "bsp"])
def test_a_server_killed_finishing_a_round_applies_it_once(job, serve, monkeypatch, sync, stage):
    """A server SIGKILLed while it finishes a round (PSD_TEST_CRASH_IN_ROUND, a test hook: before the round's
    update, after it, or once the round is closed, before the entry that finished it is handed back): its
    successor finishes the round (update.c recover_round), neither losing it nor applying it again. One learner
    pushes gradients of powers of two under sgd at lr 1, so the weights say which were applied how often.
    kasync:2, 1, 2, 4, 8, 16, 32, the server killed finishing round 2 ({4, 8}): every gradient once, 63 (the
    successor took 8 again into the applied round and applied it again: 83, 8 counted twice). bsp, one
    learner (a round a step), 1, 2, 4, 8, 16, killed finishing round 4 ({8}): 31 (the round's members had
    joined, so it was applied again: 39)."""
    grads = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0) if sync == "kasync:2" else (1.0, 2.0, 4.0, 8.0, 16.0)
    args = ("--no-watchdog", "--learners", "1", "--lr", "1", "--ring-depth", "8", "--sync", sync)
    monkeypatch.setenv("PSD_TEST_CRASH_IN_ROUND", f"{2 if sync == 'kasync:2' else 4}:{stage}")
    first = serve(job, *args)
    monkeypatch.delenv("PSD_TEST_CRASH_IN_ROUND")
    second, failed = [], []
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()

    def take_over() -> None:  # the watchdog's part: a new server once the first died
        try:
            first.proc.wait(timeout=60)
            second.append(serve(job, *args))
        except BaseException as e:  # said by the assertion below, not lost in this thread
            failed.append(repr(e))

    taker = threading.Thread(target=take_over)
    taker.start()
    with learner.attach(model, job=job, reconnect_timeout=90) as ps:
        for g in grads:  # a bsp step waits for its round: the fourth, for the second server
            model.weight.grad = torch.full((1, 4), g)
            ps.step()
        ps.flush()
        taker.join(timeout=120)
        assert not failed and second and first.proc.returncode == -signal.SIGKILL, ("no crash in the round", failed)
        counters = ps._arena.counters()
    w = learner.pull_state_dict(job)["weight"]
    assert torch.equal(w, torch.full((1, 4), -sum(grads))), w
    assert ps.pushed == len(grads) and counters["applied"] == len(grads) and counters["pending"] == 0, counters
    second[0].stop()


def test_a_round_a_dead_server_was_finishing_is_finished_from_its_checkpoint(job, serve, monkeypatch, tmp_path):
    """A snapshot of a dead server's arena (`psd checkpoint`, no watchdog alive) taken while it was finishing a kasync
    round, before the round's update: the checkpoint carries round_applying, and the server that resumes from it
    finishes the round. Four gradients of ones at lr 1 under kasync:2: round 1 applied (-2), round 2 begun;
    resumed, -4 (without the marks -2, the round's sum left open as the next round's start)."""
    args = ("--no-watchdog", "--learners", "1", "--lr", "1", "--ring-depth", "8", "--sync", "kasync:2")
    monkeypatch.setenv("PSD_TEST_CRASH_IN_ROUND", "2:before")
    first = serve(job, *args)
    monkeypatch.delenv("PSD_TEST_CRASH_IN_ROUND")
    p = spawn("pusher.py", job, "--n", "8", "--count", "4", "--fill")
    try:
        assert read_line(p) == "ready"
        first.proc.wait(timeout=60)
        assert first.proc.returncode == -signal.SIGKILL
    finally:
        kill(p)
    assert arena_header(job)["round_applying"] == 2
    for cmd in (["checkpoint", "--job", job, "--checkpoint-dir", str(tmp_path)], ["clean", "--job", job]):
        subprocess.run([sys.executable, "-m", "psd.cli", *cmd], env=child_env(), check=True, capture_output=True,
                       timeout=60)
    assert not os.path.exists(shm_path(job)), "psd clean left the dead job's arena: the resume would take it over"
    served = serve(job, *args, "--resume", str(tmp_path))
    wait_until(lambda: arena_header(job)["state"] == _native.ARENA_READY and arena_header(job)["round_applying"] == 0,
               what="the resumed server to finish the round")
    h = arena_header(job)
    assert (h["rounds"], h["acc_count"], h["clock"]) == (2, 0, 2)
    assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((8,), -4.0))
    served.stop()


def test_a_snapshot_begun_on_a_dead_server_is_not_written_under_by_its_successor(job, serve, monkeypatch):
    """A pause (a snapshot: the watchdog's, `psd checkpoint`) asked for while the server lies dead inside a round's
    finish holds the next server's loop before its recovery (update.c recover_round) writes the round into the
    weights the snapshot is copying; once resumed, the round is finished. Four gradients of ones, kasync:2, the
    server killed before round 2's update: -2 while paused, -4 after."""
    args = ("--no-watchdog", "--learners", "1", "--lr", "1", "--ring-depth", "8", "--sync", "kasync:2")
    monkeypatch.setenv("PSD_TEST_CRASH_IN_ROUND", "2:before")
    first = serve(job, *args)
    monkeypatch.delenv("PSD_TEST_CRASH_IN_ROUND")
    me = os.getpid()
    a = open_job(job)
    p = spawn("pusher.py", job, "--n", "8", "--count", "4", "--fill")
    try:
        assert read_line(p) == "ready"
        first.proc.wait(timeout=60)
        assert first.proc.returncode == -signal.SIGKILL
        a.pause(me, _native.proc_start_time(me), 10.0)  # no loop runs: returns at once, the request stays
        second = serve(job, *args)
        wait_until(lambda: arena_header(job)["paused"] == 1, what="the next server's loop to pause")
        h = arena_header(job)
        assert (h["rounds"], h["round_applying"]) == (1, 2), "the round was finished under the snapshot"
        assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((8,), -2.0))
        a.resume()
        wait_until(lambda: arena_header(job)["round_applying"] == 0, what="the round's finish")
        assert arena_header(job)["rounds"] == 2
        assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((8,), -4.0))
    finally:
        a.close()
        kill(p)
    second.stop()


def test_a_round_held_by_a_node_link_when_its_server_died_stays_held(job, serve):
    """A node link holds the loop at a clock (psd_hold: right after the update that reaches it, before bsp's or
    kasync's round moves on). A server SIGKILLed while held inside a round's finish: its successor finishes the
    round (update.c recover_round) only once the hold is let go, so learners waiting for the round do not take
    weights the link is still writing. Four gradients of ones, kasync:2, held at clock 2 (round 2's update)."""
    args = ("--no-watchdog", "--learners", "1", "--lr", "1", "--ring-depth", "8", "--sync", "kasync:2")
    first = serve(job, *args)
    me = os.getpid()
    a = open_job(job)
    p = spawn("pusher.py", job, "--n", "8", "--count", "4", "--fill")
    try:
        a.hold(me, _native.proc_start_time(me), 2)
        assert read_line(p) == "ready"
        wait_until(lambda: arena_header(job)["held"] == 1, what="the loop to hold in round 2")
        h = arena_header(job)
        assert (h["rounds"], h["clock"], h["round_applying"], h["round_applied"]) == (1, 2, 2, 2)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
        second = serve(job, *args)
        wait_until(lambda: arena_header(job)["held"] == 1, what="the next server's loop to hold")
        h = arena_header(job)
        assert (h["rounds"], h["clock"], h["round_applying"]) == (1, 2, 2), "the round moved on under the hold"
        a.hold(me, _native.proc_start_time(me), -1)  # the link is done
        wait_until(lambda: arena_header(job)["round_applying"] == 0, what="the round's finish")
        h = arena_header(job)
        assert (h["rounds"], h["clock"], h["acc_count"]) == (2, 2, 0)
        assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((8,), -4.0))
    finally:
        a.close()
        kill(p)
    second.stop()


@pytest.mark.parametrize("flags", [["--sync", "kasync:3"], ["--sync", "asp"], ["--sync", "bsp"]])
def test_a_step_without_gradients_is_no_update(job, serve, flags):
    """A step that carries no gradient (every p.grad None: a framework's step after a skipped backward) is no
    update: the clock does not move, and under kasync it is not one of the K gradients of a round (else
    kasync:3 would sum two real gradients with an empty one and make a round of two). Under asp and kasync it
    pushes nothing; under bsp it is pushed empty (the round waits on every learner's step) and applied as no update."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.1", *flags)
    model, x, y = linear_problem()
    with learner.attach(model, job=job) as ps:
        for _ in range(2):  # empty steps first, and between the real ones
            ps.step()
            ps.flush()
        assert ps.clock == 0
        for i in range(6):
            torch.nn.functional.mse_loss(model(x[i:i + 2]), y[i:i + 2]).backward()
            ps.step()
            ps.flush()
            ps.pull()
            if i == 2:
                ps.step()  # and one in the middle of a round
                ps.flush()
        c = ps._arena.counters()
        # Every real step exactly once; empty ones pushed only under bsp, where the round waits on them.
        pushes = 9 if "bsp" in flags else 6
        assert c["applied"] == c["pushed"] == pushes and ps.pushed == pushes
        ours = learner.pull_state_dict(job)
        assert ps.clock == (2 if "kasync:3" in flags else 6)
    ref = reference([3, 3] if "kasync:3" in flags else [1] * 6, 0.1, "sum")
    for k, v in ref.items():
        assert torch.allclose(ours[k], v, rtol=1e-6, atol=1e-7), k
    served.stop()


# -- staleness control, non-finite gradients -----------------------------------


def stale_setup(job):
    """Two learners on one job; B pushes 3 updates while A still holds the weights of clock 0."""
    torch.manual_seed(0)
    ma, mb = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    mb.load_state_dict(ma.state_dict())
    a = learner.attach(ma, job=job)
    b = learner.attach(mb, job=job)
    x = torch.randn(2, 4)
    for _ in range(3):
        mb(x).sum().backward()
        b.step()
        b.flush()
    return a, b, ma, x


def test_max_staleness_drops_and_counts_stale_gradients(job, serve):
    served = serve(job, "--no-watchdog", "--learners", "2", "--max-staleness", "2")
    a, b, ma, x = stale_setup(job)
    before = learner.pull_state_dict(job)
    ma(x).sum().backward()
    a.step()  # computed on clock 0, meets clock 3: staleness 3 > 2
    a.flush()
    after = learner.pull_state_dict(job)
    for k in before:
        assert torch.equal(before[k], after[k]), "a dropped gradient must not change the weights"
    h = header(job)
    assert (h["dropped"], h["counters"]["applied"], h["clock"]) == (1, 3, 3)
    assert a._arena.slot_info(a.slot)["dropped"] == 1
    assert a._arena.entry_meta(a.slot, 0)["outcome"] == _native.OUTCOME_DROPPED
    a.close()
    b.close()
    assert "1 dropped (stale)" in served.stop()


def test_staleness_lr_divides_the_step_by_the_staleness(job, serve):
    served = serve(job, "--no-watchdog", "--learners", "2", "--lr", "0.5", "--staleness-lr")
    a, b, ma, x = stale_setup(job)
    before = learner.pull_state_dict(job)
    ma(x).sum().backward()
    grads = {k: p.grad.clone() for k, p in ma.named_parameters()}
    a.step()  # staleness 3: lr 0.5 / 3
    a.flush()
    after = learner.pull_state_dict(job)
    for k in before:
        assert torch.allclose(before[k] - after[k], (0.5 / 3) * grads[k], rtol=1e-5), k
    meta = a._arena.entry_meta(a.slot, 0)
    assert meta["applied_clock"] - meta["clock"] == 3
    a.close()
    b.close()
    served.stop()


@pytest.mark.parametrize("mode", ["auto", "auto-undamped", "off"])
def test_async_momentum_auto_damps_a_gradient_staler_than_the_mean(job, serve, mode):
    """B's three gradients arrive nearly fresh (staleness 0 to 2: the running mean tau stays near 0);
    A's, computed on clock 0, meets clock 3: under auto its lr is scaled by (1 + tau) / (1 + 3), by as much
    of that as the header's damping says (all of it from the arena's creation: psd/gain.py damping). A
    server steers the damping only with a momentum in (0, 1); here the test writes 0 in its place.
    Momentum 0 keeps the arithmetic that of plain SGD, so the step is exactly lr x factor x gradient."""
    served = serve(job, "--no-watchdog", "--learners", "2", "--optimizer", "momentum", "--momentum", "0", "--lr", "0.5",
                   "--async-momentum", mode.split("-")[0])
    a, b, ma, x = stale_setup(job)
    h = header(job)
    tau = h["staleness_avg"]
    assert 0.0 <= tau < 0.1
    assert h["damping"] == 1.0  # the arena's own value: the server never set it (momentum 0)
    if mode == "auto-undamped":
        server_side = open_job(job)
        server_side.set_gain_level(0.0, 0.0)
        assert header(job)["damping"] == 0.0
        server_side.close()
    factor = (1 + tau) / (1 + 3) if mode == "auto" else 1.0
    before = learner.pull_state_dict(job)
    ma(x).sum().backward()
    grads = {k: p.grad.clone() for k, p in ma.named_parameters()}
    a.step()
    a.flush()
    after = learner.pull_state_dict(job)
    for k in before:
        assert torch.allclose(before[k] - after[k], 0.5 * factor * grads[k], rtol=1e-5), k
    assert a._arena.entry_meta(a.slot, 0)["applied_clock"] == 3
    a.close()
    b.close()
    served.stop()


def push(lrn, loss, times: int = 1) -> None:
    """``times`` steps of ``lrn`` on the gradient of ``loss()``, each applied before the next."""
    for _ in range(times):
        loss().backward()
        lrn.step()
        lrn.flush()


def stale_rounds(a, loss_a, b, loss_b, rounds: int = 30) -> None:
    """B's three fresh gradients, then A's computed three updates ago, ``rounds`` times: a running mean of
    staleness near 0.7 (the hold tests' departure then holds it)."""
    for _ in range(rounds):
        push(b, loss_b, 3)
        push(a, loss_a)


def test_the_momentum_rules_staleness_is_held_when_a_learner_leaves(job, serve):
    """Under auto the momentum rule reads the running mean of staleness, or the mean it met when the job last
    lost a learner where that is larger (psd_rule_staleness): at a job's end its learners finish one after
    another and the mean falls, which would raise the momentum several-fold over the last updates. B's
    departure holds the mean of that moment; the hold decays by 1 - 1/1024 an update where the mean decays by
    1 - 1/64; an arrival releases it. Momentum 0 makes the rule's staleness visible in the step itself: the
    damping of a gradient staler than it, lr x (1 + tau) / (1 + staleness) (as in the test above), at gain
    level 0 and at 0.5: below level 1 a falling staleness raises the gain too, so the hold holds at every level."""
    served = serve(job, "--no-watchdog", "--learners", "4", "--optimizer", "momentum", "--momentum", "0",
                   "--lr", "0.5")
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 1) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    a, b, c = (learner.attach(m, job=job) for m in models)
    ma, mb, mc = models
    x = torch.randn(2, 4)
    stale_rounds(a, lambda: ma(x).sum(), b, lambda: mb(x).sum())
    h = header(job)
    avg = h["staleness_avg"]
    assert avg > 0.3 and h["staleness_held"] == 0.0
    b.close()  # a departure
    h = wait_until(lambda: (hh := header(job))["staleness_held"] > 0 and hh, what="the loop to see B leave")
    assert h["staleness_held"] == avg == h["staleness_avg"]  # the mean of that moment, held
    push(a, lambda: ma(x).sum(), 64)  # A alone: 64 fresh gradients
    h = header(job)
    assert h["staleness_avg"] == pytest.approx(avg * (1 - 1 / 64) ** 64, rel=1e-9)
    assert h["staleness_held"] == pytest.approx(avg * (1 - 1 / 1024) ** 64, rel=1e-9)
    c.pull()  # C has not pushed since it attached: fresh weights first
    for level in (0.0, 0.5):
        if level:  # the hold holds at every level (benchmarks/results/matrix/README.md, trial-hold-by-level)
            server_side = open_job(job)
            server_side.set_gain_level(level, 1.0)  # the server steers nothing at momentum 0
            server_side.close()
        # C moves the clock three updates while A holds its weights: A's gradient is staler than the held mean.
        ma(x).sum().backward()
        grads = {k: p.grad.clone() for k, p in ma.named_parameters()}
        push(c, lambda: mc(x).sum(), 3)
        h = header(job)
        mean, held = h["staleness_avg"], h["staleness_held"]
        tau = held  # what the loop's rule reads at A's update
        assert h["gain_level"] == level and h["staleness_rule"] == tau
        before = learner.pull_state_dict(job)
        a.step()
        a.flush()
        after = learner.pull_state_dict(job)
        meta = a._arena.entry_meta(a.slot, a.pushed - 1)
        staleness = meta["applied_clock"] - meta["clock"]
        assert staleness > tau > mean + 0.2  # the damping from the mean would differ by far more than 1e-5
        for k in before:  # damped as from the held staleness, not the running mean
            ulps = 4 * torch.finfo(torch.float32).eps * float(before[k].abs().max())  # the weights have grown
            assert torch.allclose(before[k] - after[k], 0.5 * (1 + tau) / (1 + staleness) * grads[k], rtol=1e-5,
                                  atol=ulps), k
    d = learner.attach(torch.nn.Linear(4, 1), job=job)  # an arrival releases the hold
    wait_until(lambda: header(job)["staleness_held"] == 0.0, what="the loop to see D arrive")
    for lrn in (a, c, d):
        lrn.close()
    served.stop()


def test_a_reaped_learner_holds_the_staleness_and_a_new_server_keeps_the_hold(job, serve):
    """A learner SIGKILLed (the server reaps its slot) is a departure as one that detaches is; a server that
    takes over (the watchdog restarts a killed one) goes on with the hold the last one published and decays
    it from there."""
    serve(job, "--learners", "4", "--optimizer", "momentum", "--momentum", "0", "--lr", "0.01")
    idler = spawn("holder.py", job, "--idle")  # attaches a model of one tensor `w` (64) and blocks
    assert read_line(idler) == "ready"
    models = []
    for _ in range(2):
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(torch.zeros(64))
        models.append(m)
    ma, mb = models
    a, b = learner.attach(ma, job=job), learner.attach(mb, job=job)
    x = torch.randn(64)
    stale_rounds(a, lambda: (ma.w * x).sum(), b, lambda: (mb.w * x).sum())
    h = header(job)
    avg = h["staleness_avg"]
    assert avg > 0.3 and h["staleness_held"] == 0.0
    kill(idler)
    old = wait_until(lambda: (hh := header(job))["staleness_held"] > 0 and hh, what="the server to reap the idler")
    assert old["staleness_held"] == avg
    os.kill(old["server_pid"], signal.SIGKILL)
    wait_until(lambda: header(job)["generation"] == old["generation"] + 1, what="the watchdog's new server")
    a.pull()  # fresh weights: A's next gradient meets no update (staleness 0), under the held mean
    push(a, lambda: (ma.w * x).sum())  # applied by the new server
    h = header(job)
    assert h["server_pid"] != old["server_pid"] and h["staleness_avg"] < h["staleness_held"]
    assert h["staleness_held"] == pytest.approx(avg * (1 - 1 / 1024), rel=1e-12)
    a.close()
    b.close()


def test_pauses_neither_hold_nor_release_the_staleness(job, serve):
    """A pause (a snapshot) asked for while the loop takes one ring's entry stops the pass's taking, but not its
    count of the slots in use: a pass cut short would count fewer, then the next one more, and that "arrival"
    would release a hold. Here B left (a hold), and A pushes fresh gradients (the mean falls under the hold)
    while pauses come and go, C attached behind it: the hold stays, decayed by A's updates alone."""
    import threading

    served = serve(job, "--no-watchdog", "--learners", "4", "--optimizer", "momentum", "--momentum", "0",
                   "--lr", "0.001")
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 1) for _ in range(3)]
    a, b, c = (learner.attach(m, job=job) for m in models)
    ma, mb, _ = models  # C stays attached, behind A in the pass, and pushes nothing
    x = torch.randn(2, 4)
    stale_rounds(a, lambda: ma(x).sum(), b, lambda: mb(x).sum())
    b.close()
    held = wait_until(lambda: header(job)["staleness_held"], what="the loop to see B leave")
    a.pull()
    clock = header(job)["clock"]
    pusher = threading.Thread(target=push, args=(a, lambda: ma(x).sum(), 300))
    pusher.start()
    arena, me = open_job(job), os.getpid()
    try:
        while pusher.is_alive():
            arena.pause(me, _native.proc_start_time(me), 5.0)
            arena.resume()
    finally:
        arena.close()
    pusher.join()
    h = header(job)
    assert h["clock"] == clock + 300 and h["staleness_avg"] < h["staleness_held"]
    assert h["staleness_held"] == pytest.approx(held * (1 - 1 / 1024) ** 300, rel=1e-9), "released under pauses"
    for lrn in (a, c):
        lrn.close()
    served.stop()


# (case, the server's flags, B's fresh updates before A's gradient, the lr A's gradient takes out of 0.1)
ADAGRAD_CASES = [("young", [], 3, 0.1 / 4), ("last-young", [], 15, 0.1 / 16), ("grown", [], 16, 0.1),
                 ("off", ["--async-momentum", "off"], 3, 0.1), ("staleness-lr", ["--staleness-lr"], 3, 0.1 / 3)]


@pytest.mark.parametrize("case, flags, fresh, lr_a", ADAGRAD_CASES, ids=[c[0] for c in ADAGRAD_CASES])
def test_adagrad_damps_the_lr_of_its_first_updates_by_the_staleness(job, serve, case, flags, fresh, lr_a):
    """Under auto, an Adagrad job's first 16 updates take lr / (1 + staleness) (psd_adagrad_start_factor):
    B's fresh gradients (staleness 0) step at the lr; A's, computed on clock 0, meets clock ``fresh`` and is
    update number ``fresh`` (0 the first): lr / 4 as update 3, lr / 16 as update 15 (the window's last), the lr
    as update 16, as under off; with --staleness-lr that flag alone divides it (by the staleness, 3).
    Checked against torch.optim.Adagrad replaying the same gradients at those lrs."""
    served = serve(job, "--no-watchdog", "--learners", "2", "--optimizer", "adagrad", "--lr", "0.1", *flags)
    torch.manual_seed(0)
    ma, mb = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    mb.load_state_dict(ma.state_dict())
    ref = torch.nn.Linear(4, 1)
    ref.load_state_dict(ma.state_dict())
    opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    a = learner.attach(ma, job=job)
    b = learner.attach(mb, job=job)
    x = torch.randn(2, 4)
    ma(x).sum().backward()  # A's gradient, on the weights of clock 0
    for _ in range(fresh):
        mb(x).sum().backward()
        for p, q in zip(ref.parameters(), mb.parameters(), strict=True):
            p.grad = q.grad.clone()
        opt.step()
        b.step()
        b.flush()
    for p, q in zip(ref.parameters(), ma.parameters(), strict=True):
        p.grad = q.grad.clone()
    opt.param_groups[0]["lr"] = lr_a
    opt.step()
    a.step()
    a.flush()
    meta = a._arena.entry_meta(a.slot, 0)
    assert meta["applied_clock"] - meta["clock"] == fresh
    got = learner.pull_state_dict(job)
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-7), k
    a.close()
    b.close()
    served.stop()


def test_non_finite_gradients_are_rejected_counted_and_reported(job, serve):
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.1")
    model = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with learner.attach(model, job=job) as ps:
        for bad in (None, float("nan"), float("inf"), None):
            model(x).sum().backward()
            if bad is not None:
                model.weight.grad[1, 2] = bad
            ps.step()
            ps.flush()
        w = learner.pull_state_dict(job)
        assert all(torch.isfinite(v).all() for v in w.values())
        h = header(job)
        assert (h["rejected"], h["counters"]["applied"], h["clock"]) == (2, 2, 2)
        assert ps._arena.slot_info(ps.slot)["rejected"] == 2
    log = served.stop()
    assert "2 rejected (non-finite)" in log, log


# -- weight prediction ---------------------------------------------------------


@pytest.mark.parametrize("opt", ["momentum", "adam"])
def test_prediction_equals_the_weights_s_steps_later(job, serve, opt):
    """Constant gradient, settled optimizer: w - lr*s*dw is where s more updates take the weights."""
    # --async-momentum off: the ring's staleness would otherwise lower the momentum the loop applies
    served = serve(job, "--no-watchdog", "--learners", "1", "--optimizer", opt, "--lr", "0.01", "--momentum", "0.5",
                   "--async-momentum", "off")
    g = torch.linspace(-2, 3, 32)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(32))
    s = 7
    with learner.attach(model, job=job) as ps:
        def steps(k):
            for _ in range(k):
                (model.w * g).sum().backward()
                ps.step()
            ps.flush()

        steps(60)  # momentum 0.5: the buffer settles to 1e-18
        a = open_job(job)
        w = learner.pull_state_dict(job)["w"]
        predicted = w.clone()
        a.predict_into(predicted.numpy(), float(s))
        a.close()
        steps(s)
        later = learner.pull_state_dict(job)["w"]
    assert not torch.equal(predicted, w)
    err = ((predicted - later).norm() / later.norm()).item()
    print(f"{opt}: |w_hat - w(t+{s})| / |w(t+{s})| = {err:.2e}; the step itself moved {(later - w).norm():.3g}")
    assert err <= 1e-6
    served.stop()


@pytest.mark.timeout(300)
def test_prediction_brings_the_weights_computed_on_closer_to_those_applied_to(job, serve):
    """8 learners, momentum SGD, a constant gradient (so the weights after c updates are known exactly).

    For every gradient: the distance between the weights it was computed on and the weights it met
    at the server. With --predict that is compared with what it would have been on the pulled
    weights (same run, same staleness); without --predict the two must be the same.
    """
    # Two jobs, without and with --predict; the same 8 learner processes train the first, then the second
    # (8 processes importing torch, where one set for each job took 16).
    flags = ("--no-watchdog", "--learners", "8", "--ring-depth", "1", "--optimizer", "momentum", "--momentum", "0.9",
             "--async-momentum", "off", "--lr", "0.001")
    predicting = f"{job}-predict"
    # One ring entry per learner: staleness then follows the other learners' pace; deep rings let
    # a learner queue several gradients computed on the same weights.
    servers = [serve(job, *flags), serve(predicting, *flags, "--predict")]
    # Each step spends 2 ms of CPU time computing, as a mini-batch would: with steps much shorter
    # than a scheduler time slice, 8 learners on 2 cores run in bursts and staleness is erratic.
    # Forked with torch imported (tests/forked.py): the same script, a process of its own, no torch import apiece.
    procs = [forked.start([sys.executable, str(HELPERS / "sync_learner.py"), "drift", "--job", job, "--then-job",
                           predicting, "--world", "8", "--steps", "150", "--lr", "0.001", "--momentum", "0.9",
                           "--compute-ms", "2"], child_env()) for _ in range(8)]
    runs = [finish(p, timeout=200).strip().splitlines() for p in procs]
    assert all(len(r) == 2 for r in runs), runs  # one line for each job
    off, on = [json.loads(r[0]) for r in runs], [json.loads(r[1]) for r in runs]
    for served in servers:
        served.stop()

    def mean(outs, key):
        return sum(o[key] for o in outs) / len(outs)

    print(f"without --predict: distance {mean(off, 'mean_distance'):.4f}, staleness {mean(off, 'mean_staleness'):.1f}; "
          f"with: distance {mean(on, 'mean_distance'):.4f} where the pulled weights were "
          f"{mean(on, 'mean_distance_unpredicted'):.4f} away, staleness {mean(on, 'mean_staleness'):.1f}")

    # Without --predict a learner trains on the weights it pulled. A pull copies them without a lock while the
    # loop updates them (Hogwild's reads, docs/operations.md), so a few of the 1,200 copies mix two clocks:
    # each adds about 2e-5 to the mean here (measured: 2.0e-5, 2.0e-5, 6.1e-5; 1.02e-4 once, in a fresh
    # clone's suite). Prediction moves them by 100 times more (> 0.01, below).
    assert mean(off, "mean_shift") < 1e-3, "without --predict learners train on the pulled weights"
    assert mean(off, "mean_distance") > 0.01, "8 learners must see some staleness"
    assert mean(on, "mean_shift") > 0.01, "with --predict the weights are moved"
    assert mean(on, "mean_distance") < 0.7 * mean(on, "mean_distance_unpredicted")
    assert mean(on, "mean_distance") < 0.7 * mean(off, "mean_distance")
