"""PyTorch Lightning and the Hugging Face Trainer themselves, training through `psd run` as their docs show.

Each test is one real job: the learners run the framework's own Trainer with psd.learner.Optimizer, a learner
dies once mid-run (os._exit) and psd run restarts it, and the job's final checkpoint (written by psd run at
the clean end) must hold, for every rank, exactly the applied total of a clean run: nothing lost, nothing
replayed. `psd export --job` after the job ended gives a model that loads strictly.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from conftest import child_env
from psd.watchdog import checkpoint

# Found, not imported: the learners import them (each import costs seconds), the test process need not.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None or importlib.util.find_spec("transformers") is None,
    reason="needs the frameworks extra: pip install -c constraints.txt -e '.[test,frameworks]'")

ROOT = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve().parent / "helpers"
sys.path.insert(0, str(ROOT / "examples"))


def psd_run(job: str, ck: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "2",
                           "--checkpoint-dir", str(ck), *args], capture_output=True, text=True, env=child_env(),
                          timeout=timeout)


def accuracies(out: str) -> dict[int, float]:
    return {int(r): float(a) for r, a in re.findall(r"learner (\d+): done.*accuracy ([0-9.]+)", out)}


def export_after_the_end(job: str, ck: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / "model.pt"
    r = subprocess.run([sys.executable, "-m", "psd.cli", "export", "--job", job, "--checkpoint-dir", str(ck),
                        "--out", str(out)], capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "which has ended" in r.stdout, r.stdout
    return torch.load(out)


def test_lightning_accumulation_two_optimizers_refit_and_a_restart(job, tmp_path):
    """rank 0: Lightning's accumulate_grad_batches=2 and its ModelCheckpoint, then a refit from that checkpoint
    (Lightning loads the optimizer's state_dict back; a second psd optimizer in the same process) for a third
    epoch. rank 1: manual optimization with two psd optimizers (one slot), killed at its batch 10 once."""
    from lightning_mlp import Classifier

    ck = tmp_path / "ck"
    r = psd_run(job, ck, "--lr", "0.05", "--", sys.executable, str(HELPERS / "lightning_learner.py"),
                str(tmp_path / "lightning"))
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.count("learner 1 restarted") == 1, r.stderr[-4000:]
    acc = accuracies(r.stdout)
    assert set(acc) == {0, 1} and min(acc.values()) > 0.6, r.stdout  # ten classes: chance is 0.1
    # A clean run's applied totals: 600 samples a rank, batches of 16 = 38 a epoch.
    # rank 0: 19 steps a epoch (accumulating 2), 3 epochs; rank 1: two optimizers, 38 batches, 2 epochs.
    last = checkpoint.latest(ck)
    assert last is not None and last.ranks[:2] == [19 * 3, 2 * 38 * 2], last.ranks
    saved = torch.load(tmp_path / "lightning" / "last.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["psd"]["job"] == job  # what Lightning saved of the optimizer
    state = export_after_the_end(job, ck, tmp_path)
    model = Classifier(20, 10, None)
    model.load_state_dict(state)  # strict
    assert torch.equal(model.head.weight.detach(), last.weights["head.weight"])


def test_hf_trainer_accumulation_push_every_init_by_name_and_a_restart(job, tmp_path):
    """The Trainer with gradient_accumulation_steps=2 (it zeroes the gradients after each optimizer step) under
    `--push-every 2`, AdamW on the server, the job started from a model saved the usual way
    (safetensors.torch.save_file(model.state_dict()): tensors sorted by name); rank 1 dies after its 5th
    optimizer step once and ResumeCallback resumes it."""
    import hf_trainer

    init = tmp_path / "init.safetensors"
    model = hf_trainer.make_model()
    safetensors.torch.save_file(model.state_dict(), init)
    ck = tmp_path / "ck"
    r = psd_run(job, ck, "--optimizer", "adamw", "--lr", "0.003", "--push-every", "2", "--init", str(init), "--",
                sys.executable, str(HELPERS / "hf_learner.py"), "--epochs", "3", "--n-train", "512",
                "--accumulate", "2", "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.count("learner 1 restarted") == 1, r.stderr[-4000:]
    assert set(accuracies(r.stdout)) == {0, 1}, r.stdout
    # A clean run: 512 sequences / 16 = 32 batches a epoch, 16 optimizer steps, 3 epochs, 2 steps a push.
    last = checkpoint.latest(ck)
    assert last is not None and last.ranks[:2] == [24, 24], last.ranks
    state = export_after_the_end(job, ck, tmp_path)
    model.load_state_dict(state)  # strict, by name
    acc = hf_trainer.accuracy(model, hf_trainer.Sequences(512, seed=1))
    assert acc > 0.8, (acc, r.stdout)  # two balanced classes: chance is 0.5
