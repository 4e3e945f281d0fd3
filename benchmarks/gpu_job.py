"""A real job on a GPU: psd's learners against one process training the same model there without psd.

    python benchmarks/gpu_job.py [--learners 1,2,4,8] [--width 2048] [--depth 4] [--batch 2048]
                                 [--steps 60] [--gpu 0] [--out benchmarks/results]

The model: --depth Linear(width, width) layers with ReLU between (4 x 2048: 16.8M parameters), a fixed random
batch, mean-squared loss. Alone: one process, no psd, forward + backward + an in-place SGD step on the GPU.
Through psd: `psd run --gpus G --learners K` (the watchdog on, as a user runs it; server sgd), each learner
attaching its model where it is (a DeviceLearner: gradients leave on a side stream into the pinned arena,
weights come back on another into a second device buffer). Every learner times --steps steps after warm-up,
the GPU synchronised at both ends, so a step's figure includes whatever the copies cost it.

Reported per K: the learners' median step time, the job's steps/s against alone (K learners share one GPU:
1.0 means psd lost nothing), and the host<->device traffic each learner moved (gradient bytes pushed + weight
bytes pulled, a second) as a fraction of pinned-memory copy bandwidth measured in the same run. Target
(issue 30): at 1 learner, step time within 10% of alone. gpu_job.json and gpu_job.md go into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MARK = "GPUJOB "


def build(width: int, depth: int, batch: int, device: torch.device):
    """The model, its input and target, the same in every process."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if i < depth - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(batch, width, device=device)
    y = torch.randn(batch, width, device=device) * 0.1
    return model, x, y


def timed(step, warmup: int, steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` after ``warmup``, the GPU synchronised at both ends."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    return (time.perf_counter() - t0) / steps


def alone(args, device: torch.device) -> float:
    model, x, y = build(args.width, args.depth, args.batch, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return timed(step, args.warmup, args.steps, device)


def learner_main(args) -> int:
    """One learner of `psd run --gpus`: attach, train, print one JSON line of figures."""
    from psd import learner

    device = torch.device(os.environ.get("PSD_DEVICE", "cuda:0" if torch.cuda.is_available() else "cpu"))
    model, x, y = build(args.width, args.depth, args.batch, device)
    with learner.attach(model) as ps:
        kind = type(ps).__name__
        losses: list[torch.Tensor] = []
        in_step = [0.0]

        def step() -> None:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            t = time.perf_counter()
            ps.step(loss.detach())
            in_step[0] += time.perf_counter() - t
            losses.append(loss.detach())

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        pushed0, pulled0 = ps.pushed, ps.pulled_bytes
        in_step[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        elapsed = time.perf_counter() - t0
        pushed, pulled = ps.pushed - pushed0, ps.pulled_bytes - pulled0
        ps.flush()
        n = sum(p.numel() for p in model.parameters())
        pinned = getattr(getattr(ps, "_streams", None), "weights_pinned", None)
    first, last = float(losses[0]), float(losses[-1])
    print(MARK + json.dumps({"rank": int(os.environ.get("PSD_RANK", 0)), "device": str(device), "learner": kind,
                             "params": n, "step_s": elapsed / args.steps, "steps": args.steps,
                             "pushed_bytes": pushed * n * 4, "pulled_bytes": pulled, "elapsed_s": elapsed,
                             "in_step_s": in_step[0] / args.steps, "weights_pinned": pinned,
                             "loss_first": first, "loss_last": last}), flush=True)
    return 0


def through_psd(args, k: int) -> list[dict]:
    job = f"gpujob-{os.getpid()}-{k}"
    ck = tempfile.mkdtemp(prefix="psd-gpujob-")
    cmd = [sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", str(k), "--gpus", str(args.gpu),
           "--lr", "1e-4", "--checkpoint-dir", ck, "--", sys.executable, str(Path(__file__).resolve()), "--learner",
           "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    rows = [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or len(rows) != k:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"psd run with {k} learner(s) failed (exit {proc.returncode}, {len(rows)} of {k} reported)")
    notes = sorted({line.split("psd.learner", 1)[-1].strip() for line in proc.stderr.splitlines()
                    if "cudaHostRegister" in line})
    for r in rows:
        r["register_warnings"] = notes
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", default="1,2,4,8")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="seconds each psd run may take")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--learner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.learner:
        return learner_main(args)
    if not torch.cuda.is_available():
        print("gpu_job: no CUDA device (torch reports none); nothing measured")
        return 0
    from psd.bench import host_device_gbs
    from psd.bench.record import command_line, machine, machine_line, write_results

    device = torch.device(f"cuda:{args.gpu}")
    bw = host_device_gbs(str(device))
    pcie = (bw["h2d"] + bw["d2h"]) / 2
    base = alone(args, device)
    n = sum(p.numel() for p in build(args.width, args.depth, 1, torch.device("cpu"))[0].parameters())
    gpu = torch.cuda.get_device_name(device)
    print(f"{gpu}: {n:,} parameters, batch {args.batch}; pinned copies {bw['h2d']:.1f} GB/s to the device, "
          f"{bw['d2h']:.1f} back; alone {base * 1e3:.2f} ms a step", flush=True)
    rows = []
    for k in (int(s) for s in args.learners.split(",")):
        reports = through_psd(args, k)
        step = statistics.median(r["step_s"] for r in reports)
        rate = sum(r["steps"] / r["elapsed_s"] for r in reports)
        traffic = statistics.median((r["pushed_bytes"] + r["pulled_bytes"]) / r["elapsed_s"] for r in reports) / 1e9
        row = {"learners": k, "step_ms": step * 1e3, "step_vs_alone": step / base, "steps_per_s": rate,
               "throughput_vs_alone": rate * base, "traffic_gbs_per_learner": traffic,
               "traffic_fraction_of_pinned_copy": traffic / pcie, "learner_class": reports[0]["learner"],
               "in_step_ms": statistics.median(r["in_step_s"] for r in reports) * 1e3,
               "weights_pinned": all(r["weights_pinned"] for r in reports),
               "register_warnings": reports[0]["register_warnings"],
               "reports": reports}
        rows.append(row)
        print(f"{k} learner(s): {row['step_ms']:.2f} ms a step ({row['step_vs_alone']:.2f}x alone), job "
              f"{rate:.1f} steps/s = {row['throughput_vs_alone']:.2f} of alone; {traffic:.2f} GB/s each "
              f"= {row['traffic_fraction_of_pinned_copy']:.2f} of pinned copies; {row['in_step_ms']:.2f} ms a step "
              f"inside step(); weights pinned: {row['weights_pinned']} {row['register_warnings'] or ''}", flush=True)
    result = {"command": command_line(), "machine": machine(), "gpu": gpu, "params": n, "batch": args.batch,
              "pinned_copy_gbs": bw, "alone_step_ms": base * 1e3, "rows": rows}
    md = ["# A job on one GPU: psd against one process without psd\n", f"`{result['command']}`\n",
          f"{gpu}; {machine_line(result['machine'])}\n",
          f"{n:,} parameters, batch {args.batch}. Pinned copies: {bw['h2d']:.1f} GB/s host to device, "
          f"{bw['d2h']:.1f} GB/s back. Alone: {base * 1e3:.2f} ms a step.\n",
          "| learners | step (ms) | step / alone | job steps/s | of alone's throughput | GB/s each | of pinned copy |",
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    md += [f"| {r['learners']} | {r['step_ms']:.2f} | {r['step_vs_alone']:.2f} | {r['steps_per_s']:.1f} | "
           f"{r['throughput_vs_alone']:.2f} | {r['traffic_gbs_per_learner']:.2f} | "
           f"{r['traffic_fraction_of_pinned_copy']:.2f} |" for r in rows]
    for path in write_results(args.out, "gpu_job", result, "\n".join(md) + "\n"):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
