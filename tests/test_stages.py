"""`psd run --stages K`: virtual workers of K stage processes, each with a process group of its own and
its part of the model attached with partial=True; a dead stage restarts its whole virtual worker, the
others go on, and every stage's gradients are applied exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import HELPERS, child_env
from psd.watchdog import checkpoint

STEPS = 30


@pytest.mark.parametrize("death", [["--die-at", "12"], ["--die-at-end"]], ids=["mid-run", "after-its-peer-finished"])
def test_two_virtual_workers_of_two_stages_and_a_stage_that_dies(job, tmp_path, death):
    """A stage of virtual worker 0 dies mid-run, or after its peer stage finished (exit 0): the whole virtual
    worker restarts (a finished stage too: the other needs it in its pipeline), and every stage's
    gradients are applied exactly once."""
    sys.path.insert(0, str(HELPERS))
    from safetensors.torch import save_file
    from stage_learner import Pipe

    init = tmp_path / "pipe.safetensors"
    save_file(Pipe().state_dict(), str(init))
    ck, events = tmp_path / "ck", tmp_path / "events.jsonl"
    r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "2", "--stages", "2",
                        "--init", str(init), "--lr", "0.05", "--checkpoint-dir", str(ck), "--event-log",
                        str(events), "--", sys.executable, str(HELPERS / "stage_learner.py"), "--steps",
                        str(STEPS), *death], capture_output=True, text=True, env=child_env(), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    done = {line for line in r.stdout.splitlines() if "done" in line}
    assert done == {f"stage {s} of {v}: done {STEPS}" for v in range(2) for s in range(2)}, r.stdout
    # Exactly once per stage: every rank (virtual worker x stages + stage) applied each of its mini-batches.
    last = checkpoint.latest(ck)
    assert last is not None and last.ranks[:4] == [STEPS] * 4, last.ranks
    seen = [e for e in map(json.loads, events.read_text().splitlines()) if e["source"] == "run"]
    restarts = [e for e in seen if e["event"] == "virtual_worker_restart"]
    assert [e["vw"] for e in restarts] == [0], restarts  # virtual worker 1 went on untouched
    died = {e["rank"] for e in seen if e["event"] == "learner_died"}
    assert 1 in died and not died & {2, 3}, died


def test_ssp_bounds_the_distance_between_virtual_workers_in_waves(job, tmp_path):
    """WSP (HetPipe): with --push-every W each stage pushes one wave of W mini-batches, and --sync ssp:D
    bounds how many waves a virtual worker's stages run ahead of the slowest stage of any virtual worker.
    Virtual worker 1 is 5x slower; the gap in pushes (waves) is sampled while the job runs: it never exceeds
    D + 1 (a stage computes only while at most D ahead, and its push makes it D + 1), the fast virtual worker
    does reach it (so the bound was what held it), nothing deadlocks, and every wave is applied once."""
    sys.path.insert(0, str(HELPERS))
    sys.path.insert(0, str(HELPERS.parent))
    from safetensors.torch import save_file
    from stage_learner import Pipe
    from test_sync import ssp_gap

    from psd import _native
    from psd.arena import ArenaWatch
    from psd.errors import StateError

    init = tmp_path / "pipe.safetensors"
    save_file(Pipe().state_dict(), str(init))
    steps, wave, bound = 24, 2, 1
    proc = subprocess.Popen([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "2", "--stages",
                             "2", "--init", str(init), "--lr", "0.05", "--sync", f"ssp:{bound}", "--push-every",
                             str(wave), "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable,
                             str(HELPERS / "stage_learner.py"), "--steps", str(steps), "--slow-vw", "1", "--delay",
                             "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    worst = samples = 0
    watch = ArenaWatch(job, role="reader")
    try:
        try:
            while proc.poll() is None:
                a = watch.current()
                if a is None or a.state != _native.ARENA_READY:
                    time.sleep(0.001)  # a poll's pace, not a synchronisation: the loop samples until the job ends
                    continue  # not there yet, or its weights not yet in (--init)
                a.remap()  # a mapping made before the model was declared covers the header alone
                try:
                    gap, active = ssp_gap(a)
                except StateError:  # the job is stopping
                    continue
                if active == 4:
                    samples += 1
                    worst = max(worst, gap)
                assert gap <= bound + 1, f"a stage ran {gap} waves ahead of the slowest (ssp:{bound})"
        finally:
            watch.close()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert samples > 50 and worst == bound + 1, (samples, worst)
    last = checkpoint.latest(tmp_path / "ck")
    assert last is not None and last.ranks[:4] == [steps // wave] * 4, last.ranks  # waves, each applied once


def test_stages_on_gpus_get_a_gpu_each_and_a_virtual_worker_never_shares_one(job, tmp_path):
    """`psd run --stages 2 --gpus 0,1`: stage process r = VW * K + STAGE gets PSD_DEVICE=cuda:LIST[r % len], so
    the two stages of each virtual worker are on GPUs 0 and 1 (no GPU is touched: the script prints its
    environment and exits without attaching). A LIST that would put two stages of one virtual worker on one
    GPU (NCCL takes one GPU per rank) is refused before anything starts."""
    script = tmp_path / "show_env.py"
    # one write a line (a pipe takes it whole): the stages share psd run's stdout, and print() may write a
    # line in two pieces that another stage's line lands between
    script.write_text("import os\n"
                      "os.write(1, ' '.join(['stage', *(os.environ[k] for k in ('PSD_RANK', 'PSD_VW', 'PSD_STAGE', "
                      "'RANK', 'WORLD_SIZE', 'PSD_DEVICE'))]).encode() + b'\\n')\n")
    r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "2", "--stages", "2",
                        "--gpus", "0,1", "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable, str(script)],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = sorted(line for line in r.stdout.splitlines() if line.startswith("stage "))
    assert seen == ["stage 0 0 0 0 2 cuda:0", "stage 1 0 1 1 2 cuda:1",
                    "stage 2 1 0 0 2 cuda:0", "stage 3 1 1 1 2 cuda:1"], r.stdout
    for gpus, stages, shared in (("0", 2, "cuda:0, cuda:0"), ("0,1", 3, "cuda:0, cuda:1, cuda:0"),
                                 ("0,1,1", 3, "cuda:0, cuda:1, cuda:1")):
        r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "2", "--stages",
                            str(stages), "--gpus", gpus, "--", sys.executable, str(script)],
                           capture_output=True, text=True, env=child_env(), timeout=60)
        said = f"puts stages of virtual worker 0 on one GPU ({shared} for its {stages} stages)"
        assert r.returncode == 1 and said in r.stderr, (gpus, r.stderr)
        assert "stage " not in r.stdout
