"""The watchdog's restart limit and back-off, with real servers that crash after every start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import arena_header, child_env, read_line, spawn, wait_until
from psd import _native
from psd.arena import ARENA_LOST_EXIT, shm_path
from psd.errors import Error
from psd.server import ServeConfig
from psd.watchdog import checkpoint
from psd.watchdog.supervisor import GIVE_UP_EXIT, ServerState, Watchdog, WatchdogConfig


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


@pytest.mark.timeout(120)
def test_a_truncated_arena_is_a_clear_error_and_the_job_resumes_from_its_checkpoint(job, serve, tmp_path):
    """Truncating /dev/shm/psd.<job> under a running job: the server and the learners die of SIGBUS with a
    message and exit status ARENA_LOST_EXIT (no core dump), the watchdog restarts the server from the
    last checkpoint, and the job goes on."""
    s = serve(job, "--learners", "1", "--lr", "1", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0")
    procs = [spawn("pusher.py", job, "--forever", "--ready-after", "50")]
    for p in procs:
        assert read_line(p) == "ready"
    s.proc.send_signal(signal.SIGUSR1)
    ckpt = wait_until(lambda: checkpoint.list_checkpoints(tmp_path), timeout=60, what="a checkpoint")[0]
    clock = checkpoint.load(ckpt).clock
    old = arena_header(job)
    os.truncate(shm_path(job), 4096)  # what another program writing to /dev/shm might do
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == ARENA_LOST_EXIT, f"learner exited {p.returncode}:\n{err}"
        assert "psd: SIGBUS at address 0x" in err and f"/dev/shm/psd.{job}" in err and "truncated" in err
    wait_until(lambda: _native.proc_start_time(old["server_pid"]) == 0, timeout=30, what="the old server to die")

    def back() -> bool:
        try:
            h = arena_header(job)
        except Error:
            return False
        return h["server_pid"] != old["server_pid"] and h["state"] == _native.ARENA_READY

    wait_until(back, timeout=60, what="the server to come back from the checkpoint")
    assert arena_header(job)["clock"] == clock
    log = s.stop()
    assert f"died of SIGBUS (exit status {ARENA_LOST_EXIT})" in log
    assert "psd: SIGBUS at address" in log  # the server's own message
    assert f"resuming from {ckpt}" in log


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
