"""psd.learner: attach a PyTorch model to a psd job.

    from psd import learner
    with learner.attach(model, job="demo") as ps:
        for x, y in data:
            loss_fn(model(x), y).backward()
            ps.step()

or keep the training loop and replace its optimizer: ``opt = learner.Optimizer(model, job="demo")``.
Under ``psd run``, ``ResumableSampler`` (and ``psd.learner.hf.ResumeCallback`` for the Hugging Face
Trainer) let a restarted learner go on without replaying the mini-batches the job already applied.
"""

from psd.learner.client import Learner, pull_state_dict
from psd.learner.factory import attach
from psd.learner.optim import Optimizer
from psd.learner.resume import ResumableSampler, applied_before

__all__ = ["Learner", "Optimizer", "ResumableSampler", "applied_before", "attach", "pull_state_dict"]
