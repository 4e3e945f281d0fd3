"""One stage of a two-stage pipeline under `psd run --stages 2`, for tests/test_stages.py.

    stage_learner.py --steps N [--die-at B | --die-at-end] [--slow-vw V --delay S]

The model is ``Pipe()`` (stage 0 holds ``a``, stage 1 holds ``b``); the job's model comes from
``psd run --init``. Each stage attaches its part (``partial=True``) and joins its virtual worker's
process group (gloo, torchrun's variables); stage 0 sends each mini-batch's activations to stage 1, which
computes the loss and sends their gradient back. Mini-batches are generated from the virtual worker's
seed. A restarted virtual worker goes on where its slower stage stopped; each stage pushes only the
mini-batches the job had not applied from it (its own ``resume_step``): every stage's gradients are applied
exactly once. With ``--die-at B``, stage 1 of virtual worker 0 exits (os._exit(3)) at mini-batch B in its
first life; with ``--die-at-end`` it does so after its last step, once stage 0 has exited (0). With
``--slow-vw V --delay S`` both stages of virtual worker V sleep S seconds a mini-batch (the WSP test). Prints
"stage S of V: done N" at the end.
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from psd import learner


class Pipe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 3)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--die-at-end", action="store_true")
    p.add_argument("--slow-vw", type=int, default=-1)
    p.add_argument("--delay", type=float, default=0.0)
    args = p.parse_args()
    vw, stage, stages = int(os.environ["PSD_VW"]), int(os.environ["PSD_STAGE"]), int(os.environ["PSD_STAGES"])
    assert stages == 2 and int(os.environ["WORLD_SIZE"]) == 2 and int(os.environ["RANK"]) == stage
    assert int(os.environ["PSD_RANK"]) == vw * stages + stage
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    part = Pipe()
    delattr(part, "b" if stage == 0 else "a")
    opt = learner.Optimizer(part, partial=True)
    mine = opt.learner.resume_step
    start = torch.tensor([mine])
    dist.all_reduce(start, op=dist.ReduceOp.MIN)  # both stages go on from the slower one
    g = torch.Generator().manual_seed(100 + vw)
    for i in range(args.steps):
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        if i < int(start):
            continue
        if i == args.die_at and vw == 0 and stage == 1 and os.environ.get("PSD_RESTARTS") == "0":
            os._exit(3)
        if vw == args.slow_vw:
            time.sleep(args.delay)  # a slower virtual worker (a stand-in for a slower device)
        if stage == 0:
            h = part.a(x)
            dist.send(h.detach(), 1)
            dh = torch.empty_like(h)
            dist.recv(dh, 1)
            h.backward(dh)
        else:
            h = torch.empty(4, 16)
            dist.recv(h, 0)
            h.requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(part.b(h), y)
            loss.backward()
            dist.send(h.grad, 0)
        if i >= mine:  # this stage's gradient of mini-batch i was not applied before
            opt.step()
        opt.zero_grad()
    opt.learner.flush()
    opt.close()
    pids = [None] * stages
    dist.all_gather_object(pids, os.getpid())
    dist.destroy_process_group()
    os.write(1, f"stage {stage} of {vw}: done {args.steps}\n".encode())  # one write: the stages share stdout
    if args.die_at_end and vw == 0 and stage == 1 and os.environ.get("PSD_RESTARTS") == "0":
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until stage 0 has exited (and psd run has seen it succeed)
            try:
                os.kill(pids[0], 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        os._exit(3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
