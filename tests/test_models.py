"""Real models: buffers, low-precision dtypes, frozen parameters, parameters without a gradient, sparse embeddings.

The exact tests run one learner in bsp mode, where psd is an ordinary synchronous optimizer, and compare
with torch.optim (and torch's own BatchNorm statistics) on the same model and data, as test_optimizers does.
The servers run without a watchdog (its last checkpoint costs seconds at each stop) but in the checkpoint test.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import HELPERS, child_env, finish, spawn, wait_until
from psd import _native, learner
from psd.arena import open_job
from psd.errors import SpecError
from psd.state import weights_view

STEPS = 20


def data(seed: int = 0, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)


class Partly(torch.nn.Module):
    """A frozen first layer, a BatchNorm, and a second head used only on odd steps."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.frozen = torch.nn.Linear(12, 16)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Linear(16, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 3)
        self.other = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.bn(torch.tanh(self.body(torch.tanh(self.frozen(x)))))
        return self.head(h) + (self.other(h) if step % 2 else 0)


def batches(x, y, steps: int, batch: int = 8):
    for i in range(steps):
        j = (i * batch) % len(x)
        yield i, x[j:j + batch], y[j:j + batch]


def torch_optimizer(opt: str, params, kw: dict):
    if opt in ("momentum", "nesterov"):
        return torch.optim.SGD(params, lr=kw["lr"], momentum=kw["momentum"], dampening=kw.get("dampening", 0),
                               nesterov=opt == "nesterov", weight_decay=kw.get("weight_decay", 0), foreach=False)
    if opt == "adagrad":
        return torch.optim.Adagrad(params, lr=kw["lr"], weight_decay=kw.get("weight_decay", 0), eps=1e-10,
                                   foreach=False)
    cls = torch.optim.AdamW if opt == "adamw" else torch.optim.Adam
    return cls(params, lr=kw["lr"], weight_decay=kw.get("weight_decay", 0), foreach=False)


def assert_state_close(ours: dict, ref: dict, rtol: float = 1e-6) -> None:
    assert ours.keys() == ref.keys()
    for k, v in ref.items():
        assert ours[k].dtype == v.dtype, k
        if not v.is_floating_point():
            assert torch.equal(ours[k], v), k
            continue
        err = ((ours[k] - v).norm() / v.norm().clamp_min(1e-12)).item()
        assert err <= rtol, f"{k}: relative difference {err:.3g} > {rtol}"


CASES = [
    ("momentum", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
     ["--momentum", "0.9", "--dampening", "0.1", "--weight-decay", "0.01"]),
    ("adam", {"lr": 0.01, "weight_decay": 0.01}, ["--weight-decay", "0.01"]),
    ("adamw", {"lr": 0.01, "weight_decay": 0.05}, ["--weight-decay", "0.05"]),
]


@pytest.mark.parametrize("opt, kw, flags", CASES, ids=[c[0] for c in CASES])
def test_buffers_frozen_and_missing_gradients_match_torch(job, serve, opt, kw, flags):
    """BatchNorm statistics, a frozen layer that weight decay and momentum must not move, and a head
    that has a gradient only every other step (no decay, no momentum step, no Adam moment update
    when it has none): all equal to torch.optim and torch's BatchNorm, step for step."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--sync", "bsp", "--optimizer", opt, "--lr", str(kw["lr"]),
                   *flags)
    x, y = data()
    ref = Partly()
    o = torch_optimizer(opt, [p for p in ref.parameters() if p.requires_grad], kw)
    for i, xb, yb in batches(x, y, STEPS):
        o.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ref(xb, i), yb).backward()
        o.step()
    model = Partly()
    frozen_before = model.frozen.weight.detach().clone()
    with learner.attach(model, job=job) as ps:
        for i, xb, yb in batches(x, y, STEPS):
            torch.nn.functional.cross_entropy(model(xb, i), yb).backward()
            ps.step()
        ps.flush()
        ours = learner.pull_state_dict(job)
    # 1e-5, not 1e-6: the bias before the BatchNorm has a gradient of rounding noise only (the
    # normalisation removes it), which Adam divides by its own root mean square.
    assert_state_close(ours, ref.state_dict(), rtol=1e-5)
    assert torch.equal(ours["frozen.weight"], frozen_before)
    assert ours["bn.num_batches_tracked"].item() == STEPS
    fresh = Partly(seed=1)
    fresh.load_state_dict(ours)  # strict
    served.stop()


def test_buffers_of_several_learners_add_up_and_survive_export_and_resume(job, serve, tmp_path):
    """Each learner's batches move the job's buffers (counters add up over learners); `psd export`
    loads with strict=True; a checkpoint carries the buffers into a resumed job."""
    flags = ["--learners", "2", "--lr", "0.05", "--checkpoint-dir", str(tmp_path / "ckpt")]
    served = serve(job, *flags)
    x, y = data()
    models = [Partly(), Partly()]
    with learner.attach(models[0], job=job) as a, learner.attach(models[1], job=job) as b:
        for i, xb, yb in batches(x, y, 10):
            for m, ps in ((models[0], a), (models[1], b)):
                torch.nn.functional.cross_entropy(m(xb, i), yb).backward()
                ps.step()
        a.flush()
        b.flush()
    state = learner.pull_state_dict(job)
    assert state["bn.num_batches_tracked"].item() == 20  # 10 batches from each learner
    assert not torch.equal(state["bn.running_mean"], torch.zeros(16))
    assert not torch.equal(state["bn.running_var"], torch.ones(16))
    out = tmp_path / "model.pt"
    r = subprocess.run([sys.executable, "-m", "psd.cli", "export", "--job", job, "--out", str(out)],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    fresh = Partly(seed=3)
    fresh.load_state_dict(torch.load(out))  # strict=True by default
    assert torch.equal(fresh.bn.running_mean, state["bn.running_mean"])
    served.stop()  # a clean stop writes the last checkpoint
    served = serve(job, *flags, "--resume", str(tmp_path / "ckpt"))
    arena = open_job(job)
    wait_until(lambda: arena.state == _native.ARENA_READY, what="the checkpoint to be loaded")
    arena.close()
    assert_state_close(learner.pull_state_dict(job), state, rtol=0)
    served.stop()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models_train_on_float32_master_weights(job, serve, dtype):
    """A bf16 / fp16 model attaches: its gradients are converted to float32 in the push, the arena
    keeps float32 weights, the model gets them back in its own dtype, and export gives its dtype."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1", "--sync", "bsp")
    m = torch.nn.Linear(4, 3).to(dtype)
    with torch.no_grad():
        m.weight.zero_()
        m.bias.zero_()
    grads = [torch.tensor(v, dtype=dtype) for v in (0.375, 1e-3, -2.5)]  # 1e-3 is inexact in both dtypes
    with learner.attach(m, job=job) as ps:
        for g in grads:
            m.weight.grad = torch.full((3, 4), 0.0, dtype=dtype) + g
            m.bias.grad = torch.full((3,), 0.0, dtype=dtype) + g
            ps.step()
        ps.flush()
        ps.pull()
        assert m.weight.dtype == dtype
        master = -sum(g.float() for g in grads)
        assert torch.equal(m.weight, torch.full((3, 4), master.item()).to(dtype))
        arena_w = ps._weights[:12].clone()
    assert torch.equal(arena_w, torch.full((12,), master.item()))  # float32 sums of the exact gradients
    state = learner.pull_state_dict(job)
    assert state["weight"].dtype == dtype


@pytest.mark.parametrize("make, message", [
    (lambda: torch.nn.Linear(3, 2).double(), "model.float()"),
    (lambda: torch.nn.ModuleDict({"a": torch.nn.Linear(3, 2), "b": torch.nn.Linear(3, 2).bfloat16()}),
     "share one dtype"),
])
def test_models_psd_cannot_hold_are_refused_with_the_fix(job, serve, make, message):
    serve(job, "--no-watchdog", "--learners", "1")
    with pytest.raises(SpecError, match=message):
        learner.attach(make(), job=job)


class Bag(torch.nn.Module):
    def __init__(self, sparse: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(50, 8, sparse=sparse)
        self.tiny = torch.nn.Embedding(3, 1, sparse=sparse)  # all rows touched: rows take more room than dense
        self.out = torch.nn.Linear(9, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.emb(idx).mean(1), self.tiny(idx % 3).mean(1)], 1))


@pytest.mark.parametrize("opt, grad_dtype", [("sgd", "float32"), ("adagrad", "float32"), ("sgd", "bf16"),
                                            ("momentum", "float32"), ("nesterov", "float32")])
def test_sparse_embeddings_push_rows_and_match_torch(job, serve, opt, grad_dtype):
    """Sparse gradients travel as rows and are applied with torch.optim's sparse semantics: the result
    equals torch.optim on the sparse model (and therefore the dense model's for these optimizers).
    With --grad-dtype bf16 the dense tensors' gradients are rounded to bfloat16, the rows stay float32."""
    served = serve(job, "--no-watchdog", "--learners", "1", "--sync", "bsp", "--optimizer", opt, "--lr", "0.1",
                   "--grad-dtype", grad_dtype)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 50, (STEPS, 4, 5), generator=g)
    y = torch.randint(0, 3, (STEPS, 4), generator=g)
    ref = Bag(sparse=True)
    o = (torch.optim.Adagrad(ref.parameters(), lr=0.1) if opt == "adagrad" else
         torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.0 if opt == "sgd" else 0.9, nesterov=opt == "nesterov"))
    for i in range(STEPS):
        o.zero_grad()
        torch.nn.functional.cross_entropy(ref(idx[i]), y[i]).backward()
        if grad_dtype == "bf16":
            for p in ref.out.parameters():
                p.grad = p.grad.bfloat16().float()
        o.step()
    model = Bag(sparse=True)
    with learner.attach(model, job=job) as ps:
        for i in range(STEPS):
            torch.nn.functional.cross_entropy(model(idx[i]), y[i]).backward()
            ps.step()
        ps.flush()
        ours = learner.pull_state_dict(job)
    assert_state_close(ours, ref.state_dict())
    served.stop()


def test_sparse_embeddings_are_refused_by_optimizers_without_sparse_semantics(job, serve):
    serve(job, "--no-watchdog", "--learners", "1", "--optimizer", "adam")
    with pytest.raises(SpecError, match="--optimizer sgd, momentum, nesterov or adagrad"):
        learner.attach(Bag(sparse=True), job=job)
    with learner.attach(Bag(sparse=False), job=job):  # the same model with a dense embedding is fine
        pass


def _same_as_the_job(ps, job: str) -> bool:
    """Whether the learner's model holds exactly the job's weights."""
    theirs = learner.pull_state_dict(job)
    return all(torch.equal(v.detach(), theirs[k]) for k, v in ps.model.state_dict().items())


def test_a_sparse_model_pulls_only_the_rows_that_changed(job, serve):
    """A learner whose model has sparse gradients copies back only the rows (and dense tensors) that the
    updates since its last pull changed, its own and other learners', as the server's rows log names
    them; when the log cannot tell (another learner pushed more rows than it holds since this one's last
    pull, or the weights were written outside an update), it copies everything. Either way its copy is
    then exactly the job's weights."""
    sys.path.insert(0, str(HELPERS))
    from sparse_pusher import DIM, ROWS, Table

    served = serve(job, "--no-watchdog", "--learners", "2", "--optimizer", "sgd", "--lr", "0.5")
    table = ROWS * DIM * 4
    model = Table()
    g = torch.Generator().manual_seed(0)
    with learner.attach(model, job=job) as ps:
        def train(steps: int) -> None:
            for _ in range(steps):
                idx = torch.randint(0, 100, (1, 8), generator=g)
                torch.nn.functional.cross_entropy(model(idx), torch.zeros(1, dtype=torch.long)).backward()
                ps.step()

        # Another learner pushes rows this one never touches, while this one trains on its own.
        other = spawn("sparse_pusher.py", job, "--rows", "10000", "20000", "--steps", "60", "--per-step", "16")
        before = ps.pulled_bytes
        train(60)
        assert finish(other, timeout=120).strip() == "done 60"
        ps.flush()
        ps.step()  # no gradient: only the newer weights, the other learner's last rows among them
        assert _same_as_the_job(ps, job)
        # 60 pulls of a table of 1.28 MB: each copied the rows of a few updates, not the table.
        assert 0 < ps.pulled_bytes - before < table, (ps.pulled_bytes - before, table)

        # More rows than the log holds (8192 entries for this model) since this learner's last pull.
        before = ps.pulled_bytes
        other = spawn("sparse_pusher.py", job, "--rows", "0", "20000", "--steps", "60", "--per-step", "300")
        assert finish(other, timeout=120).strip() == "done 60"
        ps.step()
        assert _same_as_the_job(ps, job)
        assert ps.pulled_bytes - before >= table  # everything, once

        # Weights written outside an update (as the node link's exchange does): the same clock, a new epoch.
        a = open_job(job)
        try:
            w = weights_view(a, a.header())
            w[5 * DIM:6 * DIM] += 1.0
            a.note_weights_written()
        finally:
            del w
            a.close()
        ps.step()
        assert _same_as_the_job(ps, job)
    served.stop()
