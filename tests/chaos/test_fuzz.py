"""The fuzzer: a learner writes random bytes over every byte it can write, and the job goes on.

Under the watchdog (the default `psd serve`), two honest learners train (processes of their own, ranks 0
and 1) while rogue learners (rank 2; PSD_FUZZ_ROGUES processes one after another, since each is soon evicted)
write random values (zeros, all-ones, huge, negative, NaN, inf,
random bytes; 1-64 bytes each) at uniformly random offsets of every range `psd inspect --json` lists as
`learner_writable` for its slot: the header's shared page and its whole learner block (request line, tail,
figures, every ring entry), no field left out. The honest learners push for as long as the fuzz runs (and
through the server's SIGKILL). Each run must show: no server restart (the one deliberate SIGKILL aside),
the heartbeat never older than the hung limit, each honest rank's gradients applied exactly once (the one
entry a SIGKILLed server was taking is taken again by its successor: at most one more), weights
that are all finite (the server takes no NaN or infinity from a ring, whatever the entry's flags say), a
rogue that was evicted refused a slot again (also by a server that took over after a SIGKILL), and SIGTERM
ending `psd serve` within 10 s leaving nothing in /dev/shm.

Seeds: PSD_FUZZ_SEEDS (default 2: seed 0, and seed 1, which also SIGKILLs the server mid-fuzz; the slow suite
runs 20: `PSD_FUZZ_SEEDS=20 PSD_FUZZ_WRITES=1500 pytest tests/chaos/test_fuzz.py`), each with momentum; and
seed 1 under kasync:2 with Adagrad (a round's sum and Adagrad's squares taken from the rings, the server
killed mid-round).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import HELPERS, arena_header, child_env, kill, read_line, wait_until
from psd import learner
from psd.arena import open_job
from psd.status import job_status

SEEDS = int(os.environ.get("PSD_FUZZ_SEEDS", "2"))
WRITES = int(os.environ.get("PSD_FUZZ_WRITES", "1000"))  # per rogue
ROGUES = int(os.environ.get("PSD_FUZZ_ROGUES", "3"))  # rogue processes, one after another, per seed
HONEST_MAX = 10**9  # the honest learners push until the fuzz ends
HUNG_S = 1.0  # PSD_HUNG_NS: the watchdog replaces a server whose heartbeat is older


def spawn(script: str, *args: str, stdin: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HELPERS / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.PIPE if stdin else None, text=True,
                            env=child_env())


def tell(proc: subprocess.Popen, line: str, timeout: float = 120.0) -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return read_line(proc, timeout)


class Watch(threading.Thread):
    """Samples the arena every 10 ms: the oldest heartbeat seen, and every server pid."""

    def __init__(self, job: str) -> None:
        super().__init__(daemon=True)
        self.job, self.stop, self.max_age, self.pids, self.paused = job, threading.Event(), 0.0, set(), False
        self.errors: list[str] = []
        self.samples = 0

    def run(self) -> None:
        while not self.stop.wait(0.01):
            try:
                a = open_job(self.job, role="reader")
                try:
                    h = a.header()
                finally:
                    a.close()
            except Exception as e:  # a server being replaced: the pids tell
                self.errors.append(repr(e))
                continue
            if h["state"] == 4 and not self.paused:  # READY
                self.max_age = max(self.max_age, h["heartbeat_age_s"])
            self.pids.add(h["server_pid"])
            self.samples += 1


# momentum: the server steers its gain level from a number each learner writes in its slot (psd/gain.py);
# kasync:2 with Adagrad: the round's sum and Adagrad's squares taken from the rings (native/update.c accumulate)
SETUPS = {"momentum": ("--optimizer", "momentum"), "kasync-adagrad": ("--optimizer", "adagrad", "--sync", "kasync:2")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed, setup", [*((s, "momentum") for s in range(SEEDS)), (1, "kasync-adagrad")])
def test_a_learner_writing_anything_anywhere_it_can_cannot_break_the_job(job, serve, tmp_path, seed, setup):
    events = tmp_path / "events.jsonl"
    served = serve(job, "--learners", "3", "--lr", "0.001", "--ring-depth", "8", *SETUPS[setup],
                   "--event-log", str(events))
    first = arena_header(job)
    honest = [spawn("honest.py", job, str(r), str(HONEST_MAX), stdin=True) for r in (0, 1)]
    rogues: list[subprocess.Popen] = []
    lives = []
    try:
        for p in honest:
            assert read_line(p, 60) == "ready"
        watch = Watch(job)
        watch.start()
        for p in honest:  # honest traffic all through the fuzz
            p.stdin.write("go\n")
            p.stdin.flush()
        for life in range(ROGUES):  # a rogue is soon evicted: the next one (a new process) fuzzes afresh
            rogue = spawn("rogue.py", job, "--rank", "2", "--pushes", "3", stdin=True)
            rogues.append(rogue)
            slot = int(read_line(rogue, 60).split()[1])
            if life == 0:
                out = subprocess.run([sys.executable, "-m", "psd.cli", "inspect", "--job", job, "--json"],
                                     capture_output=True, text=True, env=child_env(), check=True)
                ranges = json.loads(out.stdout)["slots"][slot]["learner_writable"]
                assert sum(r["length"] for r in ranges) > 4096
                assert {r["file"] for r in ranges} == {f"/dev/shm/psd.{job}"}
            answer: list[str] = []
            fuzz = threading.Thread(target=lambda a=answer, p=rogue, cmd=f"fuzz {seed * 100 + life} {WRITES}":
                                    a.append(tell(p, cmd)))
            fuzz.start()
            if seed == 1 and life == 0:  # the server killed mid-fuzz: its successor must keep what was decided
                time.sleep(0.2)  # let the fuzz start (any moment will do)
                watch.paused = True
                os.kill(first["server_pid"], signal.SIGKILL)
                wait_until(lambda: arena_header(job)["generation"] == first["generation"] + 1, timeout=30,
                           what="the watchdog's next server")
                watch.paused = False
                wait_until(lambda: len(watch.pids) == 2, what="a sample of the next server's heartbeat")
            fuzz.join(timeout=300)
            assert not fuzz.is_alive(), "the rogue's fuzz never finished"
            fuzzed = (answer or ["no answer"])[0].split()
            assert fuzzed[0] == "fuzzed", fuzzed
            st = job_status(job)
            evicted = [e for e in st["evicted_learners"] if e["pid"] == rogue.pid]
            if evicted:  # that process gets no slot again, from this server or the one after a kill
                assert tell(rogue, "attach", 60) == "refused Evicted"
            assert all(p["pid"] != rogue.pid or p["rank"] in (2, -1) for p in st["learners"])
            lives.append({"pushes": int(fuzzed[1]), "refused": int(fuzzed[2]),
                          "rule": evicted[0]["rule"] if evicted else None})
            rogue.stdin.write("exit\n")
            rogue.stdin.close()
            assert rogue.wait(timeout=30) == 0  # the rogue itself lived through its own scribbles
            # its slot comes free once it is gone, for the next rogue
            wait_until(lambda pid=rogue.pid: not [e for e in job_status(job)["evicted_learners"] if e["pid"] == pid],
                       what="the rogue's quarantined slot to be freed")
        for r, p in enumerate(honest):
            assert p.poll() is None, f"honest rank {r} exited {p.returncode}: {p.stderr.read()[-3000:]}"
            p.stdin.write("stop\n")
            p.stdin.flush()
        done = [read_line(p, 180).split() for p in honest]
        for p in honest:
            p.wait(timeout=60)
        watch.stop.set()
        watch.join()
        h = arena_header(job)
        restarts = 1 if seed == 1 else 0
        assert h["server_restarts"] == restarts and h["generation"] == first["generation"] + restarts
        assert len(watch.pids) == 1 + restarts, (watch.pids, watch.errors[-3:], watch.samples, watch.is_alive())
        assert watch.max_age < HUNG_S, f"the heartbeat was {watch.max_age:.3f} s old"
        # Each honest rank's pushes, each applied once. A server SIGKILLed while it took an entry (counted, not yet
        # handed back) leaves it at the ring's head: its successor applies and counts it again (docs/architecture.md,
        # "the only double application"), one entry of one ring per kill.
        for r, d in enumerate(done):
            assert d[0] == "done" and int(d[1]) > 0 and int(d[1]) <= int(d[2]) <= int(d[1]) + restarts, (r, d)
        assert sum(int(d[2]) - int(d[1]) for d in done) <= restarts, done
        # sgd at lr 0.001: even the largest finite float32 the rogues could write, in every entry they pushed,
        # cannot sum to an infinity; a NaN or infinity they wrote must never reach the weights.
        weights = learner.pull_state_dict(job)["weight"]
        assert torch.isfinite(weights).all(), weights
        c = job_status(job)
        taken = c["applied"] + c["rejected"] + c["dropped"] + c["ignored"] + c["pending"]
        assert c["pushed"] <= taken <= c["pushed"] + restarts, c
        report = {"seed": seed, "setup": setup, "writes": WRITES * ROGUES, "lives": lives,
                  "honest_pushes": [int(d[1]) for d in done], "server_restarts": h["server_restarts"],
                  "max_heartbeat_age_s": round(watch.max_age, 3), "applied": c["applied"],
                  "rejected": c["rejected"], "ignored": c["ignored"]}
        print("FUZZ " + json.dumps(report))
    finally:
        for p in [*honest, *rogues]:
            if p.poll() is None:
                kill(p)
    t0 = time.monotonic()
    served.stop()
    assert time.monotonic() - t0 < 10
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"psd.{job}")]
