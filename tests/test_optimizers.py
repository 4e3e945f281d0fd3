"""Server-side optimizers and schedules against PyTorch's own, and what lives in checkpoints.

One learner in bsp mode makes psd an ordinary synchronous optimizer: each
gradient is computed on the weights the previous update produced. So after N
steps its weights must equal torch.optim's on the same model, data and
hyper-parameters, to float rounding (1e-6 relative). The servers run without a watchdog (its last
checkpoint costs seconds at each stop) but in the checkpoint test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import child_env, wait_until
from psd import _native, learner
from psd.arena import open_job
from psd.status import job_status

STEPS = 25


def make_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 12, generator=g)
    y = torch.randint(0, 3, (64,), generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return model, x, y


def batches(x, y, steps: int, batch: int = 8):
    for i in range(steps):
        j = (i * batch) % len(x)
        yield x[j:j + batch], y[j:j + batch]


def torch_optimizer(opt: str, kw: dict, params) -> torch.optim.Optimizer:
    """torch.optim's single-tensor optimizer for psd's --optimizer opt with hyper-parameters kw."""
    lr, wd = kw["lr"], kw.get("weight_decay", 0)
    if opt == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=wd, foreach=False)
    if opt in ("momentum", "nesterov"):
        return torch.optim.SGD(params, lr=lr, momentum=kw["momentum"], dampening=kw.get("dampening", 0),
                               nesterov=opt == "nesterov", weight_decay=wd, foreach=False)
    if opt == "adam":
        return torch.optim.Adam(params, lr=lr, betas=kw["betas"], eps=kw["eps"], weight_decay=wd, foreach=False)
    if opt == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=kw["betas"], eps=kw["eps"], weight_decay=kw["weight_decay"],
                                 foreach=False)
    return torch.optim.Adagrad(params, lr=lr, lr_decay=kw.get("lr_decay", 0), eps=kw["eps"], weight_decay=wd,
                               foreach=False)


def torch_reference(opt: str, kw: dict, sched: tuple, steps: int) -> dict[str, torch.Tensor]:
    model, x, y = make_problem()
    o = torch_optimizer(opt, kw, model.parameters())
    kind = sched[0]
    if kind == "step":
        s = torch.optim.lr_scheduler.StepLR(o, step_size=sched[1], gamma=sched[2])
    elif kind == "cosine":
        s = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=sched[1], eta_min=sched[2])
    elif kind == "warmup":
        s = torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / sched[1]))
    else:
        s = None
    for xb, yb in batches(x, y, steps):
        o.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        o.step()
        if s is not None:
            s.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def psd_train(model, x, y, job: str, steps: int) -> learner.Learner:
    ps = learner.attach(model, job=job)
    for xb, yb in batches(x, y, steps):
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        ps.step()
    return ps


def assert_close(ours: dict, ref: dict, rtol: float = 1e-6) -> None:
    """Each tensor within rtol of PyTorch's, relative to its norm (element-wise, an FMA in PyTorch's
    vectorised kernels moves values near zero by more than 1e-6 of themselves)."""
    init = make_problem()[0].state_dict()
    for k, v in ref.items():
        err = ((ours[k] - v).norm() / v.norm()).item()
        print(f"{k}: relative difference {err:.2e}")
        assert err <= rtol, f"{k}: relative difference {err:.3g} > {rtol}"
        assert not torch.equal(v, init[k]), "the reference must have trained"


CASES = [
    ("sgd", {"lr": 0.1}, ("constant",), []),
    ("sgd", {"lr": 0.1, "weight_decay": 0.01}, ("constant",), ["--weight-decay", "0.01"]),
    ("momentum", {"lr": 0.05, "momentum": 0.9}, ("constant",), ["--momentum", "0.9"]),
    ("momentum", {"lr": 0.05, "momentum": 0.8, "dampening": 0.1, "weight_decay": 1e-3}, ("constant",),
     ["--momentum", "0.8", "--dampening", "0.1", "--weight-decay", "1e-3"]),
    ("nesterov", {"lr": 0.05, "momentum": 0.9}, ("constant",), ["--momentum", "0.9"]),
    ("adam", {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}, ("constant",), []),
    ("adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01}, ("constant",),
     ["--betas", "0.8", "0.99", "--eps", "1e-6", "--weight-decay", "0.01"]),
    ("adamw", {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.05}, ("constant",),
     ["--weight-decay", "0.05"]),
    ("adagrad", {"lr": 0.05, "eps": 1e-10, "lr_decay": 0.01}, ("constant",), ["--lr-decay", "0.01"]),
    ("sgd", {"lr": 0.1}, ("step", 7, 0.5), ["--schedule", "step", "--step-size", "7", "--gamma", "0.5"]),
    ("momentum", {"lr": 0.05, "momentum": 0.9}, ("cosine", 30, 0.001),
     ["--momentum", "0.9", "--schedule", "cosine", "--t-max", "30", "--eta-min", "0.001"]),
    ("adam", {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}, ("warmup", 10), ["--warmup", "10"]),
]


@pytest.mark.parametrize("opt, kw, sched, flags", CASES,
                         ids=[f"{c[0]}-{'-'.join(map(str, c[2]))}-{i}" for i, c in enumerate(CASES)])
def test_optimizer_matches_pytorch_in_bsp(job, serve, opt, kw, sched, flags):
    served = serve(job, "--no-watchdog", "--learners", "1", "--sync", "bsp", "--optimizer", opt, "--lr", str(kw["lr"]),
                   *flags)
    ref = torch_reference(opt, kw, sched, STEPS)
    model, x, y = make_problem()
    with psd_train(model, x, y, job, STEPS) as ps:
        ps.flush()
        ours = learner.pull_state_dict(job)
        assert ps.clock == STEPS
    assert_close(ours, ref)
    served.stop()


ASP_CASES = [next(c for c in CASES if c[0] == opt and c[2] == ("constant",))
             for opt in ("sgd", "momentum", "nesterov", "adam", "adamw", "adagrad")]


@pytest.mark.parametrize("pull", ["copy", "view"])
@pytest.mark.parametrize("opt, kw, sched, flags", ASP_CASES, ids=[c[0] for c in ASP_CASES])
def test_one_learner_at_default_flags_matches_pytorch(job, serve, opt, kw, sched, flags, pull):
    """asp, the default, in a job of one learner slot (--overlap auto: off there): a learner takes newer
    weights only once the server applied its push, so one learner computes every gradient on the weights
    the previous update produced (staleness 0, and so under --async-momentum auto the configured momentum
    and lr): torch.optim's weights, to 1e-6, through the native step (copy) and with the shared weights as
    the parameters (view)."""
    serve(job, "--no-watchdog", "--learners", "1", "--optimizer", opt, "--lr", str(kw["lr"]), *flags)
    ref = torch_reference(opt, kw, sched, STEPS)
    model, x, y = make_problem()
    with learner.attach(model, job=job, pull=pull) as ps:
        for xb, yb in batches(x, y, STEPS):
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            ps.step()
        ps.flush()
        ours = learner.pull_state_dict(job)
    st = job_status(job)
    assert st["applied"] == STEPS and st["staleness_max"] == 0, st
    assert_close(ours, ref)


BF16_CASES = [
    ("sgd", {"lr": 0.1}, "asp", []),
    ("momentum", {"lr": 0.05, "momentum": 0.9}, "asp", ["--momentum", "0.9", "--async-momentum", "off"]),
    ("adam", {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}, "asp", []),
    ("adagrad", {"lr": 0.05, "eps": 1e-10, "lr_decay": 0.01}, "bsp", ["--lr-decay", "0.01"]),
]


@pytest.mark.parametrize("opt, kw, sync, flags", BF16_CASES, ids=[f"{c[0]}-{c[2]}" for c in BF16_CASES])
def test_grad_dtype_bf16_applies_the_rounded_gradient(job, serve, opt, kw, sync, flags):
    """--grad-dtype bf16: what the server applies is torch.optim's step on each gradient rounded to
    bfloat16 (nearest even), to float rounding: asp (each entry widened in the optimizer's chunks) and
    bsp (widened into the round's sum). The gradients are given, not computed from the weights: Adam's
    and Adagrad's steps are about lr whatever a gradient's size, so a float-rounding difference in
    the weights that moved a computed gradient across a bfloat16 rounding boundary would show."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--sync", sync, "--optimizer", opt, "--lr", str(kw["lr"]),
                   "--grad-dtype", "bf16", *flags)
    gen = torch.Generator().manual_seed(3)
    model = make_problem()[0]
    grads = [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(STEPS)]
    refs = {}
    for rounded in (True, False):
        ref = make_problem()[0]
        o = torch_optimizer(opt, kw, ref.parameters())
        for step in grads:
            for p, g in zip(ref.parameters(), step, strict=True):
                p.grad = g.bfloat16().float() if rounded else g.clone()
            o.step()
        refs[rounded] = ref.state_dict()
    with learner.attach(model, job=job) as ps:
        for step in grads:
            for p, g in zip(model.parameters(), step, strict=True):
                p.grad = g.clone()
            ps.step()
        ps.flush()
        ours = learner.pull_state_dict(job)
    assert_close(ours, refs[True])
    # Not what float32 gradients give: the rounding is really applied.
    assert max(((ours[k] - v).norm() / v.norm()).item() for k, v in refs[False].items()) > 1e-5
    served.stop()


@pytest.mark.parametrize("n", [1000, 300_001])  # under and over the push's non-temporal threshold (1 MiB)
def test_grad_dtype_bf16_rounds_as_torch(job, serve, n):
    """Every value rounds as torch's .bfloat16() does (nearest, ties to even), exactly: ties both ways,
    subnormals, signed zeros, the largest values that stay finite, odd lengths and offsets (the
    vector path's head and tail). SGD with lr 1 from zero weights leaves -g in the weights."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--lr", "1", "--grad-dtype", "bf16")
    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F81_8001, 0x0000_8000, 0x0001_8000,
                            0x8000_0000, 0x0000_0000, 0x7F7F_7FFF, 0xFF7F_7FFF, 0x0080_0000, 0x807F_FFFF],
                           dtype=torch.int64).to(torch.int32)
    values = torch.randn(n, generator=gen).view(torch.int32) & ~0xFFFF | bits  # every low half
    values[:len(special)] = special
    g = values.view(torch.float32)
    assert torch.isfinite(g).all()
    m = torch.nn.Module()
    m.head = torch.nn.Parameter(torch.zeros(3))  # so that the big tensor's span starts unaligned
    m.w = torch.nn.Parameter(torch.zeros(n))
    with learner.attach(m, job=job) as ps:
        m.head.grad = torch.ones(3)
        m.w.grad = g.clone()
        ps.step()
        ps.flush()
        ours = learner.pull_state_dict(job)
    assert torch.equal(ours["w"], -g.bfloat16().float())
    assert torch.equal(ours["head"], -torch.ones(3))
    served.stop()


def test_grad_dtype_bf16_rejects_a_gradient_that_rounds_to_infinity(job, serve):
    """A float32 gradient just below float32's largest is finite, but rounds to an infinity in
    bfloat16: the push flags it, the server rejects it and the weights do not move."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--grad-dtype", "bf16")
    model = torch.nn.Linear(4, 2)
    with learner.attach(model, job=job, pull="view") as ps:
        before = learner.pull_state_dict(job)
        for p in model.parameters():
            p.grad = torch.full_like(p, 3.4e38)
        ps.step()
        ps.flush()
        after = learner.pull_state_dict(job)
    a = open_job(job)
    h = a.header()
    a.close()
    assert (h["rejected"], h["applied"]) == (1, 0)
    assert all(torch.equal(before[k], after[k]) for k in before)
    status = [sys.executable, "-m", "psd.cli", "status", "--job", job]
    st = json.loads(subprocess.run([*status, "--json"], capture_output=True, text=True, env=child_env(),
                                   timeout=60, check=True).stdout)
    assert (st["grad_dtype"], st["rejected"]) == ("bf16", 1)
    text = subprocess.run(status, capture_output=True, text=True, env=child_env(), timeout=60, check=True).stdout
    assert "grad-dtype bf16" in text
    served.stop()


def test_optimizer_state_survives_a_checkpoint_and_resume(job, serve, tmp_path):
    """Adam's moments and step count are in the checkpoint: 10 steps, stop, resume, 15 more == 25 at once."""
    flags = ["--learners", "1", "--sync", "bsp", "--optimizer", "adam", "--lr", "0.01",
             "--checkpoint-dir", str(tmp_path), "--schedule", "step", "--step-size", "12", "--gamma", "0.5"]
    served = serve(job, *flags)
    model, x, y = make_problem()
    data = list(batches(x, y, STEPS))
    with learner.attach(model, job=job) as ps:
        for xb, yb in data[:10]:
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            ps.step()
        ps.flush()
    served.stop()  # a clean stop writes the last checkpoint
    served = serve(job, *flags, "--resume", str(tmp_path))
    a = open_job(job)
    wait_until(lambda: a.state == _native.ARENA_READY, what="the checkpoint to be loaded")
    h = a.header()
    a.close()
    assert (h["opt_steps"], h["clock"]) == (10, 10)
    with learner.attach(model, job=job) as ps:
        for xb, yb in data[10:]:
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            ps.step()
        ps.flush()
        ours = learner.pull_state_dict(job)
    ref = torch_reference("adam", {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}, ("step", 12, 0.5), STEPS)
    assert_close(ours, ref)
    served.stop()


@pytest.mark.parametrize("flags, message", [
    (["--predict"], "--predict needs an optimizer"),
    (["--schedule", "cosine"], "--t-max"),
    (["--schedule", "step"], "--step-size"),
    (["--sync", "ssp"], "--sync must be"),
    (["--sync", "kasync:0"], "K >= 1"),
    (["--push-every", "0"], "--push-every"),
    (["--optimizer", "lamb"], "invalid choice"),
    (["--grad-dtype", "float16"], "invalid choice"),
])
def test_bad_training_flags_are_refused_with_the_fix(job, flags, message):
    r = subprocess.run([sys.executable, "-m", "psd.cli", "serve", "--job", job, *flags], capture_output=True,
                       text=True, env=child_env(), timeout=60)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


def test_every_training_flag_survives_the_trip_through_the_watchdog():
    """The watchdog and `psd run` restart servers from ServeConfig.argv(): nothing may be lost on the way."""
    from psd.cli import _watchdog_config, get_args_parser

    flags = ["serve", "--job", "roundtrip", "--sync", "kasync:3", "--push-every", "2", "--optimizer", "adamw",
             "--momentum", "0.5", "--dampening", "0.1", "--betas", "0.8", "0.95", "--eps", "1e-6",
             "--weight-decay", "0.02", "--lr-decay", "0.001", "--schedule", "cosine", "--t-max", "100",
             "--eta-min", "0.0001", "--warmup", "10", "--step-size", "5", "--gamma", "0.3", "--staleness-lr",
             "--max-staleness", "7", "--predict", "--lr", "0.003", "--grad-dtype", "bf16", "--overlap", "off"]
    first = _watchdog_config(get_args_parser().parse_args(flags)).serve
    again = _watchdog_config(get_args_parser().parse_args(["serve", *first.argv()])).serve
    assert again == first
    assert (again.sync, again.optimizer, again.betas, again.max_staleness, again.predict, again.grad_dtype,
            again.overlap) == ("kasync:3", "adamw", (0.8, 0.95), 7, True, "bf16", "off")
