"""psd.learner.Optimizer: a torch.optim.Optimizer that trains through a job, against a real `psd serve`.

The servers run without a watchdog: nothing here needs one, and its last checkpoint costs seconds at each stop.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from psd import learner
from psd.errors import Error
from psd.learner.device import DeviceLearner
from psd.status import job_status
from psd.workloads import evaluate, make_classification, make_mlp, train_single


class Flat(torch.nn.Module):
    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


def assert_all_applied(job: str, steps: int) -> None:
    st = job_status(job)
    assert st["pushed"] == st["applied"] == steps, st
    assert st["rejected"] == st["dropped"] == st["pending"] == 0, st


def test_a_plain_training_loop_trains_the_mlp_through_the_job(job, serve):
    """The loop of torch.optim.SGD, unchanged but for the line that makes the optimizer."""
    torch.set_num_threads(1)
    epochs, batch, lr = 2, 8, 0.025
    serve(job, "--no-watchdog", "--learners", "1", "--lr", str(lr))
    data = make_classification(0)
    model = make_mlp(data.dim, data.classes)
    opt = learner.Optimizer(model, job=job, batch_size=batch)  # was: torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    steps = 0
    with opt:
        for _ in range(epochs):
            order = torch.randperm(len(data.x_train), generator=g)
            for i in range(0, len(order), batch):
                idx = order[i:i + batch]
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
                loss.backward()
                opt.step()
                steps += 1
        opt.learner.flush()
        opt.learner.pull()
        ours = evaluate(model, data)
    assert_all_applied(job, steps)
    assert opt.learner.pushed == steps
    single = evaluate(train_single(data, epochs, batch, lr), data)
    print(f"{steps} steps: psd.learner.Optimizer {ours:.4f}, torch.optim.SGD {single:.4f}")
    assert ours > 0.95 and ours >= single - 0.01


def test_step_with_a_closure_returns_its_loss_and_pushes_its_gradient(job, serve):
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1")
    m = Flat()
    c = torch.linspace(-1, 1, 16)
    with learner.Optimizer(m, job=job) as opt:
        calls = []

        def closure():
            opt.zero_grad()
            loss = (m.w * c).sum() + 2.5
            loss.backward()
            calls.append(loss)
            return loss

        with torch.no_grad():  # as torch's optimizers do, the closure runs with gradients enabled
            out = opt.step(closure)
        assert len(calls) == 1 and out is calls[0]
        assert out.item() == 2.5
        opt.learner.flush()
        assert job_status(job)["learners"][0]["last_loss"] == 2.5  # recorded with the gradient
    assert torch.equal(learner.pull_state_dict(job)["w"], -c)
    assert_all_applied(job, 1)


def test_param_groups_report_the_servers_scheduled_learning_rate(job, serve):
    """A step schedule under bsp (each step returns once its update is applied): param_groups follow the
    server's lr as `psd status` shows it, whatever the user or a torch lr_scheduler writes there."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.1", "--sync", "bsp", "--schedule", "step",
          "--step-size", "3", "--gamma", "0.5")
    m = Flat()
    with learner.Optimizer(m, job=job) as opt:
        assert opt.param_groups[0]["lr"] == opt.defaults["lr"] == 0.1  # before any update: that of the first
        # A torch lr_scheduler writes param_groups from step 4 on: the first write warns (at the next step), and
        # every step shows the server's value again.
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
        seen = []
        for k in range(1, 8):
            m.w.sum().backward()
            if k == 5:
                with pytest.warns(UserWarning, match=r"server's learning rate .*psd serve --job"):
                    opt.step()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # only the first change warns
                    opt.step()
            lr = opt.param_groups[0]["lr"]
            assert lr == job_status(job)["lr_now"], k
            seen.append(lr)
            if k >= 4:
                sched.step()
    assert seen == [0.1 * 0.5 ** ((k - 1) // 3) for k in range(1, 8)]  # 0.1 0.1 0.1 0.05 0.05 0.05 0.025
    assert_all_applied(job, 7)


@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning")  # from inside inductor
@pytest.mark.timeout(300)  # inductor's first compile: about 6 s, 40 s with an empty cache on 2 busy cores
def test_a_compiled_model_trains_through_it(job, serve):
    torch.set_num_threads(1)
    batch = 16
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "0.05")
    data = make_classification(0)
    model = make_mlp(data.dim, data.classes)
    compiled = torch.compile(model)
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses = []
    with learner.Optimizer(compiled, job=job, batch_size=batch) as opt:
        # The job has the plain model's names: a compiled learner and an eager one share it.
        assert list(learner.pull_state_dict(job)) == list(w0)

        def train(i: int) -> None:
            x, y = data.x_train[i * batch:(i + 1) * batch], data.y_train[i * batch:(i + 1) * batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(compiled(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())

        train(0)  # compiles
        # Swapping in pulled weights must not recompile (nor fall back to eager after the recompile limit).
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(1, 300):
                train(i)
        opt.learner.flush()
        opt.learner.pull()
        with torch.no_grad():
            out = compiled(data.x_test)
    assert_all_applied(job, 300)
    first, last = sum(losses[:30]) / 30, sum(losses[-30:]) / 30
    print(f"compiled model: loss {first:.3f} -> {last:.3f}")
    assert last < 0.6 * first
    final = learner.pull_state_dict(job)
    assert all(not torch.equal(final[k], w0[k]) for k in w0)
    # The compiled model computes with the job's weights (swapped in by step()/pull()), not stale ones.
    eager = make_mlp(data.dim, data.classes)
    eager.load_state_dict(final)
    with torch.no_grad():
        assert torch.allclose(out, eager(data.x_test), atol=1e-5)
    assert (out.argmax(1) == data.y_test).float().mean() > 0.8


def test_it_is_a_torch_optimizer_and_zero_grad_works_either_way(job, serve):
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1")
    m = Flat()
    c = torch.linspace(-1, 1, 16)
    with pytest.raises(TypeError, match=r"Optimizer\(model, job=...\)"):
        learner.Optimizer(m.parameters(), job=job)
    calls = []
    with learner.Optimizer(m, job=job) as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        assert opt.param_groups[0]["params"] == list(m.parameters())
        # Step hooks, the optimizer's own and global ones, run once a step, as torch's optimizers run them.
        handles = [
            opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o, args[0]))),
            opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o, args[0]))),
            register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global", o, a[0]))),
        ]
        (m.w * 5.0).sum().backward()
        opt.zero_grad(set_to_none=False)
        assert m.w.grad is not None and torch.equal(m.w.grad, torch.zeros(16))
        (m.w * c).sum().backward()  # adds into the zeros: exactly c
        opt.step()
        assert m.w.grad is None  # step() resets it, as zero_grad() would
        opt.zero_grad(set_to_none=False)  # harmless on None gradients
        opt.zero_grad()
        (m.w * 7.0).sum().backward()
        opt.zero_grad()
        assert m.w.grad is None
        opt.learner.flush()
        clock = opt.learner._arena.clock()
        opt.step()  # no gradient: nothing is pushed, no update (the clock stays)
        opt.learner.flush()
        assert opt.learner.pushed == 1 and opt.learner._arena.clock() == clock
        for h in handles:
            h.remove()
        assert calls == [("global", opt, opt), ("pre", opt, opt), ("post", opt, opt)] * 2
        with pytest.raises(Error, match="cannot add parameters"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})

        # Frameworks checkpoint the optimizer: the state is the server's, and loading changes nothing.
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        sd = torch.load(buf)
        assert sd["state"] == {} and sd["psd"]["job"] == job and sd["psd"]["optimizer"] == "sgd"
        assert sd["psd"]["clock"] == opt.learner.clock and "psd serve --resume" in sd["psd"]["note"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.load_state_dict(sd)
        sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(16))], lr=0.1, momentum=0.9)
        sgd.param_groups[0]["params"][0].grad = torch.ones(16)
        sgd.step()
        with pytest.warns(UserWarning, match="ignoring another optimizer's state"):
            opt.load_state_dict(sgd.state_dict())
        assert opt.param_groups[0]["lr"] == 1.0
    assert torch.equal(learner.pull_state_dict(job)["w"], -c)
    assert_all_applied(job, 1)


def test_zero_grad_keeps_an_unfinished_push_every_wave(job, serve):
    """With --push-every 2 the usual zero_grad(); backward(); step() loop pushes each pair's mean."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1", "--push-every", "2")
    m = Flat()
    grads = [torch.full((16,), v) for v in (1.0, 3.0, 10.0, 20.0)]
    with learner.Optimizer(m, job=job) as opt:
        for g in grads:
            opt.zero_grad()
            (m.w * g).sum().backward()
            opt.step()
    assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((16,), -(2.0 + 15.0)))
    assert_all_applied(job, 2)


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "device"])
def test_push_every_sums_in_psds_buffer_whatever_zeroes_p_grad(job, serve, device):
    """--push-every 2 with the HF Trainer's habit (model.zero_grad() after each optimizer step, i.e. p.grad set
    to None) and with in-place zeroing (zero_grad(set_to_none=False)) between the wave's steps: each wave pushes
    the mean of its two gradients. An empty step counts toward no wave."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1", "--push-every", "2")
    m = Flat()
    grads = [torch.full((16,), v) for v in (1.0, 3.0, 10.0, 20.0)]
    kw = {"learner": DeviceLearner(m, job)} if device else {"job": job}
    with learner.Optimizer(m, **kw) as opt:
        for i, g in enumerate(grads):
            (m.w * g).sum().backward()
            opt.step()
            if i == 1:
                opt.step()  # no gradient: no update, and the next wave still takes two mini-batches
            if m.w.grad is not None:
                m.w.grad.zero_()  # in place, as zero_grad(set_to_none=False) does
            m.zero_grad()  # set_to_none, as the HF Trainer does after each optimizer step
        if not device:  # an unfinished wave: close() pushes its mean, nothing is lost
            (m.w * 100.0).sum().backward()
            opt.step()
    tail = 0.0 if device else 100.0
    assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((16,), -(2.0 + 15.0 + tail)))
    assert_all_applied(job, 2 if device else 3)


def test_empty_steps_are_no_update_under_kasync(job, serve):
    """kasync:2 sums two gradients per update: empty steps between them must not count as one."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1", "--sync", "kasync:2")
    m = Flat()
    with learner.Optimizer(m, job=job) as opt:
        for v in (2.0, 4.0):
            opt.step()  # nothing to push
            (m.w * v).sum().backward()
            opt.step()
            opt.step()
    assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((16,), -6.0))  # one update, their sum
    st = job_status(job)
    assert st["pushed"] == st["applied"] == 2, st


class TwoPart(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.enc(x)))


def test_several_optimizers_in_one_process_share_its_slot(job, serve):
    """One optimizer per sub-module (GAN, encoder/head): one slot between them, each step() pushes its own
    parameters' gradients and leaves the others' alone; the slot frees when the last closes."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1")
    torch.manual_seed(0)
    m = TwoPart()
    x = torch.randn(8, 4)
    opt_all = learner.Optimizer(m, job=job)
    opt_enc = learner.Optimizer(m, job=job, params=m.enc.parameters())  # params= of the attached model
    opt_head = learner.Optimizer(m.head, job=job)  # a sub-module of the model attached in this process
    assert opt_enc.learner is opt_head.learner is opt_all.learner
    assert len(job_status(job)["learners"]) == 1
    before = {k: v.clone() for k, v in learner.pull_state_dict(job).items()}
    m(x).pow(2).sum().backward()
    g_head = m.head.weight.grad.clone()
    opt_enc.step()
    assert m.head.weight.grad is not None and m.enc.weight.grad is None  # head's gradient left for its own step
    opt_enc.learner.flush()
    now = learner.pull_state_dict(job)
    assert torch.equal(now["head.weight"], before["head.weight"]) and not torch.equal(now["enc.weight"],
                                                                                       before["enc.weight"])
    opt_head.step()
    opt_head.learner.flush()
    assert torch.allclose(learner.pull_state_dict(job)["head.weight"], before["head.weight"] - g_head)
    with pytest.raises(ValueError, match="not parameters of the model attached"):
        learner.Optimizer(m, job=job, params=[torch.nn.Parameter(torch.zeros(2))])
    opt_all.close()
    opt_enc.close()
    assert len(job_status(job)["learners"]) == 1  # opt_head still holds it
    del opt_head  # collected: the last one frees the slot
    import gc

    gc.collect()
    assert len(job_status(job)["learners"]) == 0
    assert_all_applied(job, 2)


def test_refit_with_a_new_optimizer_and_model_gets_the_slot(job, serve):
    """Lightning's second fit() makes new optimizers while the first fit's may still be referenced: the same
    model shares the slot; a new model takes it over, and the old optimizer says it was detached."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1")
    m = Flat()
    first = learner.Optimizer(m, job=job)
    again = learner.Optimizer(m, job=job)  # refit of the same model: no second slot needed
    assert again.learner is first.learner
    other = Flat()
    (m.w * 1.0).sum().backward()
    first.step()
    new = learner.Optimizer(other, job=job)  # a new model (a fresh LightningModule): takes the slot over
    assert first.closed and again.closed and not new.closed
    assert torch.equal(other.w.detach(), torch.full((16,), -1.0))  # pulled the job's weights: nothing lost
    (m.w * 1.0).sum().backward()
    with pytest.raises(Error, match=r"was detached: a psd\.learner\.Optimizer of another model"):
        first.step()
    (other.w * 1.0).sum().backward()
    new.step()
    new.close()
    assert len(job_status(job)["learners"]) == 0
    assert_all_applied(job, 2)


def test_zero_grad_keeps_a_device_learners_staging_buffer(job, serve):
    """On a device learner (here the CPU stand-in for streams) p.grad stays a view of the buffer the push
    copies from: zero_grad() zeroes it in place."""
    serve(job, "--no-watchdog", "--learners", "1", "--lr", "1")
    m = Flat()
    c = torch.linspace(-1, 1, 16)
    with learner.Optimizer(m, learner=DeviceLearner(m, job)) as opt:
        for _ in range(3):
            staging = m.w.grad.data_ptr()
            (m.w * 9.0).sum().backward()
            opt.zero_grad()
            assert m.w.grad.data_ptr() == staging and not m.w.grad.any()
            (m.w * c).sum().backward()
            opt.step()
    assert torch.allclose(learner.pull_state_dict(job)["w"], -3 * c)
    assert_all_applied(job, 3)


def test_copying_or_pickling_it_is_a_clear_error_and_the_job_goes_on(job, serve):
    """copy.copy, copy.deepcopy and pickle of an attached optimizer (or its learner) raise a TypeError that
    says what to do; the original goes on training, and the job saw no extra learner."""
    import copy
    import pickle

    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1")
    model = Flat()
    with learner.Optimizer(model, job=job) as opt:
        for how in (copy.copy, copy.deepcopy, pickle.dumps):
            for obj in (opt, opt.learner):
                with pytest.raises(TypeError, match=f"cannot be copied or pickled.*{job}"):
                    how(obj)
        model.w.grad = torch.ones(16)
        opt.step()
        opt.learner.flush()
        assert_all_applied(job, 1)
        assert len(job_status(job)["learners"]) == 1
