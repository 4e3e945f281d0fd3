"""An honest learner for the fuzz and kill tests: pushes known gradients while they run, and says how many were applied.

    honest.py JOB RANK MAX_PUSHES [FEATURES]

Attaches a Linear(FEATURES, 2) model (FEATURES 8 unless given) with PSD_RANK-like `rank` and prints "ready". On
a "go" line on stdin it pushes gradients of ones, one after another, until a "stop" line (or MAX_PUSHES), then waits
until every one is applied and prints "done PUSHED APPLIED COUNTS" (APPLIED: its rank's count as the server keeps
it; COUNTS: its slot's head, tail and outcome counts, as JSON).
"""

import json
import sys
import threading

import torch

from psd import learner


def main() -> int:
    job, rank, most = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    features = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    torch.set_num_threads(1)
    model = torch.nn.Linear(features, 2, bias=False)
    stop = threading.Event()
    with learner.attach(model, job=job, timeout=60, rank=rank) as ps:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 2

        def wait_stop() -> None:
            for line in sys.stdin:
                if line.strip() == "stop":
                    break
            stop.set()

        threading.Thread(target=wait_stop, daemon=True).start()
        while not stop.is_set() and ps.pushed < most:
            model.weight.grad = torch.ones(2, features)
            ps.step()
        ps.flush(timeout=120)
        info = ps._arena.slot_info(ps.slot)  # its slot's own counts, for a failure's message
        counts = {k: info[k] for k in ("head", "tail", "applied", "rejected", "dropped", "ignored") if k in info}
        print(f"done {ps.pushed} {ps._arena.ranks()[rank]} {json.dumps(counts, separators=(',', ':'))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
