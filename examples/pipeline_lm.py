"""A character-level transformer language model, split into pipeline stages, trained by virtual workers.

HetPipe's virtual workers through psd: ``psd run --learners V --stages K`` starts V virtual workers of K
stage processes; each stage holds a slice of the model (torch.distributed.pipelining's manual split: build
the whole model, delete the layers other stages hold), runs torch.distributed.pipelining's schedule with
the other stages of its virtual worker (gloo on the CPU; with ``psd run --gpus``, each stage on the GPU
that PSD_DEVICE names, over nccl), and pushes its own parameters' gradients to the psd job
(``psd.learner.Optimizer(stage, partial=True)``); the virtual workers train asynchronously against the
job's one copy of the weights.

    python examples/pipeline_lm.py --save-init /tmp/lm.safetensors       # the job's initial model
    psd run --job lm --learners 2 --stages 2 --init /tmp/lm.safetensors --optimizer adam --lr 0.003 \\
        -- python examples/pipeline_lm.py
    psd run --job lm --learners 2 --stages 2 --gpus 0,1 --init /tmp/lm.safetensors --optimizer adam \\
        --lr 0.003 -- python examples/pipeline_lm.py                      # the stages on GPUs 0 and 1
    python examples/pipeline_lm.py --single                               # one process, torch.optim.Adam
    psd run --job lm --learners 4 --optimizer adam --lr 0.003 -- python examples/pipeline_lm.py  # data-parallel

The text is the Python reference manual as the standard library ships it (``pydoc_data.topics``). Each
virtual worker trains on its shard of the windows for ``--epochs`` passes, mini-batches of ``--batch``
windows in ``--microbatches`` micro-batches (``--schedule gpipe`` or ``1f1b``). At the end the last stage
of virtual worker 0 scores the job's model (``pull_state_dict``, the whole model) on held-out text and
prints ``val loss X`` (nats a character); ``--single`` prints the same for one process.

A restarted virtual worker goes on where its slower stage stopped, and each stage pushes only mini-batches
the job had not applied from it (its ``resume_step``): every stage's gradients are applied exactly once.
Under ``psd run`` without ``--stages`` each learner trains the whole model on its shard (data-parallel, for
comparison). Every learner prints its peak resident memory at the end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

SEQ, DIM, LAYERS = 32, 64, 4


def load_text(n_train: int = 4000, n_val: int = 400) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train windows, validation windows, vocabulary size): windows of SEQ + 1 characters, from disjoint
    stretches of the text."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text[: (n_train + n_val) * (SEQ + 1)]], dtype=torch.long)
    windows = ids.view(-1, SEQ + 1)
    return windows[:n_train], windows[n_train:], len(chars)


class Block(torch.nn.Module):
    """A pre-norm causal self-attention block with an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.attn = torch.nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharTransformer(torch.nn.Module):
    """Embeddings, LAYERS blocks, a norm and a head; any of them may be deleted (a pipeline stage's slice)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(vocab, DIM)
        self.pos = torch.nn.Embedding(SEQ, DIM)
        self.layers = torch.nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:  # the first stage: token ids in
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:  # the last stage: logits out
            x = self.head(self.norm(x))
        return x


def stage_slice(model: CharTransformer, stage: int, stages: int) -> CharTransformer:
    """Delete from ``model`` what other stages hold (the names of what is left keep their prefixes)."""
    per = LAYERS // stages
    for i in range(LAYERS):
        if not stage * per <= i < (stage + 1) * per:
            del model.layers[str(i)]
    if stage != 0:
        model.tok = model.pos = None
    if stage != stages - 1:
        model.norm = model.head = None
    return model


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: torch.Tensor) -> float:
    model.eval()
    out = lm_loss(model(val[:, :-1]), val[:, 1:]).item()
    model.train()
    return out


def batches(train: torch.Tensor, shard: int, shards: int, batch: int, epochs: int, seed: int):
    """The shard's windows in mini-batches, reshuffled each epoch: (x, y) pairs."""
    mine = train[shard::shards]
    g = torch.Generator().manual_seed(seed + shard)
    for _ in range(epochs):
        order = torch.randperm(len(mine), generator=g)
        for i in range(0, len(mine) - batch + 1, batch):
            w = mine[order[i:i + batch]]
            yield w[:, :-1].contiguous(), w[:, 1:].contiguous()  # torch 2.11's pipelining checks strides


def single(args: argparse.Namespace) -> int:
    train, val, vocab = load_text(args.windows)
    model = CharTransformer(vocab)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for x, y in batches(train, 0, 1, args.batch, args.epochs, args.seed):
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    print(f"one process: val loss {val_loss(model, val):.4f}", flush=True)
    print(f"one process: peak RSS {peak_rss_mib():.0f} MiB", flush=True)
    return 0


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def data_parallel(args: argparse.Namespace) -> int:
    """A learner of the whole model on its shard (psd run without --stages)."""
    from psd import learner

    rank, world = int(os.environ["PSD_RANK"]), int(os.environ["PSD_WORLD"])
    device = device_and_backend()[0]
    train, val, vocab = load_text(args.windows)
    model = CharTransformer(vocab).to(device)
    opt = learner.Optimizer(model)
    done = opt.learner.resume_step
    for i, (x, y) in enumerate(batches(train, rank, world, args.batch, args.epochs, args.seed)):
        if i < done:
            continue
        lm_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    opt.learner.flush()
    opt.close()
    if rank == 0:
        model = CharTransformer(vocab)
        model.load_state_dict(learner.pull_state_dict())
        print(f"learner 0: val loss {val_loss(model, val):.4f} (the job's model)", flush=True)
    print(f"learner {rank}: peak RSS {peak_rss_mib():.0f} MiB", flush=True)
    return 0


def device_and_backend(env: dict[str, str] | None = None) -> tuple[torch.device, str]:
    """The learner's device (PSD_DEVICE, which ``psd run --gpus`` sets; else the CPU) and, for a stage, its
    virtual worker's process group backend: nccl between stages on GPUs, gloo on the CPU (torchrun's
    convention: the script picks)."""
    device = torch.device((os.environ if env is None else env).get("PSD_DEVICE") or "cpu")
    return device, "nccl" if device.type == "cuda" else "gloo"


def stage_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from psd import learner

    vw, vws = int(os.environ["PSD_VW"]), int(os.environ["PSD_WORLD"]) // int(os.environ["PSD_STAGES"])
    stage, stages = int(os.environ["PSD_STAGE"]), int(os.environ["PSD_STAGES"])
    if LAYERS % stages:
        raise SystemExit(f"pipeline_lm.py splits {LAYERS} blocks evenly: use --stages 1, 2 or 4")
    device, backend = device_and_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # nccl's communicators and the schedule's buffers go to this GPU
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    train, val, vocab = load_text(args.windows)
    part = stage_slice(CharTransformer(vocab), stage, stages).to(device)
    opt = learner.Optimizer(part, partial=True)  # on a GPU: a DeviceLearner of the stage's own tensors
    pipe = PipelineStage(part, stage, stages, device)
    schedule = (ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B)(
        pipe, n_microbatches=args.microbatches, loss_fn=lm_loss)
    mine = opt.learner.resume_step
    start = torch.tensor([mine], device=device)
    dist.all_reduce(start, op=dist.ReduceOp.MIN)  # the stages go on from the slower one
    losses: list[torch.Tensor] = []
    for i, (x, y) in enumerate(batches(train, vw, vws, args.batch, args.epochs, args.seed)):
        if i < int(start):
            continue
        if stage == 0:
            schedule.step(x.to(device))
        elif stage == stages - 1:
            schedule.step(target=y.to(device), losses=losses)
        else:
            schedule.step()
        if i >= mine:  # this stage's gradient of mini-batch i was not applied before
            opt.step()
        opt.zero_grad()
    opt.learner.flush()
    opt.close()
    dist.destroy_process_group()
    if vw == 0 and stage == stages - 1:
        model = CharTransformer(vocab)
        model.load_state_dict(learner.pull_state_dict())
        print(f"virtual worker 0: val loss {val_loss(model, val):.4f} (the job's model)", flush=True)
    print(f"learner {os.environ['PSD_RANK']}: peak RSS {peak_rss_mib():.0f} MiB", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--lr", type=float, default=0.003, help="--single: Adam's lr (psd: the server's --lr)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--windows", type=int, default=4000, help="training windows of the text (all learners)")
    p.add_argument("--single", action="store_true", help="train the whole model in one process")
    p.add_argument("--save-init", metavar="PATH", help="write the whole model's initial weights (safetensors)")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("PSD_LEARNER_THREADS", "1")))
    if args.save_init:
        from safetensors.torch import save_file

        save_file(CharTransformer(load_text()[2]).state_dict(), args.save_init)
        return 0
    if args.single:
        return single(args)
    if "PSD_STAGE" in os.environ:
        return stage_main(args)
    if "PSD_RANK" in os.environ:
        return data_parallel(args)
    raise SystemExit("run it under `psd run` (--stages K for pipeline stages; see the docstring), or with --single")


if __name__ == "__main__":
    sys.exit(main())
