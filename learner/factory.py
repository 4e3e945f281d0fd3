"""``attach``: the learner for a model, by where its parameters live (``Learner`` on the CPU,
``DeviceLearner`` on a GPU). Its own module, so that the client and the device learner need not import each
other."""

from __future__ import annotations

import os

import torch

from psd.learner.client import Learner
from psd.learner.device import DeviceLearner, check_device

__all__ = ["attach"]


def attach(model: torch.nn.Module, job: str | None = None, *, timeout: float = 60.0,
           slot_timeout: float = 0.0, rank: int | None = None, reconnect_timeout: float = 60.0,
           device: str | torch.device | None = None, pull: str | None = None, partial: bool = False) -> Learner:
    """Attach ``model`` to the psd job ``job`` (default: $PSD_JOB, else ``default``).

    Claims a learner slot and pulls the job's current weights into the model. If
    the job has no model yet, this model's parameter names, shapes and values
    become the job's. ``timeout`` bounds every wait on the server;
    ``slot_timeout`` is how long to wait for a free slot when all are taken.
    ``rank`` (default: $PSD_RANK, which ``psd run`` sets) names this learner's
    place in the job: ``resume_step`` then says how many of its gradients were
    already applied, so a restarted learner can skip them. If the server dies,
    steps wait up to ``reconnect_timeout`` seconds for the watchdog's new one.
    Use as a context manager, and call ``step()`` where ``optimizer.step()`` was.

    ``device`` (default: where the model's parameters are) moves the model there first. A model
    on a CUDA device stays on it: gradients and weights move between the GPU and shared memory on
    side CUDA streams, double-buffered, so computation does not wait for them (``DeviceLearner``).

    ``pull`` (default: $PSD_PULL, else ``"copy"``) is how the model gets the job's weights.
    ``"copy"``: after each step a private copy of the newest weights is swapped in, so one forward
    and backward pass sees one consistent set of weights. ``"view"``: the parameters are read-only
    views of the shared weights (as in torch's Hogwild example): no copy at all and always the
    newest weights, but an update may land in the middle of a forward pass, and writing a
    parameter in place (a local optimizer, ``load_state_dict``) kills the process (SIGSEGV). It
    needs a float32 model on the CPU and a job without ``--predict``.

    ``partial=True`` attaches a module that holds some of the job's parameters (a pipeline stage: the
    whole model built, the layers other stages hold deleted, names keeping their prefixes), matched by
    full name, shape and dtype (``SpecError`` naming the first that is not the job's). The job's model
    must be declared already (a full attach, ``--init``, ``--resume``): this waits up to ``timeout``
    for it. The learner pushes gradients of its own parameters only and copies only those back; the
    others take no memory in it (on a GPU: no device memory; its weights and gradient buffers there hold
    its own tensors alone). Its buffers (BatchNorm statistics) are its own: its pushes set its real-valued
    buffers, which must be one run of the job's (else ``SpecError`` names the other stage's buffer between
    them), and add its counters; the other stages' stay as their pushes left them.
    """
    if device is not None:
        check_device(torch.device(device))
        model.to(torch.device(device))
    dev = next(iter(model.parameters()), torch.empty(0)).device
    cls = Learner if dev.type == "cpu" else DeviceLearner
    kw = {"partial": True} if partial else {}
    learner = cls(model, job, timeout=timeout, slot_timeout=slot_timeout, rank=rank,
                  reconnect_timeout=reconnect_timeout, pull=pull, **kw)
    world = os.environ.get("PSD_WORLD", "")
    if learner.sync == "bsp" and world.isdigit():
        try:
            learner.wait_for_peers(int(world))
        except BaseException:
            learner.close(flush=False)
            raise
    return learner
