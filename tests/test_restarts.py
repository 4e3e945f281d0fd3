"""The watchdog's restart limit and back-off, with real servers that crash after every start; a job whose
arena file is truncated under it (SIGBUS) comes back from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import arena_header, child_env, finish, killed_at_exit, read_line, wait_until
from psd import _native
from psd.arena import ARENA_LOST_EXIT, shm_path
from psd.server import ServeConfig
from psd.watchdog import checkpoint
from psd.watchdog.supervisor import GIVE_UP_EXIT, ServerState, Watchdog, WatchdogConfig


@pytest.mark.timeout(90)
def test_a_server_that_crashes_with_a_learner_pushing_is_still_a_crash_loop(job, tmp_path):
    """A server that exits with an error 2 s after every start (PSD_TEST_CRASH_AFTER) while a learner pushes: each
    life applies gradients (what the rings hold, and the learner's), yet it is a crash loop, counted and given up
    on. Only a server killed by a signal after it applied gradients is forgiven (the test above)."""
    from psd.signals import SignalFlag

    events = tmp_path / "events.jsonl"
    cfg = WatchdogConfig(ServeConfig(job=job, learners=1, lr=1.0, event_log=str(events)), tmp_path / "ck",
                         checkpoint_every=0, max_restarts=2, backoff_base=0.1,
                         extra_env={"PSD_TEST_CRASH_AFTER": "2", "OMP_NUM_THREADS": "1"})
    wd = Watchdog(cfg)
    stop = SignalFlag()
    wd.start()
    supervisor = threading.Thread(target=wd.run, args=(stop,), name="test-watchdog")
    supervisor.start()
    honest = subprocess.Popen([sys.executable, str(Path(__file__).parent / "helpers" / "honest.py"), job, "0",
                               str(10**9)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env())
    try:
        with killed_at_exit(honest):
            assert read_line(honest, 60) == "ready"
            honest.stdin.write("go\n")
            honest.stdin.flush()
            wait_until(lambda: wd.state == ServerState.FAILED, timeout=60, what="the watchdog giving up")
            assert arena_header(job)["clock"] > 0, "no life applied anything: the test checks less than it says"
    finally:
        stop.set()
        supervisor.join(timeout=60)
        wd.stop()
    assert wd.restarts == 2 and wd.exit_code == GIVE_UP_EXIT
    restarts = [json.loads(line) for line in events.read_text().splitlines()]
    restarts = [r for r in restarts if r["event"] == "server_restart"]
    assert [r["counted"] for r in restarts] == [1, 2] and all("exited with 3" in r["reason"] for r in restarts)
    os.unlink(shm_path(job))


@pytest.mark.timeout(90)
def test_a_server_that_crashes_after_every_start_is_given_up_on(job, tmp_path, caplog):
    """Each server runs (beats), then exits 3 (PSD_TEST_CRASH_AFTER): the watchdog restarts it max_restarts
    times with growing waits, then stops with the last error and leaves the arena for `psd inspect`."""
    events = tmp_path / "events.jsonl"
    cfg = WatchdogConfig(ServeConfig(job=job, learners=1, event_log=str(events)), tmp_path / "ck",
                         checkpoint_every=0, max_restarts=3, backoff_base=1.0,
                         extra_env={"PSD_TEST_CRASH_AFTER": "1", "OMP_NUM_THREADS": "1"})
    wd = Watchdog(cfg)
    try:
        wd.start()
        deadline = time.monotonic() + 60
        while wd.state != ServerState.FAILED:
            assert time.monotonic() < deadline, f"the watchdog never gave up (state {wd.state})"
            wd.poll()
            time.sleep(0.05)
    finally:
        wd.stop()
    assert wd.restarts == 3 and wd.backoffs == [0.0, 1.0, 2.0]
    assert wd.exit_code == GIVE_UP_EXIT
    records = [json.loads(line) for line in events.read_text().splitlines()]
    restarts = [r for r in records if r["event"] == "server_restart"]
    starts = [r for r in records if r["event"] == "server_started"]
    assert len(starts) == 4 and len(restarts) == 3
    # Each new server started no sooner than its back-off after the watchdog saw the last one die.
    gaps = [s["ts"] - r["ts"] for r, s in zip(restarts, starts[1:], strict=True)]
    for gap, wait in zip(gaps, wd.backoffs, strict=True):
        assert gap >= wait, (gaps, wd.backoffs)
    gave_up = [r for r in caplog.messages if "giving up" in r]
    assert gave_up and "exited with 3" in gave_up[0] and "crashed on purpose" in gave_up[0]
    assert "psd inspect" in gave_up[0]
    # The arena is still there, and psd inspect reads it.
    assert os.path.exists(shm_path(job))
    r = subprocess.run([sys.executable, "-m", "psd.cli", "inspect", "--job", job, "--json"], capture_output=True,
                       text=True, env=child_env(), timeout=60)
    os.unlink(shm_path(job))
    assert r.returncode == 0, r.stderr
    assert "crashed on purpose" in json.loads(r.stdout)["header"]["fail_msg"]


KILLS_PAST_THE_LIMIT = 12  # the watchdog's default --server-restarts is 10


@pytest.mark.timeout(120)
def test_a_server_killed_past_its_restart_limit_while_it_trains_is_restarted_at_once_every_time(job, serve, tmp_path):
    """A server killed from outside (an OOM kill, a preemption, psd chaos) that applied gradients in its life is no
    crash loop: at default flags the watchdog restarts it at once every time, past --server-restarts, and the
    learner's gradients are all applied. (It used to count every restart until 300 s of healthy running forgave
    one: at a kill a minute the back-off grew to 10 s and the 11th kill stopped the job.)"""
    events = tmp_path / "events.jsonl"
    served = serve(job, "--learners", "1", "--lr", "1", "--event-log", str(events))
    honest = subprocess.Popen([sys.executable, str(Path(__file__).parent / "helpers" / "honest.py"), job, "0",
                               str(10**9)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env())
    with killed_at_exit(honest):
        assert read_line(honest, 60) == "ready"
        honest.stdin.write("go\n")
        honest.stdin.flush()
        for k in range(KILLS_PAST_THE_LIMIT):
            h = arena_header(job)
            due = h["applied"] + 20  # this server's life applies gradients before it dies
            wait_until(lambda d=due: arena_header(job)["applied"] >= d, timeout=30, what=f"updates before kill {k + 1}")
            h = arena_header(job)
            os.kill(h["server_pid"], signal.SIGKILL)
            wait_until(lambda g=h["generation"]: (lambda x: x["generation"] == g + 1 and x["state"] == 4)(
                arena_header(job)), timeout=30, what=f"the watchdog's server after kill {k + 1}")
        honest.stdin.write("stop\n")
        honest.stdin.flush()
        done = read_line(honest, 60).split()
        assert honest.wait(timeout=60) == 0
    assert done[0] == "done" and int(done[1]) <= int(done[2]) <= int(done[1]) + KILLS_PAST_THE_LIMIT, done
    assert served.proc.poll() is None, "the watchdog gave up"
    restarts = [json.loads(line) for line in events.read_text().splitlines()]
    restarts = [r for r in restarts if r["event"] == "server_restart"]
    assert len(restarts) == KILLS_PAST_THE_LIMIT
    assert [r["backoff_s"] for r in restarts] == [0.0] * KILLS_PAST_THE_LIMIT
    assert [r["counted"] for r in restarts] == [0] * KILLS_PAST_THE_LIMIT


@pytest.mark.timeout(120)
def test_psd_run_stops_when_its_watchdog_gives_up(job, tmp_path):
    """Under `psd run`, a watchdog that gave up is not replaced by one that would start the crash loop again:
    the job stops with the watchdog's reason, and the arena stays for `psd inspect`."""
    env = dict(child_env(), PSD_TEST_CRASH_AFTER="1")
    try:
        r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "1",
                            "--server-restarts", "1", "--checkpoint-dir", str(tmp_path), "--", "sleep", "100"],
                           capture_output=True, text=True, env=env, timeout=100)
        assert r.returncode == 1, r.stderr
        assert "giving up: the server was restarted 1 times" in r.stderr
        assert "the watchdog gave up restarting the server" in r.stderr
        assert r.stderr.count("crashed on purpose") >= 2
        assert os.path.exists(shm_path(job)), "the arena is left for psd inspect"
    finally:
        if os.path.exists(shm_path(job)):
            os.unlink(shm_path(job))


LEARNER = """
import os, torch
from psd import learner
m = torch.nn.Module()
m.w = torch.nn.Parameter(torch.zeros(4))
first_life = os.environ["PSD_RESTARTS"] == "0"
with learner.attach(m) as ps:
    end = 1 << 60 if first_life else ps.resume_step + 100  # the first life runs until the arena is lost
    for step in range(ps.resume_step, end):
        m.w.grad = torch.ones(4)
        ps.step()
        if first_life and step == 100:
            print("ready", flush=True)
"""


@pytest.mark.timeout(150)
def test_a_truncated_arena_is_a_clear_error_and_psd_run_resumes_from_its_checkpoint(job, tmp_path):
    """Truncating /dev/shm/psd.<job> under a running `psd run`: the server and the learner die of SIGBUS with
    their message and exit status ARENA_LOST_EXIT (no core dump); the watchdog restarts the server from the
    last checkpoint, `psd run` restarts the learner, the launcher and watchdog (which map the arena too) do not
    fault, and the job ends."""
    script = tmp_path / "learner.py"
    script.write_text(LEARNER)
    ck = tmp_path / "ck"
    run = subprocess.Popen([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "1", "--lr", "1",
                            "--checkpoint-dir", str(ck), "--checkpoint-every", "0", "--max-restarts", "20", "--",
                            sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=child_env())
    with killed_at_exit(run):
        assert read_line(run, timeout=90) == "ready"
        os.kill(arena_header(job)["watchdog_pid"], signal.SIGUSR1)
        clock = checkpoint.load(wait_until(lambda: checkpoint.list_checkpoints(ck), timeout=60,
                                           what="a checkpoint")[0]).clock
        os.truncate(shm_path(job), 4096)
        _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    # The server's and the learner's own messages; nobody dumped core (each exited 87, as the two lines below say).
    assert err.count("psd: SIGBUS at address 0x") >= 2 and f"in the arena /dev/shm/psd.{job}" in err
    assert f"died of SIGBUS (exit status {ARENA_LOST_EXIT})" in err  # the server, to the watchdog
    assert "SIGBUS: its arena was truncated or replaced" in err  # the learner, to the launcher
    assert "resuming from" in err
    final = checkpoint.load(checkpoint.list_checkpoints(ck)[0])
    assert final.clock >= clock + 100 and not os.path.exists(shm_path(job))


@pytest.mark.parametrize("earlier", [None, "another run's"])
def test_a_lost_arena_without_a_checkpoint_stops_the_job_instead_of_starting_it_empty(job, tmp_path, earlier):
    """Truncating a trained job's arena when no checkpoint of it exists: the watchdog must not start an empty job
    (the next learner's model would silently become the job's); it stops with a clear error and its give-up
    status, and starts nothing. A checkpoint an earlier run left in the directory is not the job's (another
    lineage): it was restored, and another job's weights, maybe of another model, became this one's."""
    import torch

    from conftest import spawn

    ck = tmp_path / "ck"
    if earlier:
        checkpoint.write(checkpoint.Checkpoint({"w": torch.full((1024,), 9.0), "b": torch.zeros(3)},
                                               [checkpoint.ParamSpec("w", (1024,)), checkpoint.ParamSpec("b", (3,))],
                                               clock=7, generation=1, ranks=[0], job=job, created_unix_ns=1), ck)
    serve = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--job", job, "--learners", "1", "--lr", "1",
                              "--checkpoint-dir", str(ck), "--checkpoint-every", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    pusher = spawn("pusher.py", job, "--forever", "--index", "3", "--ready-after", "50")
    try:
        assert read_line(pusher, timeout=60) == "ready"
        seen = []
        while "the job holds its model" not in (line := read_line(serve, timeout=60)):
            seen.append(line)
        os.truncate(shm_path(job), 8192)
        out, _ = serve.communicate(timeout=60)
    finally:
        for p in (serve, pusher):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert serve.returncode == GIVE_UP_EXIT, out
    assert "no valid checkpoint of this job" in out and "the trained weights are gone" in out, out
    assert "waiting for a model" not in out and "`psd clean`" in out
    assert len(checkpoint.list_checkpoints(ck)) == (1 if earlier else 0)  # the earlier run's stays, untouched
    subprocess.run([sys.executable, "-m", "psd.cli", "clean", "--job", job], env=child_env(), check=True,
                   capture_output=True)
    assert not os.path.exists(shm_path(job))


# -- the one restart policy (watchdog/restarts.py RestartPolicy), against each restarter's rule as it was written
# before the policy held it: the same counts, waits and give-ups for every sequence of lives.


def _lives(seed: int, n: int = 400) -> list[tuple[float, bool]]:
    """How long each life ran before it failed, and whether it made progress: short lives, long ones, edges."""
    import random

    rng = random.Random(seed)
    return [(rng.choice([0.0, 1.0, 59.9, 60.0, 60.1, 299.9, 300.0, 300.1, 1000.0]), rng.random() < 0.3)
            for _ in range(n)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_restart_policy_is_the_watchdogs_rule_for_its_server(seed):
    from psd.watchdog.restarts import Backoff, RestartPolicy

    base, cap, limit, forgive_after = 0.1, 10.0, 10, 300.0
    policy = RestartPolicy(Backoff(base, cap), limit=limit, first_step=0, forgive_after=forgive_after)
    counted, healthy_since, now, gave_up = 0, 0.0, 0.0, 0
    for ran, _ in _lives(seed):
        # the server becomes healthy and runs `ran` seconds, polled every second; each forgive_after forgives one
        policy.healthy(now)
        healthy_since = now
        for t in [now + k for k in range(1, int(ran) + 1)]:
            due = bool(counted) and t - healthy_since >= forgive_after
            if due:
                counted -= 1
                healthy_since = t
            assert policy.forgive_due(t) == due and policy.count == counted
        now += ran
        counted += 1
        assert policy.failed() == counted
        if counted > limit:  # given up on: the next watchdog starts counting afresh
            assert policy.exhausted
            gave_up += 1
            counted, policy.count = 0, 0
            continue
        assert not policy.exhausted
        assert policy.delay() == (0.0 if counted == 1 else min(cap, base * 2 ** (counted - 2)))
    assert gave_up, "the sequence never reached the limit: the test checks less than it says"


def test_the_restart_policy_forgives_one_restart_per_forgive_after_of_health():
    from psd.watchdog.restarts import Backoff, RestartPolicy

    policy = RestartPolicy(Backoff(1.0, 10.0), limit=3, first_step=0, forgive_after=300.0)
    assert [policy.failed() for _ in range(3)] == [1, 2, 3] and not policy.exhausted
    assert policy.delay() == 2.0
    assert not policy.forgive_due(1000.0), "nothing is forgiven before the server is healthy"
    policy.healthy(10.0)
    assert not policy.forgive_due(309.9) and policy.count == 3
    assert policy.forgive_due(310.0) and policy.count == 2
    assert not policy.forgive_due(609.9), "the next one needs as long again"
    assert policy.forgive_due(610.0) and policy.forgive_due(910.0) and policy.count == 0
    assert not policy.forgive_due(5000.0) and policy.count == 0
    assert [policy.failed() for _ in range(4)] == [1, 2, 3, 4] and policy.exhausted


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_restart_policy_is_the_watchdogs_rule_for_its_node_link(seed):
    from psd.watchdog.restarts import Backoff, RestartPolicy

    cap = 10.0
    policy = RestartPolicy(Backoff(0.5, cap), first_step=1, fresh_after=60.0)
    fails, started, now, most = 0, 0.0, 5.0, 0
    for ran, _ in _lives(seed):
        policy.started(now)
        started = now
        now += ran
        fails = 1 if now - started > 60 else fails + 1
        assert policy.failed(now) == fails and not policy.exhausted
        assert policy.delay() == Backoff(0.5, cap).delay(fails)
        now += policy.delay()
        most = max(most, fails)
    assert most > 3, "the sequence never made a crash loop: the test checks less than it says"


@pytest.mark.parametrize("max_restarts", [0, 1, 3])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_restart_policy_is_psd_runs_rule_for_a_learner(seed, max_restarts):
    """psd run's rule (the policy its launcher gives each learner): a life that made progress is restarted at once,
    the lives without it in a row wait 0.2 s, 0.4 s, ... (at most 10 s), and the max_restarts-th is not made."""
    from psd.watchdog.launcher import learner_restart_policy

    policy = learner_restart_policy(max_restarts)
    fruitless, gave_up, at_once = 0, 0, 0
    for _, progress in _lives(seed):
        fruitless = 0 if progress else fruitless + 1
        assert policy.failed(progress=progress) == fruitless
        assert policy.exhausted == (fruitless >= max_restarts)
        if policy.exhausted:
            gave_up += 1
            fruitless, policy.count = 0, 0
            continue
        assert policy.delay() == (0.0 if progress else min(10.0, 0.2 * 2 ** (fruitless - 1)))
        at_once += progress
    assert gave_up and (at_once or max_restarts == 0)  # --max-restarts 0: no life is restarted


def test_a_backoff_of_no_interval_tries_again_at_once_until_stopped():
    import threading

    from psd.watchdog.restarts import Backoff

    stop = threading.Event()
    tries = []
    for n in Backoff.every(0.0).tries(time.monotonic() + 60, stop):
        tries.append(n)
        if n == 4:
            stop.set()
    assert tries == [0, 1, 2, 3, 4]
    assert Backoff.every(0.0).delay(7) == 0.0


@pytest.mark.parametrize("backoff", [(0.001, 0.001), (0.0, 0.0), (0.1, 10.0), (1e-300, 5.0)])
def test_a_backoff_tried_past_float_range_keeps_its_cap(backoff):
    """A poll (``Backoff.every(0.001)``: the node link's wait for the clock) that runs past try 1,024 asks for
    ``base * 2**1024``, which no float holds: the delay must stay the cap, not raise OverflowError and kill the
    waiter (the node link died so whenever a round took more than about a second)."""
    from psd.watchdog.restarts import Backoff

    b = Backoff(*backoff)
    for n in (1024, 1025, 1100, 10**6):
        assert b.delay(n) == b.cap
    assert b.delay(1) == b.base


def _next_server(job: str, first: int, state: int) -> bool:
    """Whether another server than ``first`` runs the job's arena, in ``state``."""
    try:
        h = arena_header(job)
    except Exception:  # the damaged file, or none for a moment
        return False
    return h["server_pid"] not in (0, first) and h["state"] == state


@pytest.mark.parametrize("size", [0, 8192])
def test_a_lost_arena_of_a_job_without_a_model_yet_starts_on_a_new_one(job, serve, tmp_path, size):
    """A job still waiting for its first learner's model loses its arena (truncated): nothing in it to keep. The
    watchdog's next server starts on a new arena, and a learner then brings its model (the server, given nothing
    to restore, refused the damaged file at every restart until the watchdog gave up). Truncated to 8192 bytes, the
    header page survives and the server, touching nothing else while it waits, runs on: the watchdog sees the file
    shrunk under its mapping and restarts it at once (it left it running on the lost arena)."""
    from conftest import spawn

    s = serve(job, "--learners", "1", "--lr", "1", "--checkpoint-dir", str(tmp_path / "ck"), "--server-restarts", "3")
    # Both lines, in either order: the server waits for a model, and the watchdog has mapped its arena (it
    # says the server runs only from its own mapping; the header names the watchdog from the server's start)
    seen = {"waiting for the first learner": False, "running (": False}
    while not all(seen.values()):
        line = read_line(s.proc, timeout=60)
        seen.update({k: True for k in seen if k in line})
    assert arena_header(job)["watchdog_pid"] == s.proc.pid
    first = arena_header(job)["server_pid"]
    os.truncate(shm_path(job), size)  # at 0 the server dies of SIGBUS at its next look at the header
    wait_until(lambda: _next_server(job, first, _native.ARENA_WAITING_SPEC), timeout=20,
               what="a server on a new arena")
    assert finish(spawn("pusher.py", job, "--count", "5"), timeout=60).split()[-2:] == ["done", "5"]
    out = s.stop(signal.SIGINT)
    assert checkpoint.latest(tmp_path / "ck").clock == 5, out


TRUNCATE_IN_SNAPSHOT = """
import os, signal, sys, time
from psd.arena import HeaderView, open_job, shm_path
job, watchdog, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
a = open_job(job)  # full: this script keeps the stopped server's heartbeat fresh
h = HeaderView(a)
server = h.server_pid
# The server stopped, its heartbeat kept fresh here (as a loop inside a long update would): the watchdog's snapshot
# waits for the update loop to pause (native/pause.c: a loop that stopped beating is no wait) and its hang check
# sees a live server, so the truncation lands inside the snapshot however late this machine runs the watchdog.
os.kill(server, signal.SIGSTOP)
try:
    a.beat()
    os.kill(watchdog, signal.SIGUSR1)  # a checkpoint now
    deadline = time.monotonic() + 30
    while not h.pause_req:  # the snapshot began: it waits for the loop, then copies the weights
        if time.monotonic() > deadline:
            sys.exit("the watchdog never paused the loop for its checkpoint")
        a.beat()
        time.sleep(0.001)
    os.truncate(shm_path(job), size)
finally:
    os.kill(server, signal.SIGCONT)  # it dies of SIGBUS at its next touch of what is gone
print("truncated", flush=True)
os._exit(0)  # without touching the mapping again: it faults now
"""


@pytest.mark.parametrize("size", [0, _native.HEADER_SIZE])
def test_the_watchdog_outlives_an_arena_truncated_under_its_checkpoint(job, serve, tmp_path, size):
    """A learner truncates the arena while the watchdog copies it for a checkpoint (the header and all, or the
    weights only). The watchdog's copy faults; it must outlive that (before, it died of SIGBUS with its server,
    and nothing restarted either: the job was lost), write no checkpoint of what it could not read, and restore
    the last good checkpoint, round after round."""
    from conftest import spawn

    ck = tmp_path / "ck"
    s = serve(job, "--learners", "1", "--lr", "1", "--checkpoint-dir", str(ck), "--checkpoint-every", "0")
    watchdog = s.proc.pid
    for _ in range(3):
        pusher = spawn("pusher.py", job, "--n", "1048576", "--index", "3", "--forever", "--ready-after", "20")
        try:
            assert read_line(pusher, timeout=60) == "ready"
            clock, server = arena_header(job)["clock"], arena_header(job)["server_pid"]
            os.kill(watchdog, signal.SIGUSR1)  # a good checkpoint first, for the restore
            wait_until(lambda c=clock: (last := checkpoint.latest(ck)) is not None and last.clock >= c, timeout=30,
                       what="a checkpoint")
            r = subprocess.run([sys.executable, "-c", TRUNCATE_IN_SNAPSHOT, job, str(watchdog), str(size)],
                               capture_output=True, text=True, env=child_env(), timeout=60)
            assert r.stdout == "truncated\n", r.stderr
            wait_until(lambda first=server: _next_server(job, first, _native.ARENA_READY), timeout=60,
                       what="a server restored from the checkpoint")
        finally:
            pusher.kill()
            pusher.wait()
        assert s.proc.poll() is None, s.proc.communicate()[0]  # the watchdog lives
        last = checkpoint.latest(ck)
        assert last.clock > 0 and last.weights["w"][3] == -last.clock  # a copy of the arena, not of zeros
        assert arena_header(job)["clock"] == last.clock  # restored from it
    s.stop(signal.SIGINT)


@pytest.mark.parametrize("b", ["empty", "another run's"])
def test_a_lost_arena_is_restored_from_the_checkpoint_the_job_resumed_from(job, serve, tmp_path, b):
    """`psd serve --resume A --checkpoint-dir B`: the job resumed from A's checkpoint and trained; its arena is lost
    before it wrote one of its own into B. The watchdog restores A's, a checkpoint of the job too (it stopped the
    job: "the trained weights are gone"; and `--resume A --checkpoint-dir B` had resumed from B, empty). A
    checkpoint another run left in B is not the job's (another lineage): B's newest, it was restored instead."""
    import torch

    from conftest import spawn
    from psd import learner

    for d, w, made in [("A", 3.0, 1)] + ([("B", 9.0, 2)] if b != "empty" else []):
        checkpoint.write(checkpoint.Checkpoint({"w": torch.full((1024,), w), "b": torch.zeros(3)},
                                               [checkpoint.ParamSpec("w", (1024,)), checkpoint.ParamSpec("b", (3,))],
                                               clock=11, generation=1, ranks=[0], job=job, created_unix_ns=made),
                         tmp_path / d)
    s = serve(job, "--learners", "1", "--lr", "1", "--resume", str(tmp_path / "A"), "--checkpoint-dir",
              str(tmp_path / "B"), "--checkpoint-every", "0")
    while "the job holds its model" not in read_line(s.proc, timeout=60):
        pass
    assert arena_header(job)["clock"] == 11
    assert finish(spawn("pusher.py", job, "--count", "5"), timeout=60).split()[-2:] == ["done", "5"]
    first = arena_header(job)["server_pid"]
    os.truncate(shm_path(job), 8192)
    wait_until(lambda: _next_server(job, first, _native.ARENA_READY), timeout=60, what="the arena restored")
    assert arena_header(job)["clock"] == 11 and learner.pull_state_dict(job)["w"][0] == 3.0
    out = s.stop(signal.SIGINT)
    assert "the trained weights are gone" not in out and str(tmp_path / "A") in out, out


@pytest.mark.parametrize("renamed", [False, True])
def test_a_job_rolled_back_to_an_older_checkpoint_is_restored_from_it_not_from_the_newer_ones(job, serve, tmp_path,
                                                                                             renamed):
    """`psd serve --resume DIR/OLD` rolls a job back to an older checkpoint of its own, in its own directory, where
    newer ones of the same run stand; the arena is lost before the job writes one of its own. The watchdog restores
    OLD, the job's origin: the newer ones, of the lineage OLD was written in, are the state it rolled back from
    (restored before, as the job's newest). OLD copied elsewhere under another name (`--resume keep/best.safetensors`)
    is found by what its metadata says, not its name (the job stopped: "the trained weights are gone")."""
    import shutil

    import torch

    from psd import learner

    ck = tmp_path / "ck"

    def write(w: float, clock: int, made: int) -> Path:
        spec = [checkpoint.ParamSpec("w", (1024,)), checkpoint.ParamSpec("b", (3,))]
        return checkpoint.write(checkpoint.Checkpoint({"w": torch.full((1024,), w), "b": torch.zeros(3)}, spec,
                                                      clock=clock, generation=1, ranks=[0], job=job,
                                                      created_unix_ns=made, lineage=777), ck, keep=10)

    old = write(1.0, 5, 1)
    write(3.0, 9, 2)  # what the user rolls back from
    if renamed:
        (tmp_path / "keep").mkdir()
        old = Path(shutil.move(old, tmp_path / "keep" / "best.safetensors"))
    s = serve(job, "--learners", "1", "--lr", "1", "--resume", str(old), "--checkpoint-dir", str(ck),
              "--checkpoint-every", "0")
    while "the job holds its model" not in read_line(s.proc, timeout=60):
        pass
    assert arena_header(job)["clock"] == 5 and learner.pull_state_dict(job)["w"][0] == 1.0
    first = arena_header(job)["server_pid"]
    os.truncate(shm_path(job), 8192)
    wait_until(lambda: _next_server(job, first, _native.ARENA_READY), timeout=60, what="the arena restored")
    assert arena_header(job)["clock"] == 5 and learner.pull_state_dict(job)["w"][0] == 1.0
    s.stop(signal.SIGINT)


def test_a_watchdog_that_adopts_a_trained_job_never_starts_it_empty(job, tmp_path):
    """A watchdog started on a job whose server runs without one (`psd serve --no-watchdog`, then a watchdog to
    adopt it) and whose arena holds the trained model: the arena is lost and its server killed before the
    watchdog's first look. With no checkpoint, it must stop (the trained weights are gone), not start an empty
    job for the next learner's model (it took the job for one that never held a model)."""
    from conftest import Served, spawn

    s = Served(job, "--learners", "1", "--lr", "1", "--no-watchdog")
    assert finish(spawn("pusher.py", job, "--count", "5"), timeout=60).split()[-2:] == ["done", "5"]
    wd = Watchdog(WatchdogConfig(ServeConfig(job=job, learners=1, lr=1.0), tmp_path / "ck", checkpoint_every=0))
    try:
        wd.start()
        assert wd.state == ServerState.RUNNING and wd.server_pid == s.proc.pid  # adopted
        os.truncate(shm_path(job), 8192)
        s.proc.kill()
        s.proc.wait()
        deadline = time.monotonic() + 60
        while wd.state not in (ServerState.FAILED, ServerState.STOPPED):
            assert time.monotonic() < deadline, f"the watchdog neither restored nor stopped (state {wd.state})"
            wd.poll()
            assert not _next_server(job, s.proc.pid, _native.ARENA_WAITING_SPEC), "an empty job was started"
            time.sleep(0.05)
    finally:
        wd.stop()
        subprocess.run([sys.executable, "-m", "psd.cli", "clean", "--job", job], env=child_env(), check=True,
                       capture_output=True)
    assert wd.exit_code == GIVE_UP_EXIT


@pytest.mark.parametrize("theirs_only", [False, True])
def test_jobs_sharing_a_checkpoint_dir_resume_each_their_own(job, serve, tmp_path, theirs_only):
    """Two runs of a sweep given one --checkpoint-dir: `psd serve --resume DIR` for one of them took the directory's
    newest checkpoint, the other run's (the same model: nothing said so), `psd export --job` of an ended job
    exported the other's weights, and the other run's pruning to --keep deleted the job's own. Each now keeps and
    takes its own. A job with none of its own there (started from another job's directory, or renamed) resumes
    from the directory's newest and says whose, but not over its --init; export says whose checkpoints are there."""
    import torch
    from safetensors.torch import save_file

    from psd import learner

    ck = tmp_path / "sweep"
    spec = [checkpoint.ParamSpec("w", (1024,)), checkpoint.ParamSpec("b", (3,))]

    def write(w: float, clock: int, made: int, who: str) -> Path:
        return checkpoint.write(checkpoint.Checkpoint({"w": torch.full((1024,), w), "b": torch.zeros(3)}, spec,
                                                      clock=clock, generation=1, ranks=[0], job=who,
                                                      created_unix_ns=made, lineage=made), ck, keep=3)

    mine = None if theirs_only else write(3.0, 7, 1, job)
    for k in range(5):  # the other run writes on, pruning to its --keep 3
        write(9.0, 20 + k, 2 + k, job + "-other")
    assert len(checkpoint.list_checkpoints(ck)) == 3 + (not theirs_only) and (theirs_only or mine.exists())
    r = subprocess.run([sys.executable, "-m", "psd.cli", "export", "--job", job, "--checkpoint-dir", str(ck), "--out",
                        str(tmp_path / "m.pt")], capture_output=True, text=True, env=child_env(), timeout=120)
    if theirs_only:
        assert r.returncode == 1 and f"holds checkpoints of job '{job}-other'" in r.stderr, r.stderr
    else:
        assert r.returncode == 0 and torch.load(tmp_path / "m.pt")["w"][0] == 3.0, r.stderr
    save_file({"w": torch.full((1024,), 5.0), "b": torch.zeros(3)}, str(tmp_path / "init.safetensors"))
    for init in ([], ["--init", str(tmp_path / "init.safetensors")]) if theirs_only else ([],):
        s = serve(job, "--learners", "1", "--lr", "1", "--resume", str(ck), "--checkpoint-every", "0", *init,
                  "--checkpoint-dir", str(tmp_path / f"own{len(init)}"))  # its stop's checkpoint goes there
        lines = [read_line(s.proc, timeout=60)]
        while "the job holds its model" not in lines[-1]:
            lines.append(read_line(s.proc, timeout=60))
        want = (5.0, 0) if init else (9.0, 24) if theirs_only else (3.0, 7)
        assert (arena_header(job)["clock"], learner.pull_state_dict(job)["w"][0]) == (want[1], want[0])
        out = "".join(lines) + s.stop(signal.SIGINT)
        said = f"has no checkpoint of its own in {ck}: taking the newest there (of job '{job}-other')"
        assert (said in out) == (theirs_only and not init), out
