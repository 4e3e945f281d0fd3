"""Several nodes on one machine: 2 nodes x 2 learners (psd run --nnodes 2) against DDP over gloo with 4 ranks.

For each --sync-every K it runs examples/train_mlp.py under two `psd run` jobs that meet on 127.0.0.1, and
reports samples/s (all learners' samples over the slowest learner's time), bytes each node sent per local
update (the node link's count: a ring all-reduce sends 2(P-1)/P of the payload) and the accuracy after the
same epochs; then DDP with 4 ranks (same model, shards, batch and epochs), and one process. Last, a
computation (not a measurement): what a 10 Gb/s and a 100 Gb/s network allow for a 1e8-parameter model.

    python benchmarks/multinode.py --out benchmarks/results/multinode

Both nodes share this machine's cores, so the figures compare the protocols, not a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psd.bench.record import command_line, machine, machine_line, staged

ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_psd(k: int, epochs: int, lr: float, batch: int, state: Path, compress: str = "none") -> dict:
    port, job = _port(), f"mn{os.getpid()}k{k}"
    env = dict(os.environ, XDG_STATE_HOME=str(state), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "psd.cli", "run", "--job", f"{job}-{r}", "--learners", "2", "--lr", repr(lr),
         "--nnodes", "2", "--node-rank", str(r), "--master-port", str(port), "--sync-every", str(k),
         "--max-node-lag", "1", "--node-timeout", "5", "--node-compress", compress, "--checkpoint-every", "0", "-q",
         "--checkpoint-dir", str(state / f"ck-{job}-{r}"), "--", sys.executable,
         str(ROOT / "examples" / "train_mlp.py"), "--epochs", str(epochs), "--batch-size", str(batch)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    done = [m for out in outs for m in re.finditer(r"done, (\d+) gradients pushed in ([\d.]+) s, accuracy ([\d.]+)",
                                                      out)]
    if len(done) != 4:
        raise SystemExit(f"psd --sync-every {k}: expected 4 learners to finish:\n" + "\n".join(outs))
    links = [json.loads((state / "psd" / "nodes" / f"{job}-{r}.json").read_text()) for r in range(2)]
    samples = sum(int(m[1]) for m in done) * batch
    updates = sum(int(m[1]) for m in done) / 2  # asp: one local update per gradient, per node
    name = f"psd 2x2, --sync-every {k}" + (f" --node-compress {compress}" if compress != "none" else "")
    return {"system": name, "sync_every": k,
            "samples_per_s": samples / max(float(m[2]) for m in done),
            "bytes_per_local_update": sum(s["bytes_sent"] for s in links) / 2 / updates,
            "exchanges": links[0]["exchanges"], "accuracy": sum(float(m[3]) for m in done) / 4}


def _ddp_rank(rank: int, world: int, port: int, epochs: int, lr: float, batch: int, q) -> None:
    import torch
    import torch.distributed as dist

    from psd.workloads import evaluate, make_classification, make_mlp, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = make_classification(0)
    x, y = shard(data, rank, world)
    model = torch.nn.parallel.DistributedDataParallel(make_mlp(data.dim, data.classes, seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1000 + rank)
    steps = -(-len(x) // batch)
    dist.barrier()
    t0 = time.monotonic()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for s in range(steps):
            idx = order[s * batch:(s + 1) * batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    dt = time.monotonic() - t0
    q.put({"rank": rank, "samples": len(x) * epochs, "s": dt, "steps": steps * epochs,
           "accuracy": evaluate(model.module, data)})
    dist.destroy_process_group()


def run_ddp(epochs: int, lr: float, batch: int) -> dict:
    import torch.multiprocessing as mp

    from psd.workloads import make_mlp

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_ddp_rank, args=(r, 4, port, epochs, lr, batch, q)) for r in range(4)]
    for p in procs:
        p.start()
    res = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    n = sum(p.numel() for p in make_mlp().parameters())
    return {"system": "DDP over gloo, 4 ranks", "sync_every": 1,
            "samples_per_s": sum(r["samples"] for r in res) / max(r["s"] for r in res),
            "bytes_per_local_update": 2 * 3 / 4 * n * 4, "exchanges": res[0]["steps"],
            "accuracy": sum(r["accuracy"] for r in res) / 4}


def network_table(params: float = 1e8) -> list[dict]:
    """A computation: a ring all-reduce of float32 deltas between 2 nodes sends 2(P-1)/P x 4 bytes a parameter."""
    out = []
    for k in (1, 10, 100):
        sent = 2 * (2 - 1) / 2 * params * 4
        for gbps in (10, 100):
            t = sent * 8 / (gbps * 1e9)
            out.append({"sync_every": k, "network_gbps": gbps, "exchange_s": t, "max_local_updates_per_s": k / t})
    return out


def markdown(rows: list[dict], single: float, net: list[dict], epochs: int, lr: float, batch: int,
             host: dict | None = None, command: str | None = None) -> str:
    """The run's table and the network computation, headed by the machine and the command."""
    lines = [f"Machine: {machine_line(host)}.", "", *([f"Command: `{command}`.", ""] if command else []),
             f"MLP of examples/train_mlp.py, {epochs} epochs, batch {batch} per learner, lr {lr}, SGD; psd: asp "
             f"inside each node, --outer-optimizer sum (the default), --max-node-lag 1; one machine, both nodes on "
             f"its cores. "
             f"One process: accuracy {single:.4f}.", "",
             "| system | samples/s | bytes sent per local update (per node) | exchanges | accuracy |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['samples_per_s']:,.0f} | {r['bytes_per_local_update']:,.0f} | "
                     f"{r['exchanges']} | {r['accuracy']:.4f} |")
    lines += ["", "Computed, not measured: 2 nodes, a 1e8-parameter model, float32 deltas (400 MB a node an "
              "exchange), the network the only limit:", "",
              "| --sync-every | network | one exchange | local updates/s the network allows |",
              "| ---: | ---: | ---: | ---: |"]
    for n in net:
        lines.append(f"| {n['sync_every']} | {n['network_gbps']} Gb/s | {n['exchange_s']:.3f} s | "
                     f"{n['max_local_updates_per_s']:,.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--sync-every", type=int, nargs="+", default=[1, 10, 100])
    p.add_argument("--bf16-at", type=int, nargs="*", default=[10], help="--sync-every values also run with "
                   "--node-compress bf16")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args()
    from psd.workloads import evaluate, make_classification, train_single

    rows = []
    with tempfile.TemporaryDirectory(prefix="psd-multinode-") as tmp:
        for k in args.sync_every:
            rows.append(run_psd(k, args.epochs, args.lr, args.batch, Path(tmp)))
            print(rows[-1], file=sys.stderr, flush=True)
        for k in args.bf16_at:
            rows.append(run_psd(k, args.epochs, args.lr, args.batch, Path(tmp), "bf16"))
            print(rows[-1], file=sys.stderr, flush=True)
    rows.append(run_ddp(args.epochs, args.lr, args.batch))
    data = make_classification(0)
    single = evaluate(train_single(data, args.epochs, args.batch, args.lr), data)
    net = network_table()
    host, command = machine(), command_line()
    md = markdown(rows, single, net, args.epochs, args.lr, args.batch, host, command)
    print(md)
    if args.out:
        out = Path(args.out)
        with staged(out.parent) as files:  # OUT.json and OUT.md replace the old ones together, once both exist
            files.write_text(out.name + ".json", json.dumps(
                {"rows": rows, "single_accuracy": single, "network": net, "epochs": args.epochs, "lr": args.lr,
                 "batch": args.batch, "machine": host, "command": command}, indent=2))
            files.write_text(out.name + ".md", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
