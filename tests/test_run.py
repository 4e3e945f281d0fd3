"""`psd run` as a user runs it: Ctrl-C stops everything; a learner that cannot work fails the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from chaos_helpers import leftovers

from conftest import child_env, killed_at_exit, signalled_in_wait, wait_until
from psd.arena import open_job, shm_path


def psd_run(job: str, tmp, *command: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "2",
                             "--checkpoint-dir", str(tmp), *extra, "--", *command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def test_ctrl_c_stops_everything_and_leaves_nothing(job, tmp_path):
    script = tmp_path / "forever.py"
    script.write_text(
        "import torch\nfrom psd import learner\n"
        "m = torch.nn.Linear(4, 2)\n"
        "with learner.attach(m) as ps:\n"
        "    while True:\n"
        "        m(torch.randn(2, 4)).sum().backward()\n"
        "        ps.step()\n"
    )
    run = psd_run(job, tmp_path / "ck", sys.executable, str(script))

    def learners_attached() -> bool:
        try:
            a = open_job(job)
        except Exception:
            return False
        try:
            return a.counters()["active_learners"] == 2
        finally:
            a.close()

    wait_until(learners_attached, timeout=60, what="both learners to attach")
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    assert not os.path.exists(shm_path(job))
    assert not leftovers(job)
    assert list((tmp_path / "ck").glob("ckpt-*.safetensors")), "a last checkpoint at the stop"


def test_psd_run_stops_on_sigterms_raised_inside_its_stop_flags_wait(job, tmp_path):
    """`psd run` with SIGTERM raised at every line its main thread runs inside its stop flag's wait (the
    supervision loop's, between checks of the learners): the handler runs wherever the wait may hold a lock,
    and `psd run` still stops everything it started (exit 130, the arena removed, no process left). The
    control puts ``threading.Event`` back as the flag: its ``set()`` in the handler blocks on the lock the
    interrupted wait holds (the hang in ``__enter__``, under the handler, from faulthandler's stack)."""

    args = ["run", "--job", job, "--learners", "1", "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable,
            "-c", "pass"]
    rc, out = signalled_in_wait(tmp_path / "run.log", "90", *args, timeout=180)
    assert rc == 130, out
    assert not os.path.exists(shm_path(job))
    assert not leftovers(job)
    rc, out = signalled_in_wait(tmp_path / "run-event.log", "--event", "5", *args, timeout=180)
    # the hung launcher's watchdog and server live on: clear them as a user would
    subprocess.run([sys.executable, "-m", "psd.cli", "stop", "--job", job], capture_output=True, timeout=90,
                   env=child_env())
    assert rc == 1 and "Timeout" in out, out
    assert "in __enter__" in out and "launcher.py" in out and "in <lambda>" in out, out


def test_learner_that_keeps_failing_fails_the_job(job, tmp_path):
    run = psd_run(job, tmp_path, sys.executable, "-c", "import sys; sys.exit(3)", extra=("--max-restarts", "1"))
    _, err = run.communicate(timeout=120)
    assert run.returncode == 3, err
    assert "giving up on rank 0" in err and "giving up on rank 1" in err
    assert not os.path.exists(shm_path(job))
    assert not leftovers(job)


CRASH_AT_30 = (
    "import os, sys, torch\nfrom psd import learner\n"
    "rank = int(os.environ['PSD_RANK'])\n"
    "m = torch.nn.Linear(4, 2)\n"
    "with learner.attach(m) as ps:\n"
    "    start = ps.resume_step if sys.argv[1] == 'resume' else 0\n"
    "    for step in range(start, 60):\n"
    "        if rank == 1 and step == 30:\n"
    "            ps.flush()\n"
    "            os._exit(7)  # the same bad batch in every life\n"
    "        m(torch.ones(2, 4)).sum().backward()\n"
    "        ps.step()\n"
    "    ps.flush()\n"
)


@pytest.mark.parametrize("mode", ["replay", "resume"])
def test_a_learner_failing_at_the_same_batch_is_given_up_and_the_others_finish(job, tmp_path, mode):
    """Rank 1 dies at its batch 30 in every life. Replaying its data (each life applies batches 0-29 again) or
    resuming (each life applies nothing new), no life gets further than the first: after --max-restarts such
    lives psd run gives up on rank 1 by name, rank 0 trains to its end, and the exit status is non-zero."""
    script = tmp_path / "crash30.py"
    script.write_text(CRASH_AT_30)
    run = psd_run(job, tmp_path / "ck", sys.executable, str(script), mode, extra=("--max-restarts", "2"))
    _, err = run.communicate(timeout=180)
    assert run.returncode == 7, err
    assert "giving up on rank 1" in err and "giving up on rank 0" not in err, err
    assert err.count("learner 1 restarted") == 2, err  # two fruitless restarts allowed, the third death gives up
    assert "learner 0 finished" in err, err
    assert not leftovers(job)


def test_training_flags_reach_the_server_through_psd_run(job, tmp_path):
    """`psd run` passes --sync, --optimizer, --push-every through the watchdog to the server it starts."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom psd import learner\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(4, 2)\n"
        "with learner.attach(m) as ps:\n"  # bsp under psd run: attach waits for PSD_WORLD learners
        "    assert (ps.sync, ps.push_every) == ('bsp', 2), (ps.sync, ps.push_every)\n"
        "    assert ps._arena.training()['optimizer'] == 'adam'\n"
        "    for _ in range(20):\n"
        "        m(torch.randn(2, 4)).sum().backward()\n"
        "        ps.step()\n"
        "    ps.flush()\n"
        "    ps.pull()\n"
        "    print(f'ok clock {ps.clock}', flush=True)\n"
    )
    run = psd_run(job, tmp_path / "ck", sys.executable, str(script),
                  extra=("--sync", "bsp", "--optimizer", "adam", "--push-every", "2", "--lr", "0.01"))
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    # 2 learners x 20 mini-batches, 2 per push, one update per bsp round of 2 pushes.
    assert out.count("ok clock 10") == 2, out + err
    assert not os.path.exists(shm_path(job))


def test_learners_get_the_pull_mode_and_the_scheduling_policy_asked_for(job, tmp_path):
    """--pull view reaches every learner (PSD_PULL: its parameters are views of the shared weights);
    --learner-sched idle makes each learner process SCHED_IDLE; the job trains to its end."""
    script = tmp_path / "report.py"
    script.write_text(
        "import os, torch\nfrom psd import learner\n"
        "m = torch.nn.Linear(4, 2)\n"
        "with learner.attach(m) as ps:\n"
        "    for _ in range(20):\n"
        "        m(torch.randn(2, 4)).sum().backward()\n"
        "        ps.step()\n"
        # One write per line: both learners share the stdout pipe, and print() writes its parts apart.
        "    os.write(1, f'policy {os.sched_getscheduler(0)} pull {ps.pull_mode}\\n'.encode())\n"
    )
    run = psd_run(job, tmp_path / "ck", sys.executable, str(script),
                  extra=("--pull", "view", "--learner-sched", "idle"))
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert out.splitlines().count(f"policy {os.SCHED_IDLE} pull view") == 2, out
    assert not os.path.exists(shm_path(job))


def test_auto_scheduling_batches_learners_only_when_they_fill_the_cores():
    from psd.watchdog.launcher import learner_sched_policy

    assert learner_sched_policy("auto", 1, cpus=2) == os.SCHED_OTHER
    assert learner_sched_policy("auto", 2, cpus=2) == os.SCHED_BATCH
    assert learner_sched_policy("auto", 8, cpus=2) == os.SCHED_BATCH
    assert learner_sched_policy("idle", 1, cpus=2) == os.SCHED_IDLE
    assert learner_sched_policy("batch", 8, cpus=2) == os.SCHED_BATCH
    assert learner_sched_policy("normal", 8, cpus=2) == os.SCHED_OTHER


def test_pull_view_with_predict_is_refused_before_anything_starts(job, tmp_path):
    run = psd_run(job, tmp_path, sys.executable, "-c", "pass",
                  extra=("--pull", "view", "--predict", "--optimizer", "momentum"))
    _, err = run.communicate(timeout=60)
    assert run.returncode != 0 and "--pull view" in err and "--predict" in err, err
    assert not os.path.exists(shm_path(job))


def test_export_after_the_job_ended_takes_its_final_checkpoint(job, tmp_path):
    """`psd run` to a clean end writes a final checkpoint; `psd export --job J` then (the arena is gone)
    exports it: every gradient is in it. A job that never ran is a clear error."""
    import torch

    script = tmp_path / "five.py"
    script.write_text(
        "import torch\nfrom psd import learner\n"
        "m = torch.nn.Module()\nm.w = torch.nn.Parameter(torch.zeros(4))\n"
        "with learner.attach(m) as ps:\n"
        "    for _ in range(5):\n"
        "        m.w.grad = torch.ones(4)\n"
        "        ps.step()\n"
    )
    run = subprocess.Popen([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "1", "--lr", "1",
                            "--", sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=child_env())
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert not os.path.exists(shm_path(job))
    out = tmp_path / "final.pt"
    r = subprocess.run([sys.executable, "-m", "psd.cli", "export", "--job", job, "--out", str(out)],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "which has ended: its newest checkpoint" in r.stdout
    assert torch.equal(torch.load(out)["w"], torch.full((4,), -5.0))
    r = subprocess.run([sys.executable, "-m", "psd.cli", "export", "--job", job + "-never", "--out", str(out)],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode != 0 and "is not running and" in r.stderr and "--checkpoint-dir" in r.stderr


FORKED = (
    "import os, sys\n"
    "preloaded = 'torch' in sys.modules  # the fork server imported it before forking\n"
    "import torch\nfrom psd import learner\n"
    "assert __name__ == '__main__' and sys.argv[1:] == ['--flag', 'x'], (__name__, sys.argv)\n"
    "m = torch.nn.Linear(4, 2)\n"
    "with learner.attach(m) as ps:\n"
    "    os.write(1, f'rank {os.environ[\"PSD_RANK\"]} life {os.environ[\"PSD_RESTARTS\"]} preloaded {preloaded} '\n"
    "             f'start {ps.resume_step}\\n'.encode())  # one write: the learners share stdout\n"
    "    for step in range(ps.resume_step, 40):\n"
    "        m(torch.ones(2, 4)).sum().backward()\n"
    "        ps.step()\n"
    "        if step == 20 and os.environ['PSD_RESTARTS'] == '0' and os.environ['PSD_RANK'] == '1':\n"
    "            ps.flush()\n"
    "            os._exit(5)\n"
    "    ps.flush()\n"
    "sys.exit(0)\n"
)


def test_fork_server_starts_and_restarts_learners_with_torch_already_imported(job, tmp_path):
    """psd run (--fork-server auto, the default, is on for `python SCRIPT`): each learner (and the restart of one
    that died) is a fork of a process that imported torch, running the script as `python SCRIPT ARGS` would
    (__main__, sys.argv, environment); exits and deaths reach psd run as they would from a process of its own,
    and nothing is lost or replayed."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "2",  # auto: on
                        "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable, str(script), "--flag", "x"],
                       capture_output=True, text=True, env=child_env(), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    lives = sorted(line for line in r.stdout.splitlines() if line.startswith("rank "))
    assert lives == ["rank 0 life 0 preloaded True start 0", "rank 1 life 0 preloaded True start 0",
                     "rank 1 life 1 preloaded True start 21"], r.stdout
    assert "learner 1 restarted" in r.stderr and "by the fork server" in r.stderr
    from psd.watchdog import checkpoint

    assert checkpoint.latest(tmp_path / "ck").ranks[:2] == [40, 40]
    assert not leftovers(job)


def test_fork_server_refuses_a_command_it_cannot_fork(job, tmp_path):
    r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "1", "--fork-server",
                        "on", "--checkpoint-dir", str(tmp_path), "--", "/bin/true"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode != 0 and "COMMAND must be `python SCRIPT ...`" in r.stderr, r.stderr


OWN_MODEL = (
    "import os, sys, time, torch\nfrom psd import learner\n"
    "m = torch.nn.Linear(8, 8, bias=False)\ntorch.nn.init.constant_(m.weight, 7.0)\n"
    "with learner.attach(m) as ps:\n"
    "    ps.pull()\n"
    "    print('weights sum', float(m.weight.detach().sum()), flush=True)\n"
    "    while len(sys.argv) > 1 and not os.path.exists(sys.argv[1]):  # the test's go-ahead\n"
    "        time.sleep(0.05)\n"
    "    for _ in range(3):\n"
    "        m.weight.grad = torch.ones(8, 8)\n"
    "        ps.step()\n"
)


def _loading(job: str) -> dict | None:
    """The arena's header while a server loads the job's weights into it (with its watchdog known)."""
    from conftest import arena_header
    from psd.arena import WEIGHTLESS

    if not os.path.exists(shm_path(job)):
        return None
    h = arena_header(job)
    return h if h["state"] in WEIGHTLESS and h["server_pid"] and h["watchdog_pid"] else None


@pytest.mark.parametrize("source", ["init", "init-after-an-earlier-run", "resume"])
def test_a_watchdog_killed_with_its_server_loading_the_first_weights_loads_them_again(job, tmp_path, monkeypatch,
                                                                                      source):
    """`psd run --init F` (or `--resume DIR` with the job's own checkpoints elsewhere, `--checkpoint-dir`): the
    watchdog and its server are killed while the server loads those weights (a large file takes seconds). The
    launcher's next watchdog was given --resume of its own checkpoint directory and not --init or DIR, and with
    no checkpoint there yet its server took the weightless arena over: the learner's own model became the
    job's. Until the job held a model, every watchdog the launcher starts gets --init F (and --resume DIR until
    the job wrote a checkpoint of its own; without --resume, none: an earlier run's checkpoint in the job's
    directory won over F). The next server unlinks the weightless arena and makes a new one;
    the learner, waiting for READY on the old one, follows (it waited out its 60 s attach timeout)."""
    import torch
    from safetensors.torch import save_file

    from psd.watchdog import checkpoint

    if source.startswith("init"):
        save_file({"weight": torch.full((8, 8), 5.0)}, str(tmp_path / "init.safetensors"))
        flags = ["--init", str(tmp_path / "init.safetensors")]
        if source == "init-after-an-earlier-run":  # its checkpoint in the job's directory must not win over F
            checkpoint.write(checkpoint.Checkpoint({"weight": torch.full((8, 8), 9.0)},
                                                   [checkpoint.ParamSpec("weight", (8, 8))], clock=77, generation=1,
                                                   ranks=[0], job=job, created_unix_ns=1), tmp_path / "ck")
    else:
        checkpoint.write(checkpoint.Checkpoint({"weight": torch.full((8, 8), 5.0)},
                                               [checkpoint.ParamSpec("weight", (8, 8))], clock=7, generation=1,
                                               ranks=[0], job=job, created_unix_ns=1), tmp_path / "earlier")
        flags = ["--resume", str(tmp_path / "earlier")]
    (tmp_path / "own.py").write_text(OWN_MODEL)
    monkeypatch.setenv("PSD_TEST_SLOW_LOAD", "3")  # each server's copy of the weights takes 3 s
    run = subprocess.Popen([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "1", *flags,
                            "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable, str(tmp_path / "own.py")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    with killed_at_exit(run):
        h = wait_until(lambda: _loading(job), timeout=60, what="the server to load the weights")
        os.kill(h["watchdog_pid"], signal.SIGKILL)
        os.kill(h["server_pid"], signal.SIGKILL)
        out, err = run.communicate(timeout=180)
    assert run.returncode == 0, err
    assert "weights sum 320.0" in out, out + err  # 64 x 5.0, the job's first weights; the learner's own: 448
    assert "restarted" not in err and "did not become ready" not in err, err


def test_a_watchdog_restarted_before_the_job_held_its_model_resumes_from_what_the_job_was_started_from(tmp_path):
    """`psd run --resume A --checkpoint-dir B`, B holding another run's checkpoint: a watchdog restarted before the
    job held its model (its server loading A) is given A, not B's newest (which the next server would have loaded
    as the job's); once the job held its model and before it wrote a checkpoint, the one its weights came from, A's."""
    import torch

    from psd.server import ServeConfig
    from psd.watchdog import checkpoint
    from psd.watchdog.launcher import Launcher
    from psd.watchdog.supervisor import WatchdogConfig

    def write(d: str, w: float, made: int, lineage: int) -> None:
        checkpoint.write(checkpoint.Checkpoint({"w": torch.full((4,), w)}, [checkpoint.ParamSpec("w", (4,))], clock=1,
                                               generation=1, ranks=[0], job="j", created_unix_ns=made,
                                               lineage=lineage), tmp_path / d)

    write("A", 1.0, 1, 111)  # what the job is started from
    write("B", 9.0, 2, 222)  # another run's, newer
    launcher = Launcher(WatchdogConfig(ServeConfig(job="nojob", learners=1, resume=str(tmp_path / "A")),
                                       tmp_path / "B"), [sys.executable, "-c", "pass"], fork_server="off")
    launcher.watchdog_restarts = 1
    argv = launcher._watchdog_argv()
    assert argv[argv.index("--resume") + 1] == str(tmp_path / "A")
    # As _note_model reads them from the READY arena: a lineage of the job's own (it wrote no checkpoint yet), and A's
    # checkpoint as its weights' origin
    launcher._had_model, launcher._lineage, launcher._origin = True, 555, (1, 1)
    argv = launcher._watchdog_argv()
    assert argv[argv.index("--resume") + 1] == str(checkpoint.list_checkpoints(tmp_path / "A")[0])


def test_a_watchdog_restarted_after_the_job_held_its_model_does_not_read_init_again(job, tmp_path):
    """`psd run --init F`, the job running: F is gone (a temporary file, a moved dataset), and the watchdog and its
    server are killed. The next watchdog must take the arena over: it was given --init F too, and every server
    it started failed reading F while the launcher restarted watchdogs without end."""
    import torch
    from safetensors.torch import save_file

    from conftest import arena_header, header_if_any, read_line
    from psd import _native
    from psd.watchdog import checkpoint

    init = tmp_path / "init.safetensors"
    save_file({"weight": torch.full((8, 8), 5.0)}, str(init))
    (tmp_path / "own.py").write_text(OWN_MODEL)
    go = tmp_path / "go"
    run = subprocess.Popen([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "1", "--lr", "1",
                            "--init", str(init), "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable,
                            str(tmp_path / "own.py"), str(go)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    with killed_at_exit(run):
        assert read_line(run, timeout=60) == "weights sum 320.0"  # attached; it waits for the go-ahead
        assert arena_header(job)["state"] == _native.ARENA_READY
        init.unlink()
        h = arena_header(job)
        os.kill(h["watchdog_pid"], signal.SIGKILL)
        os.kill(h["server_pid"], signal.SIGKILL)
        wait_until(lambda: (now := header_if_any(job)) and now["server_pid"] not in (0, h["server_pid"])
                   and now["generation"] > h["generation"], timeout=60, what="a new server on the job's arena")
        go.touch()
        _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert "no such file" not in err, err
    last = checkpoint.latest(tmp_path / "ck")
    assert last is not None and last.clock == 3 and torch.equal(last.weights["weight"], torch.full((8, 8), 2.0))


def test_an_arena_lost_with_its_watchdog_and_no_checkpoint_stops_the_run_instead_of_starting_it_empty(job,
                                                                                                      tmp_path):
    """The job holds its model (a learner's), no checkpoint yet; its watchdog and server are killed and the arena
    is gone. The launcher's next watchdog, given --resume of an empty directory, started an empty job, and the next
    learner's model would have become the job's. `psd run` stops with the watchdog's own verdict instead."""
    from conftest import arena_header, read_line
    from psd import _native

    (tmp_path / "own.py").write_text(OWN_MODEL)
    run = subprocess.Popen([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "1", "--lr", "1",
                            "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "0", "--",
                            sys.executable, str(tmp_path / "own.py"), str(tmp_path / "go")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    with killed_at_exit(run):
        assert read_line(run, timeout=60) == "weights sum 448.0"  # its own model (64 x 7): the job's; it waits
        h = arena_header(job)
        assert h["state"] == _native.ARENA_READY
        os.kill(h["watchdog_pid"], signal.SIGKILL)
        os.kill(h["server_pid"], signal.SIGKILL)
        os.unlink(shm_path(job))
        _, err = run.communicate(timeout=60)  # before: a new, empty job, and the learner waiting on
    assert run.returncode == 1, err
    assert "the trained weights are gone" in err and "no valid checkpoint" in err, err
    assert not os.path.exists(shm_path(job)), "no empty job was started"


def test_a_job_whose_server_cannot_take_its_arena_over_fails_at_once_and_keeps_the_arena(job, tmp_path):
    """A dead server left the job's arena, made for 2 learners; `psd run --learners 1` cannot take it over (its
    server says to start with --learners 2). The start fails with that, promptly, and the arena stays for the
    server the error asks for (psd run restarted the watchdog without end, deaf to SIGTERM, and removed it)."""
    import time

    from conftest import Served

    s = Served(job, "--learners", "2", "--no-watchdog")
    s.proc.kill()
    s.proc.wait()
    assert os.path.exists(shm_path(job))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "1", "--checkpoint-dir",
                        str(tmp_path / "ck"), "--", sys.executable, "-c", "pass"],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode != 0 and "--learners 2" in r.stderr and "could not start" in r.stderr, r.stderr
    assert r.stderr.count("restarting it") == 0, r.stderr
    assert time.monotonic() - t0 < 60
    assert os.path.exists(shm_path(job)), "the arena left for its recovery was removed"
    r = subprocess.run([sys.executable, "-m", "psd.cli", "clean", "--job", job], capture_output=True, text=True,
                       env=child_env(), timeout=60)
    assert r.returncode == 0, r.stderr


def test_psd_chaos_killing_the_watchdog_again_and_again_fails_no_healthy_job(job, tmp_path):
    """`psd chaos --target watchdog` kills the job's watchdog a dozen times, each one that had taken up its job
    (chaos reads its pid from the arena). psd run restarts each at once: its crash-loop limit (10 in a row) counts
    only watchdogs that died before they took up the job, and failed a healthy job after the tenth kill."""
    import time

    from conftest import header_if_any
    from psd import _native

    go = tmp_path / "go"
    script = tmp_path / "learn.py"
    script.write_text(
        "import os, sys, time, torch\nfrom psd import learner\nm = torch.nn.Linear(8, 8)\n"
        "with learner.attach(m) as ps:\n"
        "    while not os.path.exists(sys.argv[1]):\n"
        "        m.weight.grad = torch.ones(8, 8)\n        m.bias.grad = torch.ones(8)\n"
        "        ps.step()\n        time.sleep(0.02)  # a paced learner\n"
    )
    run = subprocess.Popen([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "1", "--lr", "0.001",
                            "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable, str(script), str(go)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    with killed_at_exit(run):
        wait_until(lambda: (h := header_if_any(job)) and h["state"] == _native.ARENA_READY and h["clock"] > 5,
                   timeout=90, what="training")
        t0 = time.monotonic()
        ch = subprocess.run([sys.executable, "-m", "psd.cli", "chaos", "--job", job, "--target", "watchdog",
                             "--count", "12", "--every", "0.7", "--seed", "1"], capture_output=True, text=True,
                            env=child_env(), timeout=120)
        assert ch.returncode == 0, ch.stderr
        go.touch()
        _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert err.count("died (SIGKILL); restarting it") >= 11, err
    assert "times in a row" not in err
    assert time.monotonic() - t0 < 100
