"""The psd demo: a server and N learner processes train one model together.

    python examples/demo.py --learners 8

starts `psd serve`, launches N learners (examples/train_mlp.py) that push a
gradient after every mini-batch, waits for them, then evaluates the shared
weights and compares them with one process trained on the same data for the
same number of epochs. It also checks the server's counters: every gradient
pushed was applied exactly once. Everything is cleaned up at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from psd import learner
from psd.arena import shm_path, wait_for_job
from psd.status import job_status
from psd.workloads import evaluate, make_classification, make_mlp, train_single

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="psd demo: one server, N learners, one model")
    p.add_argument("--job", default="demo")
    p.add_argument("--learners", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.03)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    print(f"== psd demo: job {args.job!r}, {args.learners} learners, {args.epochs} epochs, "
          f"mini-batch {args.batch_size}, lr {args.lr}", flush=True)
    server = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--job", args.job,
                               "--learners", str(args.learners), "--lr", str(args.lr)])
    try:
        wait_for_job(args.job, timeout=30, server_pid=server.pid)
        t0 = time.monotonic()
        learners = [
            subprocess.Popen([sys.executable, str(HERE / "train_mlp.py"), "--job", args.job,
                              "--rank", str(r), "--world", str(args.learners), "--epochs", str(args.epochs),
                              "--batch-size", str(args.batch_size)], stdout=subprocess.PIPE, text=True)
            for r in range(args.learners)
        ]
        outs = [q.communicate()[0] for q in learners]  # a few lines each: no pipe fills up
        codes = [q.returncode for q in learners]
        elapsed = time.monotonic() - t0
        for out in outs:
            print(out, end="", flush=True)
        # Each learner reports the seconds from attaching to its last pull; the rest of the wall time is
        # starting processes (Python, importing torch, building the data).
        training = max((float(m) for out in outs for m in re.findall(r"gradients pushed in ([\d.]+) s", out)),
                       default=elapsed)
        if any(codes):
            print(f"== some learners failed: exit codes {codes}", flush=True)
            return 1
        status = job_status(args.job)
        data = make_classification(0)
        model = make_mlp(data.dim, data.classes)
        model.load_state_dict(learner.pull_state_dict(args.job))
        acc = evaluate(model, data)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)

    print(f"== trained with psd: {training:.1f} s training (the slowest learner, attach to last pull), "
          f"{max(0.0, elapsed - training):.1f} s starting {args.learners} processes; "
          f"{status['applied']} gradients applied, "
          f"{status['pushed']} pushed, {status['rejected']} rejected, {status['dropped']} dropped, "
          f"{status['pending']} pending; "
          f"mean staleness {status['staleness_mean']:.2f}", flush=True)
    t1 = time.monotonic()
    single = evaluate(train_single(data, args.epochs, args.batch_size, args.lr), data)
    print(f"== one process, same data and epochs ({time.monotonic() - t1:.1f} s training, in this process): "
          f"accuracy {single:.4f}")
    print(f"== psd with {args.learners} learners: accuracy {acc:.4f}")
    ok = status["pushed"] == status["applied"] + status["rejected"] + status["dropped"] and status["pending"] == 0
    print(f"== exactly once: {'yes' if ok else 'NO'} (pushed = applied + rejected + dropped)")
    left = os.path.exists(shm_path(args.job))
    print(f"== arena {'LEFT BEHIND' if left else 'removed'}: {shm_path(args.job)}")
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
