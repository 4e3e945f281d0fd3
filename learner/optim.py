"""A drop-in ``torch.optim.Optimizer`` that trains through a psd job.

An existing training loop, a framework that calls ``optimizer.step()`` (PyTorch Lightning, the
Hugging Face Trainer) or a ``torch.compile``d model moves to psd by changing the line that makes
the optimizer::

    opt = psd.learner.Optimizer(model, job="demo")      # was: torch.optim.SGD(model.parameters(), lr=0.03)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

The optimizer itself runs on the server (``psd serve --optimizer/--lr/--schedule``): ``step()``
pushes the gradients and swaps in fresher weights (``Learner.step``), ``param_groups`` report the
server's current learning rate, and ``state_dict()`` says that the optimizer state lives on the
server.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer

from psd.errors import Error
from psd.learner.client import DeviceLearner, Learner, attach

__all__ = ["Optimizer"]

# The hooks registered with torch.optim.optimizer.register_optimizer_step_pre_hook / _post_hook (see step()):
# if this torch keeps them elsewhere, torch's own wrapper of step() runs them (and costs its 20 us).
_GLOBAL_PRE_HOOKS: dict | None = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
_GLOBAL_POST_HOOKS: dict | None = getattr(_torch_optimizer, "_global_optimizer_post_hooks", None)
_OWN_HOOKS = isinstance(_GLOBAL_PRE_HOOKS, dict) and isinstance(_GLOBAL_POST_HOOKS, dict)

# What state_dict() says instead of optimizer state: the key, and the note under it.
STATE_KEY = "psd"
STATE_NOTE = ("the optimizer state (momentum, moments, step count, learning-rate schedule) lives on the psd "
              "server and is saved in its checkpoints; resume it with `psd serve --resume`")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile``d model wraps (its parameter names carry no ``_orig_mod.`` prefix),
    so a compiled and a plain learner attach the same model to one job."""
    orig = getattr(model, "_orig_mod", None)
    return orig if isinstance(orig, torch.nn.Module) else model


def _loss_value(loss: Any) -> float | torch.Tensor | None:
    """What ``Learner.step`` can record of a closure's result: a number or a one-element tensor."""
    if isinstance(loss, torch.Tensor):
        return loss if loss.numel() == 1 else None
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return loss
    return None


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``step()`` trains ``model`` through the psd job ``job``.

    ``Optimizer(model, job)`` attaches the model (``psd.learner.attach(model, job, **attach_kwargs)``:
    ``timeout``, ``slot_timeout``, ``rank``, ``reconnect_timeout``, ``device``, ``pull``); the ``Learner`` is
    ``self.learner`` (``resume_step``, ``flush()``, ``pull()``, ...). Or pass an attached one as
    ``learner=`` (then no job or attach arguments). Give it the model, not ``model.parameters()``:
    the job trains all of the model's parameters, in one parameter group.

    - ``step(closure=None)`` pushes this mini-batch's gradients (``p.grad``) and swaps in newer
      weights. A closure is evaluated first, with gradients enabled, and its loss is recorded with
      the gradient (``psd status``) and returned. ``batch_size`` (default ``self.batch_size``, set
      by the constructor, 1 unless given) is recorded too.
    - ``zero_grad()`` works as usual; ``step()`` has already reset every ``p.grad`` to None. With
      ``psd serve --push-every W`` it keeps the gradients of an unfinished wave (they add up in
      ``p.grad`` until the W-th ``step()`` pushes their mean), so the usual
      ``zero_grad(); backward(); step()`` loop pushes what it should. On a GPU learner it zeroes
      the gradients in place, whatever ``set_to_none`` says: they are views of the on-device buffer
      that the push copies from.
    - ``param_groups[i]["lr"]`` is the server's current learning rate (that of its last update, as
      ``psd status`` shows it), refreshed by every ``step()``. The learning rate is the server's
      (``psd serve --lr/--schedule/--warmup``): setting it here, or with a ``torch.optim.lr_scheduler``,
      changes nothing, and the first time that happens a warning says so.
    - ``state_dict()`` holds no optimizer state: that lives on the server (in its checkpoints). It
      returns torch's usual layout with an empty ``state``, plus ``"psd"``: the job, the weights'
      clock, the server's optimizer and a note. ``load_state_dict()`` accepts it and changes nothing;
      it warns when given another optimizer's state (which it cannot load into the server).
    - ``close()`` detaches (waiting until the server applied every pushed gradient); the optimizer
      is also a context manager.
    """

    def __init__(self, model: torch.nn.Module, job: str | None = None, *, batch_size: int = 1,
                 learner: Learner | None = None, **attach_kwargs: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"psd.learner.Optimizer takes the model (a torch.nn.Module), not "
                            f"{type(model).__name__}: write Optimizer(model, job=...) instead of "
                            f"Optimizer(model.parameters(), ...); the job trains all of the model's parameters")
        module = _unwrap(model)
        ours = learner is None
        if ours:
            learner = attach(module, job, **attach_kwargs)
        elif job is not None or attach_kwargs:
            raise TypeError("pass either learner= (an attached Learner) or job and attach arguments, not both")
        elif learner.model is not module and learner.model is not model:
            raise ValueError("learner= is attached with another model; pass the model it was attached with")
        self.learner: Learner = learner
        self.batch_size = int(batch_size)
        self._wave_open = False  # --push-every: p.grad holds an unfinished wave's gradients
        self._lr_warned = False
        self._adding = True
        try:
            self._lr_shown = self._server_lr()
            super().__init__(list(module.parameters()), {"lr": self._lr_shown})
        except BaseException:
            if ours:
                learner.close(flush=False)
            raise
        self._adding = False

    # -- the server's learning rate ------------------------------------------

    def _server_lr(self) -> float:
        # The learner's arena changes if it reattaches to a restarted job: look it up every time.
        return self.learner._arena.lr_now()

    def _check_lr(self) -> None:
        """Warn, once, when someone changed param_groups' lr: it is the server's."""
        if self._lr_warned:
            return
        for i, group in enumerate(self.param_groups):
            try:
                lr = float(group["lr"])
            except (KeyError, TypeError, ValueError, RuntimeError):
                lr = math.nan
            if lr != self._lr_shown:
                self._lr_warned = True
                job = self.learner.job
                warnings.warn(
                    f"psd.learner.Optimizer: param_groups[{i}]['lr'] was set to {group.get('lr')!r}, but job "
                    f"{job!r} trains at its server's learning rate (now {self._lr_shown:g}), which learners do "
                    f"not change; set it with `psd serve --job {job} --lr LR` (and --schedule, --warmup). "
                    f"param_groups show the server's value again after each step()",
                    stacklevel=3,
                )
                return

    def _refresh_lr(self) -> None:
        lr = self._server_lr()
        for group in self.param_groups:
            group["lr"] = lr
        self._lr_shown = lr

    # -- torch.optim.Optimizer -------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, *, loss: float | torch.Tensor | None = None,
             batch_size: int | None = None) -> Any:
        """Push this mini-batch's gradients and swap in newer weights (``Learner.step``).

        ``closure`` (optional) recomputes the loss (forward and backward); it is called first, with
        gradients enabled, and its result is returned. ``loss`` (default: the closure's) and
        ``batch_size`` (default: ``self.batch_size``) are recorded with the gradient. Afterwards
        ``param_groups`` hold the server's current learning rate. Step hooks
        (``register_step_pre_hook``, ``register_optimizer_step_post_hook``, ...) run as usual.
        """
        if not _OWN_HOOKS:  # torch wrapped this method with its profiler range and the hooks
            return self._step(closure, loss, batch_size)
        args, kwargs = (self, closure), {"loss": loss, "batch_size": batch_size}
        if torch.autograd._profiler_enabled():
            with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
                return self._hooked_step(args, kwargs)
        return self._hooked_step(args, kwargs)

    # torch.optim.Optimizer wraps every subclass's step() in a profiler range plus the step hooks, which
    # costs about 20 us a step (as much as a push): step() runs the hooks itself, and opens the range
    # only while a profiler runs. tests/test_optim_dropin.py checks that every hook runs once a step.
    step.hooked = _OWN_HOOKS  # type: ignore[attr-defined]

    def _hooked_step(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        for hook in itertools.chain(_GLOBAL_PRE_HOOKS.values(), self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"an optimizer step pre-hook must return None or (args, kwargs), not {result!r}")
                args, kwargs = result
        out = self._step(*args[1:], **kwargs)
        self._optimizer_step_code()
        for hook in itertools.chain(self._optimizer_step_post_hooks.values(), _GLOBAL_POST_HOOKS.values()):
            hook(self, args, kwargs)
        return out

    def _step(self, closure: Callable[[], Any] | None = None, loss: float | torch.Tensor | None = None,
              batch_size: int | None = None) -> Any:
        out = None
        if closure is not None:
            with torch.enable_grad():
                out = closure()
            if loss is None:
                loss = _loss_value(out)
        self._check_lr()
        before = self.learner.pushed
        self.learner.step(loss, self.batch_size if batch_size is None else batch_size)
        self._wave_open = self.learner.pushed == before
        self._refresh_lr()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as ``torch.optim.Optimizer.zero_grad`` does (see the class docstring
        for ``--push-every`` waves and GPU learners)."""
        if self._wave_open:
            return  # the wave's gradients add up in p.grad until its last step() pushes them
        if isinstance(self.learner, DeviceLearner):
            set_to_none = False  # keep backward writing into the staging buffer the push copies from
        if torch.autograd._profiler_enabled():
            with torch.autograd.profiler.record_function(f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"):
                self._zero_grad(set_to_none)
        else:
            self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        # torch's loop (without its profiler range: about 20 us, and step() has usually reset every p.grad)
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                g.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only the constructor adds the (one) parameter group: the job's parameters are fixed."""
        if not self._adding:
            raise Error(f"psd.learner.Optimizer cannot add parameters: job {self.learner.job!r} trains exactly "
                        f"the parameters of the model it was attached with: put every parameter in the model "
                        f"before creating the optimizer")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout with an empty ``state`` (it lives on the server), plus ``"psd"``: job, clock,
        the server's optimizer and a note saying so."""
        sd = super().state_dict()
        arena = self.learner._arena
        sd[STATE_KEY] = {"job": self.learner.job, "clock": self.learner.clock,
                         "optimizer": arena.training()["optimizer"] if not arena.closed else None,
                         "note": STATE_NOTE}
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Accept a ``state_dict()`` of this class, and change nothing: the optimizer state is the
        server's. Another optimizer's state cannot be loaded into the server: it is ignored, with a
        warning."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict() takes a dict, not {type(state_dict).__name__}")
        if STATE_KEY not in state_dict and state_dict.get("state"):
            warnings.warn(
                f"psd.learner.Optimizer.load_state_dict: ignoring another optimizer's state "
                f"({len(state_dict['state'])} parameter(s)); {STATE_NOTE}",
                stacklevel=2,
            )

    # -- detaching -------------------------------------------------------------

    def close(self, flush: bool = True) -> None:
        """Detach the learner: wait until the server applied what it pushed (if ``flush``), free the slot."""
        self.learner.close(flush=flush)

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.learner.__exit__(exc_type, exc, tb)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copying or pickling (copy.copy, copy.deepcopy, pickle) is refused with what to do instead: the
        optimizer holds a slot of a live job and views of its shared memory, which a copy cannot share."""
        raise TypeError(f"psd.learner.Optimizer cannot be copied or pickled: it holds a learner slot of job "
                        f"{self.learner.job!r}. For a copy of the model, create a new psd.learner.Optimizer("
                        f"model_copy, job=...) (it attaches in its own process); to save progress, save the model "
                        f"(its state_dict) or let `psd checkpoint --job {self.learner.job}` save the job")

    def __repr__(self) -> str:
        lr = self.param_groups[0]["lr"] if self.param_groups else None
        return f"<psd.learner.Optimizer job={self.learner.job!r} lr={lr} learner={self.learner!r}>"
