"""Training the shipped MLP workload through psd (pulling a copy of the weights, and computing on views of
the shared weights: ``psd_view``; pushing bfloat16 gradients: ``psd_bf16``, ``psd_view_bf16``) and through
Hogwild: samples/s and accuracy."""

from __future__ import annotations

import os
from functools import partial

from psd.bench._common import (
    BenchConfig,
    _interleaved,
    _server_thread,
    _timed,
    reporting,
    set_learner_sched,
)
from psd.bench.peers import _hogwild_train


@reporting
def _psd_train_learner(job: str, rank: int, world: int, batch: int, epochs: int, pull: str, sched: str, barrier,
                       q) -> None:
    import torch

    from psd import learner
    from psd.workloads import make_classification, make_mlp, shard

    set_learner_sched(sched, world)
    torch.set_num_threads(1)
    data = make_classification(0)
    x, y = shard(data, rank, world)
    model = make_mlp(data.dim, data.classes)
    g = torch.Generator().manual_seed(rank)
    with learner.attach(model, job=job, timeout=120, pull=pull) as ps:
        barrier.wait()
        for _ in range(epochs):
            order = torch.randperm(len(x), generator=g)
            for i in range(0, len(x), batch):
                idx = order[i:i + batch]
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                ps.step()
        ps.flush()
    q.put({"samples": len(x) * epochs})


TRAIN_LR = {1: 0.01, 2: 0.02, 4: 0.03, 8: 0.05}


def _samples_per_s(targets: list[tuple]) -> float:
    results, elapsed = _timed(targets)
    return sum(r["samples"] for r in results) / elapsed


def training(cfg: BenchConfig, log=print) -> list[dict]:
    """Samples/s and accuracy of the shipped workload, psd beside Hogwild."""
    from psd.learner import pull_state_dict
    from psd.server import ServeConfig, Server
    from psd.workloads import evaluate, make_classification, make_mlp

    data = make_classification(0)

    def psd_run(b: int, k: int, lr: float, epochs: int, pull: str, grad_dtype: str, overlap: str = "auto") -> dict:
        job = f"bench-train-{os.getpid()}-{b}-{k}-{pull}-{grad_dtype}-{overlap}"
        server = Server(ServeConfig(job=job, learners=k, lr=lr, threads=cfg.server_threads, grad_dtype=grad_dtype,
                                    overlap=overlap))
        server.start()
        stop = _server_thread(server)
        try:
            rate = _samples_per_s([(_psd_train_learner, (job, r, k, b, epochs, pull, cfg.learner_sched))
                                   for r in range(k)])
            model = make_mlp(data.dim, data.classes)
            model.load_state_dict(pull_state_dict(job))
        finally:
            stop()
        return {"samples_per_s": rate, "accuracy": evaluate(model, data)}

    def hogwild_run(b: int, k: int, lr: float, epochs: int) -> dict:
        shared = make_mlp(data.dim, data.classes)
        shared.share_memory()
        rate = _samples_per_s([(_hogwild_train, (shared, r, k, b, epochs, lr)) for r in range(k)])
        return {"samples_per_s": rate, "accuracy": evaluate(shared, data)}

    variants = cfg.variants()
    rows = []
    for b in cfg.batches:
        lr = TRAIN_LR.get(b, 0.03)
        epochs = cfg.epochs or b
        for k in cfg.learners:
            measures = {name: partial(psd_run, b, k, lr, epochs, pull, dtype, overlap)
                        for name, (pull, dtype, overlap) in variants.items()}
            if cfg.peers:
                measures["hogwild"] = partial(hogwild_run, b, k, lr, epochs)
            row = {"batch": b, "learners": k, "epochs": epochs, **_interleaved(cfg, measures, "samples_per_s")}
            line = f"training    mini-batch {b}  {k} learners"
            for name in (*variants, "hogwild"):
                if name in row:
                    line += f"  {name} {row[name]['samples_per_s']:>8,.0f} samples/s acc {row[name]['accuracy']:.4f}"
            if cfg.peers:
                for name in variants:
                    row[f"{name}_over_hogwild"] = row[name]["samples_per_s"] / row["hogwild"]["samples_per_s"]
                    line += f"  {name}/hogwild x{row[f'{name}_over_hogwild']:.2f}"
            log(line)
            rows.append(row)
    return rows
