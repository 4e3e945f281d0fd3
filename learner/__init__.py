"""psd.learner: attach a PyTorch model to a psd job.

    from psd import learner
    with learner.attach(model, job="demo") as ps:
        for x, y in data:
            loss_fn(model(x), y).backward()
            ps.step()

or keep the training loop and replace its optimizer: ``opt = learner.Optimizer(model, job="demo")``.
"""

from psd.learner.client import Learner, attach, pull_state_dict
from psd.learner.optim import Optimizer

__all__ = ["Learner", "Optimizer", "attach", "pull_state_dict"]
