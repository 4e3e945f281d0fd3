"""psd.learner: attach a PyTorch model to a psd job.

    from psd import learner
    with learner.attach(model, job="demo") as ps:
        for x, y in data:
            loss_fn(model(x), y).backward()
            ps.step()
"""

from psd.learner.client import Learner, attach, pull_state_dict

__all__ = ["Learner", "attach", "pull_state_dict"]
