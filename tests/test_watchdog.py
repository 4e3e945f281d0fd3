"""The watchdog: server restarts that lose nothing, hung servers, adoption, checkpoints, resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import Served, arena_header, child_env, finish, header_if_any, kill, read_line, spawn, wait_until
from psd import _native, learner
from psd.arena import shm_name, shm_path
from psd.status import job_status
from psd.watchdog import checkpoint


def test_server_killed_mid_run_loses_nothing(job, serve):
    """Learners keep pushing through a server SIGKILL; the new server drains the rings as they were."""
    serve(job, "--learners", "2", "--lr", "1", "--ring-depth", "8")
    count = 3000
    procs = [spawn("pusher.py", job, "--index", str(r), "--count", str(count), "--ready-after", "500")
             for r in range(2)]
    for p in procs:
        assert read_line(p) == "ready"
    old = arena_header(job)
    os.kill(old["server_pid"], signal.SIGKILL)
    for p in procs:
        assert finish(p).strip().endswith(f"done {count}")
    h = arena_header(job)
    assert h["generation"] == old["generation"] + 1 and h["server_pid"] != old["server_pid"]
    st = job_status(job)
    # At most the one gradient being applied when the server died is applied twice (partly).
    assert st["pushed"] == 2 * count and st["pending"] == 0
    assert st["pushed"] <= st["applied"] <= st["pushed"] + 1
    w = learner.pull_state_dict(job)["w"]
    assert -count - 1 <= w[0] <= -count and -count - 1 <= w[1] <= -count


def test_hung_server_is_killed_and_replaced(job, serve):
    serve(job, "--learners", "1", "--lr", "1", "--heartbeat-timeout", "0.5")
    p = spawn("pusher.py", job, "--count", "2000", "--ready-after", "200")
    assert read_line(p) == "ready"
    hung = arena_header(job)["server_pid"]
    os.kill(hung, signal.SIGSTOP)  # alive, but its heartbeat stops
    try:
        assert finish(p, timeout=60).strip().endswith("done 2000")
    finally:
        try:
            os.kill(hung, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert arena_header(job)["server_pid"] != hung
    wait_until(lambda: _native.proc_start_time(hung) == 0, what="the hung server to be gone")
    assert learner.pull_state_dict(job)["w"][0] <= -2000


def test_learner_gives_a_clear_error_when_the_server_never_comes_back(job, serve):
    s = serve(job, "--learners", "1", "--no-watchdog")

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(16))

    m = Flat()
    ps = learner.attach(m, job=job, reconnect_timeout=1.0)
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait()
    with pytest.raises(learner.client.ServerGone, match=r"did not come back within 1 s.*--resume"):
        for _ in range(100):  # the ring fills, then the wait notices the dead server
            m.w.sum().backward()  # a gradient: a step without one pushes nothing
            ps.step()
    ps.close(flush=False)
    os.unlink(shm_path(job))


def test_killed_watchdog_is_replaced_and_adopts_the_server(job, serve):
    first = serve(job, "--learners", "1")
    server_pid = arena_header(job)["server_pid"]
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    assert _native.proc_start_time(server_pid) != 0, "the server outlives its watchdog"
    second = Served(job, "--learners", "1")
    wait_until(lambda: arena_header(job)["watchdog_pid"] == second.proc.pid, what="the new watchdog to adopt")
    assert arena_header(job)["server_pid"] == server_pid
    with learner.attach(torch.nn.Linear(2, 2), job=job) as ps:
        ps.step()
    log = second.stop()
    assert f"adopted running server pid {server_pid}" in log
    wait_until(lambda: _native.proc_start_time(server_pid) == 0, what="the adopted server to stop")


def test_checkpoints_are_consistent_atomic_and_pruned(job, serve, tmp_path):
    """With lr 1 and unit gradients, consistent weights sum to exactly -clock."""
    s = serve(job, "--learners", "2", "--lr", "1", "--checkpoint-dir", str(tmp_path), "--checkpoint-every",
              "0.2", "--keep", "2")
    procs = [spawn("pusher.py", job, "--index", str(r), "--forever") for r in range(2)]
    for p in procs:
        assert read_line(p) == "ready"  # attached: both slots are taken before anything is killed
    wait_until(lambda: len(checkpoint.list_checkpoints(tmp_path)) >= 2, timeout=60, what="two checkpoints")
    s.proc.send_signal(signal.SIGUSR1)  # on demand
    for p in procs:
        kill(p)  # what they fully pushed is applied all the same
    wait_until(lambda: arena_header(job)["reclaimed"] == 2, what="both pushers' slots to be reclaimed")
    s.stop()  # and one at a clean stop
    files = checkpoint.list_checkpoints(tmp_path)
    assert len(files) == 2, "only the newest --keep are kept"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary files left"
    for f in files:
        c = checkpoint.load(f)
        assert c.weights["w"].sum().item() == -c.clock, f"{f} is not a consistent snapshot"
        assert c.ranks == [0, 0] and c.job == job
    final = checkpoint.load(files[0])
    assert final.clock == final.counters["applied"] == final.counters["pushed"] > 0


def test_resume_skips_torn_and_corrupt_checkpoints(job, tmp_path):
    good = checkpoint.Checkpoint({"w": torch.arange(8.0)}, [checkpoint.ParamSpec("w", (8,))], clock=123,
                                 generation=4, ranks=[7, 9], job=job, created_unix_ns=1)
    checkpoint.write(good, tmp_path)
    src = checkpoint.list_checkpoints(tmp_path)[0]
    torn = tmp_path / "ckpt-00000000000000000002-c200.safetensors"
    torn.write_bytes(src.read_bytes()[:-10])
    flipped = bytearray(src.read_bytes())
    flipped[-1] ^= 0xFF
    (tmp_path / "ckpt-00000000000000000003-c300.safetensors").write_bytes(bytes(flipped))
    s = Served(job, "--learners", "2", "--resume", str(tmp_path), "--no-watchdog")
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(8))
    with learner.attach(m, job=job, rank=1) as ps:
        assert torch.equal(m.w.detach(), torch.arange(8.0))
        assert ps.clock == 123 and ps.resume_step == 9
    h = arena_header(job)
    assert h["generation"] == 5
    log = s.stop()
    assert "checksum mismatch" in log and "unreadable" in log and "resuming from" in log


def test_lost_arena_restarts_from_the_last_checkpoint(job, serve, tmp_path):
    s = serve(job, "--learners", "1", "--lr", "1", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0")
    p = spawn("pusher.py", job, "--count", "100")
    finish(p)
    s.proc.send_signal(signal.SIGUSR1)
    wait_until(lambda: checkpoint.list_checkpoints(tmp_path), what="the checkpoint")
    server = arena_header(job)["server_pid"]
    _native.unlink(shm_name(job))  # the arena is lost (e.g. someone cleaned /dev/shm) ...
    os.kill(server, signal.SIGKILL)  # ... and so is the server
    wait_until(lambda: (h := header_if_any(job)) and h["state"] == _native.ARENA_READY,
               what="the server to come back from the checkpoint")
    assert learner.pull_state_dict(job)["w"][0] == -100.0
    assert arena_header(job)["clock"] == 100


def test_psd_run_restarts_one_learner_and_finishes(job, tmp_path):
    """A learner killed under `psd run` is restarted alone and resumes where it stopped."""
    script = tmp_path / "learner.py"
    script.write_text(
        "import os, sys, torch\n"
        "from psd import learner\n"
        "m = torch.nn.Module(); m.w = torch.nn.Parameter(torch.zeros(4))\n"
        "rank = int(os.environ['PSD_RANK'])\n"
        "with learner.attach(m) as ps:\n"
        "    for step in range(ps.resume_step, 3000):\n"
        "        m.w.grad = torch.zeros(4)\n"
        "        m.w.grad[rank] = 1.0\n"
        "        ps.step()\n"
        "        if step == 1000 and rank == 1 and os.environ['PSD_RESTARTS'] == '0':\n"
        "            os.kill(os.getpid(), 9)\n"
    )
    r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "3", "--lr", "1",
                        "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable, str(script)],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "learner 1 (SIGKILL) died; restarting it alone" in r.stderr
    final = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "ck")[0])
    # Each rank's 3000 gradients applied exactly once, the killed one's included.
    assert final.weights["w"][:3].tolist() == [-3000.0] * 3
    assert final.ranks[:3] == [3000] * 3
    assert not os.path.exists(shm_path(job))


def test_a_large_model_admitted_keeps_the_server_beating(job, serve):
    """Growing the arena for a large model takes seconds (fallocate and zeroing of many GB, at about 4 GB/s); the
    server beats all the while (native/arena.c, after each 256 MiB), so its watchdog does not take the grow for a
    hang and restart it. Here a 3.9 GB arena under a 0.5 s heartbeat timeout (the default 2 s is a 10-15 GB one:
    100M parameters were restarted so)."""
    s = serve(job, "--learners", "4", "--ring-depth", "16", "--heartbeat-timeout", "0.5")
    wait_until(lambda: arena_header(job)["server_pid"] != s.proc.pid, what="the watchdog's server")
    server = arena_header(job)["server_pid"]
    p = spawn("pusher.py", job, "--n", str(15_000_000), "--count", "2")
    assert finish(p, timeout=120).split()[-2:] == ["done", "2"]
    assert arena_header(job)["server_pid"] == server, "the watchdog restarted the server while it grew the arena"
    log = s.stop()
    assert "has not beaten" not in log, log


@pytest.mark.parametrize("source", ["resume", "init"])
def test_a_server_killed_before_its_first_weights_were_written_starts_over_from_them(job, tmp_path, monkeypatch,
                                                                                    source):
    """A server that loads the job's weights itself (--resume's checkpoint, or --init) is SIGKILLed with its arena
    made and claimed but those weights not yet written (a large checkpoint takes seconds). Its watchdog starts
    the next server from them again: taking the weightless arena over, that server would wait for the next
    learner's model and make it the job's. And the stop writes a checkpoint of the job's weights."""
    from safetensors.torch import save_file

    ck = tmp_path / "ck"
    w = torch.arange(8.0)
    if source == "resume":
        checkpoint.write(checkpoint.Checkpoint({"w": w}, [checkpoint.ParamSpec("w", (8,))], clock=123, generation=4,
                                               ranks=[7, 9], job=job, created_unix_ns=1), ck)
        flags = ["--resume", str(ck)]
    else:
        save_file({"w": w}, str(tmp_path / "init.safetensors"))
        flags = ["--init", str(tmp_path / "init.safetensors")]
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("PSD_TEST_CRASH_BEFORE_WEIGHTS", str(crashed))
    s = Served(job, "--learners", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "0", *flags)
    try:
        wait_until(lambda: crashed.exists() and (h := header_if_any(job)) and h["state"] == _native.ARENA_READY,
                   timeout=60, what="the next server to load the weights")
        assert torch.equal(learner.pull_state_dict(job)["w"], w)
        assert arena_header(job)["clock"] == (123 if source == "resume" else 0)
    finally:
        log = s.stop()
    assert "restarting it" in log and "never held the job's weights; starting over" in log, log
    if source == "resume":  # each server reads the checkpoint once (the next one read it twice, twice the memory)
        assert log.count(": resuming from ") == log.count("(resuming from checkpoint)") >= 2, log
    last = checkpoint.latest(ck)
    assert last is not None and torch.equal(last.weights["w"], w), log


def test_a_stop_before_the_job_held_a_model_writes_no_checkpoint(job, serve, tmp_path):
    """A learner offered its model and was killed before it wrote the weights: the server waits for another, and
    a stop then leaves an arena with the model's sizes and zeros for weights. No checkpoint of it is written:
    the next --resume would take those zeros for the job's model."""
    s = serve(job, "--learners", "2", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0")
    p = spawn("offerer.py", job)
    assert read_line(p) == "ready"
    kill(p)
    wait_until(lambda: arena_header(job)["state"] == _native.ARENA_WAITING_SPEC, what="the server to wait again")
    log = s.stop()
    assert "died before writing its initial weights" in log, log
    assert checkpoint.list_checkpoints(tmp_path) == [], log


@pytest.mark.parametrize("checkpointed", [True, False])
def test_resume_and_init_together_start_from_the_checkpoint_where_one_exists(job, serve, tmp_path, checkpointed):
    """`--init F --resume DIR` (what `psd run --init F` gives every watchdog after its first, and a user restarting
    a job with the command that started it): the job's newest checkpoint where DIR has one, its clock with it;
    F where it has none. F won over the checkpoint: the work since the job began was lost at each restart."""
    from safetensors.torch import save_file

    ck = tmp_path / "ck"
    save_file({"w": torch.full((8,), 5.0)}, str(tmp_path / "init.safetensors"))
    if checkpointed:
        checkpoint.write(checkpoint.Checkpoint({"w": torch.arange(8.0)}, [checkpoint.ParamSpec("w", (8,))],
                                               clock=42, generation=2, ranks=[0], job=job, created_unix_ns=1), ck)
    s = serve(job, "--learners", "1", "--init", str(tmp_path / "init.safetensors"), "--resume", str(ck))
    wait_until(lambda: arena_header(job)["state"] == _native.ARENA_READY, timeout=60, what="the weights")
    w = learner.pull_state_dict(job)["w"]
    if checkpointed:
        assert torch.equal(w, torch.arange(8.0)) and arena_header(job)["clock"] == 42
    else:
        assert torch.equal(w, torch.full((8,), 5.0)) and arena_header(job)["clock"] == 0
    s.stop()


def test_resume_and_init_restarted_take_the_arena_over(job, tmp_path):
    """`psd serve --init F --resume DIR` started from DIR's checkpoint (a module's order: w, then b) and its server
    was SIGKILLed: the same command takes the arena over. It compared the arena's model with F's (safetensors
    lists tensors by name: b, then w) and refused "another model than F"; the arena is newer than both anyway."""
    from safetensors.torch import save_file

    spec = [checkpoint.ParamSpec("w", (4,)), checkpoint.ParamSpec("b", (2,))]
    checkpoint.write(checkpoint.Checkpoint({"w": torch.full((4,), 3.0), "b": torch.full((2,), 3.0)}, spec, clock=9,
                                           generation=1, ranks=[0], job=job, created_unix_ns=1), tmp_path / "ck")
    save_file({"w": torch.zeros(4), "b": torch.zeros(2)}, str(tmp_path / "init.safetensors"))
    flags = ["--learners", "1", "--no-watchdog", "--init", str(tmp_path / "init.safetensors"), "--resume",
             str(tmp_path / "ck")]
    first = Served(job, *flags)
    wait_until(lambda: arena_header(job)["state"] == _native.ARENA_READY, timeout=60, what="the checkpoint loaded")
    first.proc.kill()
    first.proc.wait()
    second = Served(job, *flags)
    try:
        assert arena_header(job)["clock"] == 9 and arena_header(job)["server_pid"] == second.proc.pid
        assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((4,), 3.0))
    finally:
        log = second.stop()
    assert "taking over the arena of dead server" in log, log


def test_a_checkpoint_of_another_model_than_init_is_refused(job, tmp_path):
    """`--init F --resume DIR` where DIR's newest checkpoint holds another model than F (another run's, under the
    same job name): a clear error, not a job silently started from the wrong model."""
    from safetensors.torch import save_file

    checkpoint.write(checkpoint.Checkpoint({"v": torch.ones(3)}, [checkpoint.ParamSpec("v", (3,))], clock=5,
                                           generation=1, ranks=[0], job=job, created_unix_ns=1), tmp_path / "ck")
    save_file({"w": torch.zeros(4)}, str(tmp_path / "init.safetensors"))
    r = subprocess.run([sys.executable, "-m", "psd.cli", "serve", "--job", job, "--learners", "1", "--no-watchdog",
                        "--init", str(tmp_path / "init.safetensors"), "--resume", str(tmp_path / "ck")],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode != 0 and "holds another model than --init" in r.stderr, r.stderr
    assert not os.path.exists(shm_path(job))


def test_a_server_killed_before_its_arena_restarts_from_init_not_an_older_checkpoint(job, tmp_path, monkeypatch):
    """`psd serve --init F` (no --resume), its first server killed before it made the arena (an OOM kill while it
    reads a large F): the next one was started with --resume too, and a checkpoint an earlier run of the job left
    in the checkpoint directory won over F. A job that never held a model starts again as it first did."""
    from safetensors.torch import save_file

    ck = tmp_path / "ck"
    checkpoint.write(checkpoint.Checkpoint({"w": torch.ones(8)}, [checkpoint.ParamSpec("w", (8,))], clock=99,
                                           generation=3, ranks=[0], job=job, created_unix_ns=1), ck)
    save_file({"w": torch.full((8,), 5.0)}, str(tmp_path / "init.safetensors"))
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("PSD_TEST_CRASH_AT_START", str(crashed))
    s = Served(job, "--learners", "1", "--checkpoint-dir", str(ck), "--checkpoint-every", "0", "--init",
               str(tmp_path / "init.safetensors"))
    try:
        wait_until(lambda: arena_header(job)["state"] == _native.ARENA_READY, timeout=60, what="the weights")
        assert crashed.exists()
        assert torch.equal(learner.pull_state_dict(job)["w"], torch.full((8,), 5.0))
        assert arena_header(job)["clock"] == 0
    finally:
        log = s.stop()
    assert "restarting it" in log, log


def test_a_learner_that_offered_its_model_follows_the_arena_a_new_server_makes(job, serve, tmp_path):
    """A learner offered its model to the arena of a server that then died; the next server, given --init F,
    unlinks that weightless arena and starts over on a new one. The learner, waiting for its offer to be taken,
    follows it (it waited out its whole attach timeout on the old arena) and gets F's weights."""
    from safetensors.torch import save_file

    save_file({"weight": torch.full((4, 4), 5.0), "bias": torch.full((4,), 5.0)}, str(tmp_path / "init.safetensors"))
    first = Served(job, "--learners", "2", "--no-watchdog")
    first.proc.kill()
    first.proc.wait()
    code = ("import sys, time, torch\nfrom psd import learner\nm = torch.nn.Linear(4, 4)\nt = time.monotonic()\n"
            "with learner.attach(m, job=sys.argv[1], timeout=30) as ps:\n"
            "    ps.pull()\n"
            "    print(round(time.monotonic() - t, 1), float(m.weight.detach().sum()), flush=True)\n")
    p = subprocess.Popen([sys.executable, "-c", code, job], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env())
    try:
        wait_until(lambda: arena_header(job)["state"] == _native.ARENA_SPEC_OFFERED, timeout=60,
                   what="the learner's offer")
        second = serve(job, "--learners", "2", "--no-watchdog", "--init", str(tmp_path / "init.safetensors"))
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    took, total = out.split()
    assert float(total) == 80.0 and float(took) < 20, out  # F's 16 x 5.0, well within the 30 s timeout
    assert "never held the job's weights" in second.stop()


OWN_MODEL = """
import sys, torch
from psd import learner
model = torch.nn.Linear(8, 8, bias=False)
torch.nn.init.constant_(model.weight, 7.0)
with learner.attach(model, job=sys.argv[1]) as ps:
    print(float(learner.pull_state_dict(sys.argv[1])["weight"].sum()), flush=True)
"""


def test_a_server_killed_in_its_stop_before_the_job_held_a_model_leaves_no_model_of_zeros(job, serve, tmp_path,
                                                                                         monkeypatch):
    """A server stopped while a learner's offered model had no weights yet, and killed in its stop between marking
    the arena STOPPED and unlinking it, left a STOPPED arena with the model's sizes and zeros for weights; the next
    server took it over as READY ("go on where it stopped"), and the next learner got those zeros as the job's
    model in place of its own. Such an arena is now unlinked before it is marked: the next learner's model is the
    job's. Without a watchdog, as under an outside supervisor (a watchdog's stop removes a dead server's arena
    itself)."""
    monkeypatch.setenv("PSD_TEST_CRASH_IN_STOP", str(tmp_path / "crashed"))
    s = serve(job, "--learners", "2", "--no-watchdog")
    p = spawn("offerer.py", job)
    try:
        assert read_line(p) == "ready"
        assert arena_header(job)["state"] == _native.ARENA_INIT_WEIGHTS
        s.proc.send_signal(signal.SIGTERM)
        out, _ = s.proc.communicate(timeout=60)
    finally:
        kill(p)
    assert (tmp_path / "crashed").exists(), out
    assert not os.path.exists(shm_path(job)) or arena_header(job)["state"] != _native.ARENA_STOPPED, out
    serve(job, "--learners", "2", "--no-watchdog")
    r = subprocess.run([sys.executable, "-c", OWN_MODEL, job], capture_output=True, text=True, env=child_env(),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split()[-1]) == 7.0 * 64, "the job's model is not the learner's: " + r.stdout + r.stderr


def test_the_start_limit_allows_for_reading_what_the_server_loads(tmp_path):
    """A server reads --resume's checkpoints (each of them, where the newest are torn) or --init's file before it
    makes its arena; the watchdog's start limit (30 s) and `psd run`'s wait for the arena grow by their bytes at
    100 MB/s, or a large checkpoint's load was killed as a hang, again after every restart."""
    job = "allowance"
    for clock in (1, 2):
        checkpoint.write(checkpoint.Checkpoint({"w": torch.zeros(250_000)}, [checkpoint.ParamSpec("w", (250_000,))],
                                               clock=clock, generation=1, ranks=[0], job=job,
                                               created_unix_ns=clock), tmp_path / "ck")
    files = checkpoint.list_checkpoints(tmp_path / "ck")
    assert len(files) == 2
    size = sum(f.stat().st_size for f in files)
    assert size > 2_000_000
    assert checkpoint.load_allowance(tmp_path / "ck") == size / checkpoint.LOAD_RATE
    assert checkpoint.load_allowance(files[0]) == files[0].stat().st_size / checkpoint.LOAD_RATE
    assert checkpoint.load_allowance(tmp_path / "none") == 0.0
    assert checkpoint.load_allowance(None) == 0.0


def test_psd_stop_lets_the_watchdog_write_a_large_last_checkpoint(job, serve, tmp_path):
    """`psd stop --timeout T` SIGKILLs a watchdog still running after T, and the watchdog writes the last checkpoint
    only after the server stopped, from the one copy left: a large model's write outlasted T and was killed, the
    work since the last checkpoint lost while `psd stop` reported success. The stop allows for the model's bytes
    at 100 MB/s on top of T: here 600 MB (50M parameters with Adam's two vectors), 2-5 s to stop and write on
    the 2-core VM, under a --timeout of 2 s (6 s more for the model)."""
    s = serve(job, "--learners", "1", "--ring-depth", "1", "--optimizer", "adam", "--checkpoint-dir", str(tmp_path),
              "--checkpoint-every", "0")
    p = spawn("pusher.py", job, "--n", str(50_000_000), "--count", "3")
    assert finish(p, timeout=120).split()[-2:] == ["done", "3"]
    r = subprocess.run([sys.executable, "-m", "psd.cli", "stop", "--job", job, "--timeout", "2"],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr
    assert s.proc.wait(timeout=30) == 0, "the watchdog was killed"
    last = checkpoint.latest(tmp_path)
    assert last is not None and last.clock == 3
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")], "a temporary file was left"


_DETACHED = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: None)  # a watchdog busy with its last checkpoint goes on after SIGTERM
mode, out = sys.argv[1], sys.argv[2]
open(out + ".ready", "w").close()
end = time.monotonic() + (1.5 if mode == "work" else 1e9)
while time.monotonic() < end:
    if mode == "idle":
        time.sleep(1)  # no CPU, no writes: stuck
    # else: CPU time moves, as a checkpoint's copy and serialisation do
open(out + ".done", "w").close()
"""


def _detached(tmp_path, mode: str) -> tuple[int, int]:
    """A process that is not ours to wait for (as the watchdog is not psd stop's), ignoring SIGTERM; its pid and
    start time."""
    out = str(tmp_path / mode)
    r = subprocess.run(["sh", "-c", f'"$0" -c "$1" {mode} {out} >/dev/null 2>&1 & echo $!', sys.executable,
                        _DETACHED], capture_output=True, text=True, timeout=30, check=True)
    wait_until(lambda: os.path.exists(out + ".ready"), timeout=30)
    pid = int(r.stdout)
    return pid, _native.proc_start_time(pid)


def test_psd_stop_waits_for_a_watchdog_that_works_past_its_deadline_and_kills_one_that_does_not(tmp_path):
    """terminate_writer, what `psd stop` stops a watchdog with: past its deadline a process that still runs or
    writes is waited for (a last checkpoint slower than the 100 MB/s allowed for, on a loaded machine: it was
    SIGKILLed halfway and its work lost, while psd stop said "stopped"); one that neither runs nor writes for
    the idle window is killed, and so is one that runs past the cap; each kill is reported."""
    import time

    from psd.watchdog.supervisor import terminate_writer

    pids = []
    try:
        pids.append(pid := _detached(tmp_path, "work"))
        told = []
        t0 = time.monotonic()
        assert not terminate_writer(*pid, deadline=0.2, idle=1.0, cap=60.0, waiting=told.append)
        assert (tmp_path / "work.done").exists() and time.monotonic() - t0 > 0.2  # it finished its work
        assert told == [60.0]  # told once, as the deadline passed
        pids.append(pid := _detached(tmp_path, "idle"))
        t0 = time.monotonic()
        assert terminate_writer(*pid, deadline=0.2, idle=1.0, cap=60.0)
        assert 1.0 <= time.monotonic() - t0 < 30  # the idle window (which began at the signal), past the deadline
        wait_until(lambda: _native.proc_start_time(pid[0]) == 0, timeout=30)  # SIGKILLed: gone (or a zombie)
        pids.append(pid := _detached(tmp_path, "busy"))  # works for ever
        t0 = time.monotonic()
        assert terminate_writer(*pid, deadline=0.2, idle=1.0, cap=1.5)
        assert 1.5 <= time.monotonic() - t0 < 30
        pids.append(pid := _detached(tmp_path, "other"))  # a pid whose start time is not the one recorded
        assert not terminate_writer(pid[0], pid[1] + 1, deadline=0.0, idle=0.0, cap=0.0, sig=signal.SIGKILL)
        assert _native.owner_alive(*pid)  # another process than the one meant: not signalled
    finally:
        for p, start in pids:
            if _native.owner_alive(p, start):
                os.kill(p, signal.SIGKILL)


def test_psd_stop_reports_a_watchdog_it_had_to_kill(job, serve):
    """A watchdog that does nothing after psd stop's SIGTERM (stopped here with SIGSTOP) is killed once --timeout
    and the idle window have passed, and psd stop says so and exits 1, naming the server it left running; a
    second psd stop stops that server."""
    s = serve(job, "--learners", "1")
    wait_until(lambda: arena_header(job)["watchdog_pid"] == s.proc.pid, timeout=30)  # the job names its watchdog
    os.kill(s.proc.pid, signal.SIGSTOP)
    r = subprocess.run([sys.executable, "-m", "psd.cli", "stop", "--job", job, "--timeout", "1"],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"its watchdog (pid {s.proc.pid})" in r.stderr and "was killed" in r.stderr, r.stderr
    server = arena_header(job)["server_pid"]
    assert f"its server (pid {server}) is still running" in r.stderr, r.stderr
    assert s.proc.wait(timeout=30) == -signal.SIGKILL
    r = subprocess.run([sys.executable, "-m", "psd.cli", "stop", "--job", job, "--timeout", "30"],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr


def test_a_checkpoint_write_removes_what_a_killed_writer_left(tmp_path):
    """A writer killed mid-write leaves `.ckpt-....tmp-PID`; the next write removes those of dead writers (whose
    files would otherwise fill the directory, one checkpoint's size each), once untouched for 10 minutes. It
    keeps a live writer's, and a fresh one whose pid is unknown here: another node's write in progress, in a
    directory the nodes share (removing it failed that node's rename)."""
    import time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        tmp_path.mkdir(exist_ok=True)
        stale = tmp_path / f".ckpt-00000000000000000001-c1.safetensors.tmp-{dead.pid}"
        live = tmp_path / f".ckpt-00000000000000000002-c2.safetensors.tmp-{alive.pid}"
        elsewhere = tmp_path / f".ckpt-00000000000000000004-c4.safetensors.tmp-{dead.pid}"
        for f in (stale, live, elsewhere):
            f.write_bytes(b"x" * 1000)
        old = time.time() - checkpoint.STALE_TMP_S - 60
        for f in (stale, live):
            os.utime(f, (old, old))
        checkpoint.write(checkpoint.Checkpoint({"w": torch.zeros(4)}, [checkpoint.ParamSpec("w", (4,))], clock=3,
                                               generation=1, ranks=[0], job="tmp", created_unix_ns=3), tmp_path)
        assert not stale.exists() and live.exists() and elsewhere.exists()
    finally:
        alive.stdin.close()
        alive.wait()


def test_a_server_hung_before_its_first_beat_is_restarted(job, tmp_path, monkeypatch):
    """A server that hangs while it takes a dead server's arena over, before its first heartbeat, was waited for
    without end (the start limit applied only while no arena existed). Now --start-timeout holds for it too: the
    watchdog kills it and the next server takes the arena over, nothing lost."""
    hung = tmp_path / "hung"
    monkeypatch.setenv("PSD_TEST_HANG_IN_TAKEOVER", str(hung))
    s = Served(job, "--learners", "1", "--lr", "1", "--start-timeout", "3", "--checkpoint-every", "0",
               "--checkpoint-dir", str(tmp_path / "ck"))
    try:
        assert finish(spawn("pusher.py", job, "--count", "5")).split()[-2:] == ["done", "5"]
        first = arena_header(job)["server_pid"]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: hung.exists(), timeout=30, what="the next server to hang in its takeover")
        wait_until(lambda: arena_header(job)["server_pid"] != first and _native.owner_alive(
            arena_header(job)["server_pid"], arena_header(job)["server_start_time"]), timeout=60,
            what="a third server to take the arena over")
        assert learner.pull_state_dict(job)["w"][0] == -5.0
    finally:
        log = s.stop()
    assert "has not taken over its arena and beaten 3 s after its start" in log, log


def test_a_server_loading_a_large_checkpoint_keeps_beating(job, tmp_path, monkeypatch):
    """A server that loads the job's weights itself is the arena's server while it copies them in (seconds for a
    large checkpoint, with its optimizer state); its grow beat, so its watchdog took it for RUNNING, and the copy
    that followed did not: the watchdog restarted it as hung, and every next server the same way (a 3 GB
    checkpoint under the default 2 s). It beats throughout now. PSD_TEST_SLOW_LOAD makes the copy take 2 s,
    under --heartbeat-timeout 0.5."""
    from safetensors.torch import save_file

    save_file({"w": torch.arange(8.0)}, str(tmp_path / "init.safetensors"))
    monkeypatch.setenv("PSD_TEST_SLOW_LOAD", "2")
    s = Served(job, "--learners", "1", "--heartbeat-timeout", "0.5", "--checkpoint-every", "0", "--checkpoint-dir",
               str(tmp_path / "ck"), "--init", str(tmp_path / "init.safetensors"))
    try:
        wait_until(lambda: arena_header(job)["state"] == _native.ARENA_READY, timeout=60, what="the weights")
        assert torch.equal(learner.pull_state_dict(job)["w"], torch.arange(8.0))
    finally:
        log = s.stop()
    assert "restarting it" not in log, log


def test_a_server_restoring_a_lost_arena_killed_before_its_weights_starts_over_from_the_checkpoint(
        job, serve, tmp_path, monkeypatch):
    """The arena is lost with its server; the next server restores it from the checkpoint and is killed before it
    wrote the weights (a large checkpoint takes seconds). The one after must start over from the checkpoint too:
    taking the weightless arena over, it made the next learner's model the job's, and its next checkpoint the
    newest. The job was not started with --resume: the watchdog's own restore is what is resumed."""
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("PSD_TEST_CRASH_BEFORE_WEIGHTS", str(crashed))
    ck = tmp_path / "ck"
    s = serve(job, "--learners", "1", "--lr", "1", "--checkpoint-dir", str(ck), "--checkpoint-every", "0")
    assert finish(spawn("pusher.py", job, "--count", "5")).split()[-2:] == ["done", "5"]
    s.proc.send_signal(signal.SIGUSR1)
    wait_until(lambda: checkpoint.list_checkpoints(ck), what="the checkpoint")
    server = arena_header(job)["server_pid"]
    _native.unlink(shm_name(job))  # the arena is lost ...
    os.kill(server, signal.SIGKILL)  # ... with its server
    wait_until(lambda: crashed.exists() and (h := header_if_any(job)) and h["state"] == _native.ARENA_READY,
               timeout=60, what="a server after the killed restorer to load the checkpoint")
    assert learner.pull_state_dict(job)["w"][0] == -5.0 and arena_header(job)["clock"] == 5
    log = s.stop()
    assert "never held the job's weights; starting over from " + str(ck) in log, log
    assert checkpoint.latest(ck).clock == 5


def test_a_stall_of_the_whole_machine_restarts_nothing(job, serve):
    """The whole machine stalls (a paused VM, heavy swapping): the watchdog and its server both stop running for
    3 s, over the 2 s heartbeat timeout, and wake one after the other. The server's heartbeat is then old, but
    only because nothing ran: the watchdog gives a server the heartbeat timeout to beat again after its own stall
    before it calls it hung (it restarted the healthy server). Here the server wakes 0.5 s after its watchdog."""
    import time
    from pathlib import Path

    events = Path(child_env()["XDG_STATE_HOME"]) / f"{job}-events.jsonl"
    s = serve(job, "--learners", "1", "--event-log", str(events))
    wait_until(lambda: events.exists() and '"server_running"' in events.read_text(),
               what="the watchdog to count its server running")
    server = arena_header(job)["server_pid"]
    for pid in (s.proc.pid, server):
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(3.0)  # the stall itself, not synchronisation
        os.kill(s.proc.pid, signal.SIGCONT)
        time.sleep(0.5)  # the server wakes later than its watchdog (the stall's end, staggered)
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
        os.kill(server, signal.SIGCONT)
    wait_until(lambda: 0 <= arena_header(job)["heartbeat_age_s"] < 0.5, what="the server to beat again")
    assert arena_header(job)["server_pid"] == server
    log = s.stop()
    assert "has not beaten" not in log, log


STOP_AFTER_A_LOST_COPY = """
import os, sys
from psd.arena import recover_from_sigbus, shm_path
from psd.server import ServeConfig
from psd.watchdog import checkpoint
from psd.watchdog.supervisor import Watchdog, WatchdogConfig
recover_from_sigbus()  # as psd serve's watchdog
job, ck = sys.argv[1], sys.argv[2]
wd = Watchdog(WatchdogConfig(ServeConfig(job=job, learners=1, lr=1.0), ck, checkpoint_every=0))
copy = checkpoint.snapshot

def truncated_under_the_copy(a, *args, **kw):
    os.truncate(shm_path(job), 8192)  # a learner truncates the file as the watchdog copies it
    return copy(a, *args, **kw)

wd.start()
wd.poll()
checkpoint.snapshot = truncated_under_the_copy
print("checkpoint", wd.checkpoint(force=True), flush=True)
wd.stop()
print("stopped", wd.state.name, flush=True)
"""


def test_a_watchdog_stops_cleanly_after_a_checkpoint_lost_to_a_truncation(job, tmp_path):
    """A truncation lands in the watchdog's checkpoint copy (recovered: no checkpoint written); its stop then must
    stop the server as usual. Its mapping, lost, made the stop's first look at the arena raise ArenaLost, so the
    server was never stopped and the watchdog exited with a traceback."""
    s = Served(job, "--learners", "1", "--lr", "1", "--no-watchdog")
    try:
        assert finish(spawn("pusher.py", job, "--count", "5"), timeout=60).split()[-2:] == ["done", "5"]
        r = subprocess.run([sys.executable, "-c", STOP_AFTER_A_LOST_COPY, job, str(tmp_path / "ck")],
                           capture_output=True, text=True, env=child_env(), timeout=60)
        s.proc.wait(timeout=30)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        subprocess.run([sys.executable, "-m", "psd.cli", "clean", "--job", job], env=child_env(), capture_output=True)
    assert r.returncode == 0 and r.stdout == "checkpoint None\nstopped STOPPED\n", (r.stdout, r.stderr[-3000:])
    assert "checkpoint skipped" in r.stderr and not checkpoint.list_checkpoints(tmp_path / "ck")


def test_rotation_keeps_other_runs_checkpoints_and_bounds_a_jobs_own_lives(tmp_path):
    """`--keep` prunes what an earlier run or an earlier life of the job left, but not the checkpoints of another run
    writing beside it (forked from the same checkpoint into the same directory; several nodes): those it deleted
    before, and with lineages that run then had nothing to restore from. A job resumed life after life keeps its
    own newest and the one it began from."""
    from psd.arena import ParamSpec

    def write(lineage: int, made: int, clock: int, born: int = 0, origin: tuple[int, int] = (0, 0)) -> None:
        checkpoint.write(checkpoint.Checkpoint({"w": torch.full((4,), float(clock))}, [ParamSpec("w", (4,))],
                                               clock=clock, generation=1, ranks=[0], job="j", created_unix_ns=made,
                                               lineage=lineage, born_unix_ns=born, origin=origin), tmp_path, keep=3)

    write(1, 100, 5)  # the checkpoint both runs fork from
    for made, clock in [(150, 11), (151, 12)]:
        write(20, made, clock, born=120, origin=(100, 5))  # run B
    for made, clock in [(200, 6), (201, 7), (202, 8)]:
        write(10, made, clock, born=110, origin=(100, 5))  # run A, writing on
    assert checkpoint.of_job(tmp_path, None, 20, (100, 5)).clock == 12  # B's own, still there
    assert checkpoint.of_job(tmp_path, None, 10, (100, 5)).clock == 8
    lives = tmp_path / "lives"
    origin, born = (0, 0), 1000
    for life in range(1, 5):  # stopped and resumed: a new lineage each life, from the last life's newest
        for k in range(4):
            made = born + k
            checkpoint.write(checkpoint.Checkpoint({"w": torch.zeros(4)}, [ParamSpec("w", (4,))], clock=made,
                                                   generation=1, ranks=[0], job="j", created_unix_ns=made,
                                                   lineage=life, born_unix_ns=born, origin=origin), lives, keep=3)
        origin, born = (made, made), born + 1000
        assert len(checkpoint.list_checkpoints(lives)) <= 4  # its own 3, and the one it began from


def test_a_checkpoint_written_after_the_wall_clock_stepped_back_is_kept(tmp_path):
    """A checkpoint is named by its creation time: written after the wall clock stepped back, it sorted below the
    job's last ones and was pruned as it was written, while the watchdog noted it as the job's newest. It is kept,
    and it is what the job restores (its clock is the job's newest)."""
    from psd.arena import ParamSpec

    t = 10**18
    for clock, made in [(1, t), (2, t + 1), (3, t + 2), (4, t - 3600 * 10**9)]:
        path = checkpoint.write(checkpoint.Checkpoint({"w": torch.full((4,), float(clock))}, [ParamSpec("w", (4,))],
                                                      clock=clock, generation=1, ranks=[0], job="j",
                                                      created_unix_ns=made, lineage=7, born_unix_ns=t - 10**12),
                                tmp_path, keep=3)
    assert path.exists()
    assert checkpoint.of_job(tmp_path, None, 7).clock in (3, 4)  # by name, the newest is clock 3's
    assert 4 in {checkpoint.load(p).clock for p in checkpoint.list_checkpoints(tmp_path)}


def test_regrowing_for_a_smaller_model_never_shrinks_the_arena_file(job):
    """A learner that offered a model died before writing its weights, and the next one offers a smaller model: the
    server grows the arena again. The file must not shrink (a file shorter than a mapping of it is a truncation, and
    the watchdog restarts the server at once: ArenaWatch.truncated)."""
    from psd.arena import ArenaWatch, ParamSpec, encode_spec, model_sizes

    a = _native.create(shm_name(job), 0o600, 2, 4, 1 << 16, "test")
    me = os.getpid()

    def offer(n: int) -> None:
        spec = [ParamSpec("w", (n,))]
        assert a.set_spec(*encode_spec(spec), model_sizes(spec), me, _native.proc_start_time(me))
        a.grow()

    watch = ArenaWatch(job)
    try:
        offer(1_000_000)
        big = os.stat(shm_path(job)).st_size
        assert watch.current() is not None
        a.set_state(_native.ARENA_WAITING_SPEC)
        offer(1000)
        assert os.stat(shm_path(job)).st_size == big
        assert watch.current() is not None and not watch.truncated
    finally:
        watch.close()
        a.close()
        _native.unlink(shm_name(job))


def test_a_start_limit_counts_the_jobs_own_checkpoints_in_a_shared_directory(tmp_path):
    """A directory that jobs share keeps every ended job's own newest (pruning spares other jobs'): the time a
    resuming server is given to read it counts the job's own checkpoints alone (it reads no other), and all of
    them for a job with none there (it falls back to the directory's newest)."""
    from psd.arena import ParamSpec

    for who, n in (("small", 1024), ("big", 1 << 20)):
        checkpoint.write(checkpoint.Checkpoint({"w": torch.zeros(n)}, [ParamSpec("w", (n,))], clock=1, generation=1,
                                               ranks=[0], job=who, created_unix_ns=n), tmp_path)
    sizes = {checkpoint.job_of(p): p.stat().st_size for p in checkpoint.list_checkpoints(tmp_path)}
    assert checkpoint.load_allowance(tmp_path, "small") == sizes["small"] / checkpoint.LOAD_RATE
    assert checkpoint.load_allowance(tmp_path, "new") == checkpoint.load_allowance(tmp_path) == \
        sum(sizes.values()) / checkpoint.LOAD_RATE
