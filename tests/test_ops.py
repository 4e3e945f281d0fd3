"""Operating psd as a user does, from the command line: status, top, metrics, events, doctor,
stop, checkpoint, export, inspect; against live, hung and dead jobs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch

from conftest import Served, arena_header, child_env, finish, read_line, spawn, strict_json, wait_until
from psd import _native
from psd.arena import shm_path
from psd.watchdog import checkpoint


def psd(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "psd.cli", *args], capture_output=True, text=True, env=child_env(),
                       timeout=120)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def busy_job(job, serve, tmp_path):
    """A job with one learner pushing steadily, and its server process."""
    s = serve(job, "--learners", "2", "--lr", "1", "--checkpoint-dir", str(tmp_path / "ck"),
              "--event-log", str(tmp_path / "events.jsonl"), "--metrics-port", str(port := free_port()))
    p = spawn("pusher.py", job, "--forever", "--index", "3", "--ready-after", "100")
    assert read_line(p) == "ready"
    yield s, p, port
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.fixture(scope="class")
def live_job(tmp_path_factory):
    """TestALiveJob's job, once per class: (job, metrics port, checkpoint dir); at the end its server must
    stop cleanly and leave nothing in /dev/shm."""
    job, tmp = f"test-{os.getpid()}-live", tmp_path_factory.mktemp("live")
    s = Served(job, "--learners", "2", "--lr", "1", "--checkpoint-dir", str(tmp / "ck"),
               "--event-log", str(tmp / "events.jsonl"), "--metrics-port", str(port := free_port()))
    p = spawn("pusher.py", job, "--forever", "--index", "3", "--ready-after", "100")
    try:
        assert read_line(p) == "ready"
        yield job, port, tmp / "ck"
    finally:
        p.kill()
        p.wait()
        s.stop()


class TestALiveJob:
    """busy_job, once for the tests that only read a live job (status, top, metrics, checkpoint, export,
    inspect: none stops or harms it). A class, so that the job (and its learner, pushing as fast as it can)
    stops after these tests, not after the module's last."""

    def test_status_of_a_live_job(self, live_job):
        job, _, _ = live_job
        st = strict_json(psd("status", "--job", job, "--json").stdout)
        assert st["server_alive"] and st["watchdog_alive"] and st["state"] == "ready"
        assert st["learners"][0]["last_loss"] is None  # the pusher reports no loss: null, never NaN
        assert st["applied_per_s"] > 0 and st["model_traffic_gbs"] > 0
        assert st["learners"][0]["alive"] and st["learners"][0]["pushed"] >= 100
        assert sum(st["staleness_hist"].values()) <= st["applied"]
        everything = strict_json(psd("status", "--json").stdout)
        assert job in [j["job"] for j in everything]
        text = psd("status", "--job", job).stdout
        assert f"job {job}: ready" in text and "grad/s" in text and "staleness" in text

    def test_top_refreshes(self, live_job):
        job, _, _ = live_job
        out = psd("top", "--job", job, "--iterations", "2", "--interval", "0.2").stdout
        assert out.count(f"job {job}: ready") == 2

    def test_metrics_match_the_arena(self, live_job):
        job, port, _ = live_job
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
                  if line.startswith("psd_") and "{" in line}
        assert values[f'psd_server_up{{job="{job}"}}'] == 1
        assert values[f'psd_gradients_applied_total{{job="{job}"}}'] >= 100
        assert f'psd_staleness_bucket{{job="{job}",le="+Inf"}}' in body
        assert "psd_learner_queue_depth" in body

    def test_checkpoint_export_inspect(self, live_job, tmp_path):
        job, _, ck = live_job
        before = set(checkpoint.list_checkpoints(ck))
        assert "written by its watchdog" in psd("checkpoint", "--job", job).stdout
        files = checkpoint.list_checkpoints(ck)
        assert set(files) - before, "a new checkpoint"
        psd("export", "--job", job, "--out", str(tmp_path / "live.pt"))
        psd("export", "--checkpoint", str(files[0]), "--out", str(tmp_path / "ck.pt"))
        for f in ("live.pt", "ck.pt"):
            state = torch.load(tmp_path / f)
            assert set(state) == {"w", "b"} and state["w"][3] < 0
        info = strict_json(psd("inspect", "--job", job, "--json").stdout)
        assert info["header"]["layout_version"] == _native.LAYOUT_VERSION and len(info["slots"]) == 2
        assert "layout_version" in psd("inspect", "--job", job).stdout
        broken = tmp_path / "broken.safetensors"
        broken.write_bytes(files[0].read_bytes()[:100])
        r = psd("export", "--checkpoint", str(broken), "--out", str(tmp_path / "x.pt"), check=False)
        assert r.returncode == 1 and "unreadable" in r.stderr


def test_status_and_stop_of_a_hung_job(busy_job, job):
    s, p, _ = busy_job
    server = arena_header(job)["server_pid"]
    os.kill(server, signal.SIGSTOP)
    try:
        wait_until(lambda: arena_header(job)["heartbeat_age_s"] > 0.5, what="the heartbeat to go stale")
        assert "no heartbeat for" in psd("status", "--job", job, "--sample", "0").stdout
    finally:
        os.kill(server, signal.SIGCONT)
    p.kill()
    p.wait()
    out = psd("stop", "--job", job).stdout
    assert "stopped" in out and not os.path.exists(shm_path(job))
    assert s.proc.wait(timeout=30) == 0


def test_events_are_logged(busy_job, job, tmp_path):
    s, p, _ = busy_job
    log = tmp_path / "events.jsonl"
    # The server notices an attach at its next poll (every 0.1 s): wait for it before killing anything.
    wait_until(lambda: log.exists() and "learner_attached" in log.read_text(), what="the attach to be logged")
    s.proc.send_signal(signal.SIGUSR1)
    os.kill(arena_header(job)["server_pid"], signal.SIGKILL)
    p.kill()
    p.wait()
    wait_until(lambda: arena_header(job)["reclaimed"] == 1, what="the learner's death to be handled")
    s.stop()
    kinds = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    for kind in ("server_started", "model_admitted", "learner_attached", "server_restart", "learner_died",
                 "checkpoint", "server_stopped"):
        assert kind in kinds, (kind, kinds)


def test_checkpoint_and_stop_without_a_watchdog(job, tmp_path):
    s = Served(job, "--learners", "1", "--lr", "1", "--no-watchdog")
    finish(spawn("pusher.py", job, "--count", "50"))
    out = psd("checkpoint", "--job", job, "--checkpoint-dir", str(tmp_path)).stdout
    assert "no live watchdog; wrote" in out
    assert checkpoint.load(checkpoint.list_checkpoints(tmp_path)[0]).clock == 50
    # Without a watchdog, --keep says how many to keep (it kept 3 whatever the job's own --keep).
    psd("checkpoint", "--job", job, "--checkpoint-dir", str(tmp_path), "--keep", "1")
    assert len(checkpoint.list_checkpoints(tmp_path)) == 1
    s.proc.send_signal(signal.SIGKILL)  # now the job is dead: stop just removes what is left
    s.proc.wait()
    assert "was already dead; removed" in psd("stop", "--job", job).stdout
    assert not os.path.exists(shm_path(job))


def test_doctor(tmp_path):
    r = psd("doctor")
    assert "[  ok] robust mutex self-test" in r.stdout and "[  ok] OpenMP self-test" in r.stdout
    assert "[  ok] learner liveness: /proc (pid + start time)" in r.stdout  # and the lease for the rest
    r = psd("doctor", "--learners", "64", "--params", str(1 << 34), "--json", check=False)
    assert r.returncode == 1
    checks = {c["name"]: c for c in strict_json(r.stdout)}
    shm = checks["shared memory"]
    assert shm["status"] == "fail" and "shm-size" in shm["fix"]
    huge = checks["huge pages for the arena"]
    mounted = [line.split()[3] for line in open("/proc/mounts") if line.split()[1] == "/dev/shm"]
    if mounted and not any(o in mounted[0].split(",") for o in ("huge=always", "huge=within_size")):
        assert huge["status"] == "warn" and "huge=within_size" in huge["fix"]
    else:
        assert huge["status"] == "ok"


def test_psd_run_sets_learner_threads_and_progress_does_not_flood(job, tmp_path):
    script = tmp_path / "threads.py"
    script.write_text("import torch\nfrom psd import learner\nm = torch.nn.Linear(2, 2)\n"
                      "with learner.attach(m) as ps:\n    ps.step()\n    print(f'threads {torch.get_num_threads()}')\n")
    r = subprocess.run([sys.executable, "-m", "psd.cli", "run", "--job", job, "--learners", "2",
                        "--learner-threads", "1", "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable,
                        str(script)], capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("threads 1") == 2
    progress = [line for line in r.stderr.splitlines() if line.startswith(f"psd run {job}:")]
    assert 1 <= len(progress) <= 3  # not a terminal: a line every 10 s, and the last one


def test_every_command_on_a_dead_job(job, tmp_path):
    """The server died and nothing restarted it: the arena still tells everything, and the weights are saved."""
    s = Served(job, "--learners", "1", "--lr", "1", "--no-watchdog")
    finish(spawn("pusher.py", job, "--count", "40", "--index", "5"))
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait()
    st = json.loads(psd("status", "--job", job, "--json", "--sample", "0").stdout)
    assert not st["server_alive"] and st["applied"] == 40
    assert "(DEAD)" in psd("status", "--job", job, "--sample", "0").stdout
    assert "(DEAD)" in psd("top", "--job", job, "--iterations", "1").stdout
    assert json.loads(psd("inspect", "--job", job, "--json").stdout)["header"]["clock"] == 40
    psd("export", "--job", job, "--out", str(tmp_path / "salvaged.pt"))
    assert torch.load(tmp_path / "salvaged.pt")["w"][5] == -40.0
    assert "no live watchdog; wrote" in psd("checkpoint", "--job", job, "--checkpoint-dir", str(tmp_path)).stdout
    assert checkpoint.load(checkpoint.list_checkpoints(tmp_path)[0]).clock == 40
    assert "was already dead; removed" in psd("stop", "--job", job).stdout
    assert not os.path.exists(shm_path(job))


def test_checkpoint_of_a_hung_job(busy_job, job, tmp_path):
    """A hung server cannot pause for a snapshot; the checkpoint is taken all the same."""
    _, p, _ = busy_job
    p.kill()
    p.wait()
    server = arena_header(job)["server_pid"]
    os.kill(server, signal.SIGSTOP)
    try:
        assert "written by its watchdog" in psd("checkpoint", "--job", job).stdout
    finally:
        os.kill(server, signal.SIGCONT)
    c = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "ck")[0])
    # Consistent up to the one gradient the hung loop may be stuck inside.
    assert -c.clock - 1 <= c.weights["w"][3] <= -c.clock
