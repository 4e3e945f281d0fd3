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

import atexit
import collections
import itertools
import logging
import math
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer

from psd import _native
from psd.arena import arena_spec, default_job, first_difference, open_job
from psd.errors import Error
from psd.learner.client import Learner
from psd.learner.device import DeviceLearner
from psd.learner.factory import attach
from psd.state import model_spec

__all__ = ["Optimizer"]

log = logging.getLogger("psd.learner")

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


def _flat_params(params: Iterable[Any]) -> list[torch.nn.Parameter]:
    """The parameters in ``params``: tensors, or torch's parameter groups (dicts with "params")."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"params= takes an iterable of parameters (or parameter groups), not a tensor: write "
                        f"params=[t] (got a {type(params).__name__} of shape {tuple(params.shape)})")
    out: list[torch.nn.Parameter] = []
    for p in params:
        if isinstance(p, Mapping):
            out += _flat_params(p["params"] if not isinstance(p["params"], torch.Tensor) else [p["params"]])
        elif isinstance(p, torch.Tensor):
            out.append(p)
        else:
            raise TypeError(f"params= takes the model's parameters (tensors or parameter groups), not "
                            f"{type(p).__name__}")
    return out


def _mask_of(learner: Learner, wanted: list[torch.nn.Parameter]) -> tuple[tuple[int, ...] | None, list]:
    """(indices of the trained tensors among ``wanted``, None when that is all of them; ``wanted``).
    Every parameter must be one of the learner's model (trained or frozen)."""
    trained = {id(p): k for k, p in enumerate(learner._train)}
    known = trained.keys() | {id(p) for p in learner._params}
    stray = [p for p in wanted if id(p) not in known]
    if stray:
        raise ValueError(f"{len(stray)} of the {len(wanted)} parameter(s) given are not parameters of the model "
                         f"attached to job {learner.job!r} in this process (first: shape {tuple(stray[0].shape)}); "
                         f"pass parameters of that model (e.g. params=model.head.parameters())")
    if not wanted:
        raise ValueError("psd.learner.Optimizer got no parameters to step")
    mine = sorted({trained[id(p)] for p in wanted if id(p) in trained})
    if len(mine) == len(trained):
        return None, wanted
    if isinstance(learner, DeviceLearner):
        if learner.partial and mine == [k for k in range(len(trained)) if learner._present[k]]:
            return None, wanted  # a partial learner's own tensors: all that it steps
        raise Error(f"job {learner.job!r}: an optimizer of some of the model's parameters (params=, or a sub-module "
                    f"of a model attached in this process) is not supported on a {learner.device} learner yet; "
                    f"use one psd.learner.Optimizer for the whole model there")
    return tuple(mine), wanted


class _Shared:
    """The one learner slot of this process on a job, and the optimizers that step through it."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self.users = 0
        self.superseded = ""  # why a newer optimizer took the slot over ("": it did not)


_SHARED: dict[str, _Shared] = {}  # job -> this process's slot on it
_SHARED_LOCK = threading.Lock()


def _owns(shared: _Shared, module: torch.nn.Module, params: Iterable[Any] | None) -> list | None:
    """The parameters an optimizer of ``module`` (``params`` of it) asks for, if it is an optimizer of
    the model ``shared``'s learner trains (that model, or some of its parameters); else None."""
    wanted = list(module.parameters()) if params is None else _flat_params(params)
    known = {id(p) for p in shared.learner._params}
    ours = module is shared.learner.model or any(id(p) in known for p in module.parameters())
    return wanted if ours else None


def _join(module: torch.nn.Module, job: str | None, params: Iterable[Any] | None,
          attach_kwargs: dict[str, Any]) -> tuple[_Shared, tuple[tuple[int, ...] | None, list]]:
    """This process's slot on ``job`` for an optimizer of ``module``: the existing one when the module's
    parameters are those of the model attached there (several optimizers, a refit), else a new attach
    (of ``module``), which takes over from an earlier model's optimizers."""
    job = job or default_job()
    _SHARED_LOCK.acquire()
    try:
        shared = _SHARED.get(job)
        if shared is not None and not shared.learner._closing and not shared.superseded:
            if params is not None:
                params = list(params)
            wanted = _owns(shared, module, params)
            if wanted is not None:
                mask = _mask_of(shared.learner, wanted)
                shared.users += 1
                return shared, mask
            _check_takeover(module, job)  # before anything is detached: a model the job cannot take fails here
            why = (f"a psd.learner.Optimizer of another model (a {type(module).__name__}) attached to job {job!r} "
                   f"in this process")
            log.warning("job %r: %s; the optimizers of the earlier model (a %s) are detached", job, why,
                        type(shared.learner.model).__name__)
            shared.superseded = why
            _SHARED.pop(job, None)
            try:
                shared.learner.close(flush=True)
            except Error as e:
                log.warning("job %r: detaching the earlier model: %s", job, e)
        learner = attach(module, job, **attach_kwargs)
        try:
            mask = _mask_of(learner, list(module.parameters()) if params is None else _flat_params(params))
        except BaseException:
            learner.close(flush=False)
            raise
        shared = _Shared(learner)
        shared.users = 1
        _SHARED[job] = shared
        return shared, mask
    finally:
        _unlock()


def _check_takeover(module: torch.nn.Module, job: str) -> None:
    """Raise the job's own mismatch error if ``module`` is not the job's model (by names and shapes)."""
    arena = open_job(job, role="reader")
    try:
        if arena.state != _native.ARENA_READY:
            return
        arena.remap()
        theirs = arena_spec(arena)
    finally:
        arena.close()
    spec = model_spec(module)[0]
    mismatch = first_difference(job, sorted(spec, key=lambda p: p.name), sorted(theirs, key=lambda p: p.name))
    if mismatch:
        raise type(mismatch)(f"{mismatch} (a {type(module).__name__} cannot take over this process's slot on job "
                             f"{job!r}: it is not the job's model. For an optimizer of a part of the model attached "
                             f"in this process, pass that model with params=part.parameters())")


_EXITING = False
_HOOKED = False


def _exit_hook() -> None:
    """Note when the interpreter exits: optimizers still open then free their slot without waiting for
    the server (it applies what was pushed). Registered after the first finalizer, so it runs before
    the finalizers do (atexit runs last-registered first)."""
    global _HOOKED
    if not _HOOKED:
        _HOOKED = True

        def exiting() -> None:
            global _EXITING
            _EXITING = True

        atexit.register(exiting)


# Finalizers that found the lock taken (a garbage collection inside _join or _leave, in this thread or
# another): the lock's holder runs them when it lets go. A finalizer never blocks on the lock.
_PENDING: collections.deque[_Shared] = collections.deque()


def _leave_locked(shared: _Shared, flush: bool) -> None:
    """``_leave``'s work, with ``_SHARED_LOCK`` held: the registry entry goes only once the learner is
    closed, so a new optimizer on the job (another thread) waits for the slot to be free."""
    shared.users -= 1
    if shared.users > 0 or shared.superseded:
        return
    try:
        shared.learner.close(flush=flush)
    except Error as e:  # from a finalizer too: say it, do not raise into the collector
        log.warning("job %r: detaching: %s", shared.learner.job, e)
    finally:
        if _SHARED.get(shared.learner.job) is shared:
            del _SHARED[shared.learner.job]


def _unlock() -> None:
    """Let go of ``_SHARED_LOCK``, running the finalizers that came meanwhile first (and any that came
    between the last of them and the release, if the lock is still free then)."""
    while True:
        try:
            while _PENDING:
                _leave_locked(_PENDING.popleft(), not _EXITING)
        finally:
            _SHARED_LOCK.release()
        if not _PENDING or not _SHARED_LOCK.acquire(blocking=False):
            return


def _leave(shared: _Shared, flush: bool | None) -> None:
    """One optimizer fewer on ``shared``'s slot: the last one closes the learner (frees the slot).
    ``flush`` None (a finalizer): wait for the server to apply what was pushed, unless exiting; and
    if the lock is taken, leave the work to its holder instead of waiting (no deadlock in a GC)."""
    if flush is None:
        if not _SHARED_LOCK.acquire(blocking=False):
            _PENDING.append(shared)
            return
        flush = not _EXITING
    else:
        _SHARED_LOCK.acquire()
    try:
        _leave_locked(shared, flush)
    finally:
        _unlock()


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``step()`` trains ``model`` through the psd job ``job``.

    ``Optimizer(model, job)`` attaches the model (``psd.learner.attach(model, job, **attach_kwargs)``:
    ``timeout``, ``slot_timeout``, ``rank``, ``reconnect_timeout``, ``device``, ``pull``, ``partial``); the
    ``Learner`` is ``self.learner`` (``resume_step``, ``flush()``, ``pull()``, ...). Or pass an attached one as
    ``learner=`` (then no job or attach arguments). Give it the model, not ``model.parameters()``.

    One process holds one learner slot per job, whatever number of optimizers it makes:

    - ``params=`` (some of the model's parameters, or parameter groups) makes an optimizer that steps
      those alone: ``Optimizer(gan, job, params=gan.generator.parameters())`` and another for the
      discriminator share the slot; each ``step()`` pushes its own parameters' gradients and leaves the
      others' ``p.grad`` alone. An optimizer of a sub-module of a model already attached in this
      process (``Optimizer(gan.generator, job)``) does the same.
    - A new optimizer of the same model (Lightning's ``fit()`` again, a second HF ``train()``) shares
      the slot too. One of another model takes the slot over: the earlier model's optimizers are
      detached (their ``step()`` says so).
    - The slot is freed when the last optimizer on it is closed: ``close()``, the end of a ``with``
      block, or when it is garbage-collected (a framework dropping it after ``fit()``).

    - ``step(closure=None)`` pushes this mini-batch's gradients (``p.grad``) and swaps in newer
      weights. A closure is evaluated first, with gradients enabled, and its loss is recorded with
      the gradient (``psd status``) and returned. ``batch_size`` (default ``self.batch_size``, set
      by the constructor, 1 unless given) is recorded too.
    - ``zero_grad()`` works as usual; ``step()`` has already reset every ``p.grad`` to None. With
      ``psd serve --push-every W`` each ``step()`` adds the mini-batch's gradients into psd's own
      buffer and the W-th pushes their mean, whatever is done to ``p.grad`` in between (a
      framework's ``model.zero_grad()`` included). A ``step()`` without gradients pushes nothing.
      On a GPU learner ``zero_grad()`` zeroes the gradients in place, whatever ``set_to_none`` says:
      they are views of the on-device buffer that the push copies from.
    - ``param_groups[i]["lr"]`` is the server's current learning rate (that of its last update, as
      ``psd status`` shows it), refreshed by every ``step()``. The learning rate is the server's
      (``psd serve --lr/--schedule/--warmup``): setting it here, or with a ``torch.optim.lr_scheduler``,
      changes nothing, and the first time that happens a warning says so.
    - ``state_dict()`` holds no optimizer state: that lives on the server (in its checkpoints). It
      returns torch's usual layout with an empty ``state``, plus ``"psd"``: the job, the weights'
      clock, the server's optimizer and a note. ``load_state_dict()`` accepts it and changes nothing;
      it warns when given another optimizer's state (which it cannot load into the server).
    - ``close()`` lets go of the slot (see above; the last one waits until the server applied every
      pushed gradient); the optimizer is also a context manager.
    """

    def __init__(self, model: torch.nn.Module, job: str | None = None, *, params: Iterable[Any] | None = None,
                 batch_size: int = 1, learner: Learner | None = None, **attach_kwargs: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"psd.learner.Optimizer takes the model (a torch.nn.Module), not "
                            f"{type(model).__name__}: write Optimizer(model, job=...) instead of "
                            f"Optimizer(model.parameters(), ...); to step some of its parameters, add "
                            f"params=those_parameters")
        module = _unwrap(model)
        self.batch_size = int(batch_size)
        self._lr_warned = False
        self._shared: _Shared | None = None
        self._finalizer: weakref.finalize | None = None
        if learner is not None:
            if job is not None or attach_kwargs:
                raise TypeError("pass either learner= (an attached Learner) or job and attach arguments, not both")
            if learner.model is not module and learner.model is not model:
                raise ValueError("learner= is attached with another model; pass the model it was attached with")
            self.learner: Learner = learner
            mine = self._mask(learner, module, params)
        else:
            self._shared, mine = _join(module, job, params, attach_kwargs)
            self.learner = self._shared.learner
            self._finalizer = weakref.finalize(self, _leave, self._shared, None)
            _exit_hook()
        self._only, stepped = mine
        self._adding = True
        try:
            self._lr_shown = self._server_lr()
            super().__init__(stepped, {"lr": self._lr_shown})
        except BaseException:
            self.close(flush=False)
            raise
        self._adding = False

    @staticmethod
    def _mask(learner: Learner, module: torch.nn.Module,
              params: Iterable[Any] | None) -> tuple[tuple[int, ...] | None, list[torch.nn.Parameter]]:
        """(the indices of the trained tensors this optimizer steps, None: all of them; its parameters)."""
        return _mask_of(learner, list(module.parameters()) if params is None else _flat_params(params))

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
        shared = self._shared
        if shared is not None and shared.superseded:
            raise Error(f"this psd.learner.Optimizer of job {self.learner.job!r} was detached: {shared.superseded}. "
                        f"Use the newer optimizer (each process has one learner slot per job)")
        self.learner.step(loss, self.batch_size if batch_size is None else batch_size, only=self._only,
                          closure=closure)
        self._refresh_lr()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as ``torch.optim.Optimizer.zero_grad`` does (see the class docstring
        for ``--push-every`` waves and GPU learners)."""
        device = isinstance(self.learner, DeviceLearner)
        if device:
            set_to_none = False  # keep backward writing into the staging buffer the push copies from
        if torch.autograd._profiler_enabled():
            with torch.autograd.profiler.record_function(f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"):
                self._zero_grad(set_to_none)
        else:
            self._zero_grad(set_to_none)
        if device and not self.learner._closing:
            self.learner.note_armed()  # zeroed is not written: a step() without a backward pushes nothing

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
        """Let go of the learner slot: when this was the last optimizer of this process on the job, wait
        until the server applied what was pushed (if ``flush``) and free the slot. Also done when the
        optimizer is garbage-collected (a framework dropping it at the end of ``fit()``), and at the
        end of a ``with`` block."""
        if self._finalizer is not None:
            if self._finalizer.detach() is not None:
                _leave(self._shared, flush)
        elif self._shared is None:
            self.learner.close(flush=flush)

    @property
    def closed(self) -> bool:
        """Whether this optimizer let go of its slot (``close()``, or a newer one took it over)."""
        if self._finalizer is not None:
            return not self._finalizer.alive or bool(self._shared.superseded)
        return self.learner._closing

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # After an error, still hand back the slot, but do not wait on a server that may be gone.
        self.close(flush=exc_type is None)

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
