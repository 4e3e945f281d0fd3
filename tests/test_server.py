"""`psd serve` as a user runs it: start, stop, initial weights, idle cost, `psd clean`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from conftest import HELPERS, Served, arena_header, child_env, signalled_in_wait, wait_until
from psd import learner
from psd.arena import shm_path, wait_for_job


class Flat(torch.nn.Module):
    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_clean_stop_removes_the_arena(job, serve, sig):
    s = serve(job, "--learners", "2")
    with learner.attach(Flat(), job=job) as ps:
        ps.step()
    assert os.path.exists(shm_path(job))
    log = s.stop(sig)  # asserts exit 0 and the arena gone
    assert "arena removed" in log


def test_initial_weights_from_a_file(job, serve, tmp_path):
    from safetensors.torch import save_file

    init = tmp_path / "init.safetensors"
    save_file({"w": torch.arange(64.0)}, str(init))
    serve(job, "--learners", "1", "--init", str(init))
    m = Flat()
    with learner.attach(m, job=job):
        assert torch.equal(m.w.detach(), torch.arange(64.0))


def test_initial_weights_saved_the_usual_way_are_matched_by_name(job, serve, tmp_path):
    """``save_file(model.state_dict(), f)`` lists tensors by name ('0.bias' before '0.weight'); the job
    takes them by name, so the very model that was saved attaches, trains, and exports by name."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    init = tmp_path / "init.safetensors"
    save_file(saved.state_dict(), str(init))
    serve(job, "--learners", "1", "--init", str(init), "--lr", "1")
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))  # other weights
    with learner.attach(m, job=job) as ps:
        for name, t in saved.state_dict().items():
            assert torch.equal(m.state_dict()[name], t), name
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        m[2].bias.grad = torch.ones(2)  # one gradient, on one tensor: it must land on that tensor
        ps.step()
        ps.flush()
        ps.pull()
        assert torch.equal(m[2].bias.detach(), saved[2].bias.detach() - 1)
        assert torch.equal(m[0].weight.detach(), saved[0].weight.detach())
    exported = learner.pull_state_dict(job)
    assert torch.equal(exported["2.bias"], saved[2].bias.detach() - 1)
    assert torch.equal(exported["0.bias"], saved[0].bias.detach())


def test_idle_server_sleeps(job, serve, tmp_path):
    """An idle job must not spin: measure the CPU time of the server (its update loop waits on the
    doorbell) and of its watchdog (`psd serve` itself, which polls) over a 2 s window; the bar is 5% of a
    core each. The watchdog imports torch for checkpoints in its first seconds: the window starts after a
    checkpoint it was asked for is written, which needs that import done."""
    from psd.watchdog import checkpoint

    s = serve(job, "--learners", "2", "--spin-us", "50", "--checkpoint-dir", str(tmp_path))
    with learner.attach(Flat(), job=job) as ps:  # the update loop has run and gone idle
        ps.step()
    before_ckpt = len(checkpoint.list_checkpoints(tmp_path))
    s.proc.send_signal(signal.SIGUSR1)
    wait_until(lambda: len(checkpoint.list_checkpoints(tmp_path)) > before_ckpt, timeout=60,
               what="the checkpoint asked for")
    server_pid = arena_header(job)["server_pid"]
    assert server_pid != s.proc.pid
    procs = {"server": psutil.Process(server_pid), "watchdog": psutil.Process(s.proc.pid)}
    before = {k: p.cpu_times() for k, p in procs.items()}
    t0 = time.monotonic()
    time.sleep(2.0)  # a measurement window, not synchronisation
    for k, p in procs.items():
        after = p.cpu_times()
        used = (after.user + after.system - before[k].user - before[k].system) / (time.monotonic() - t0)
        print(f"idle {k}: {used:.2%} of a core")
        assert used < 0.05, k


def test_clean_removes_arenas_of_dead_servers_only(job, serve):
    live = serve(job, "--learners", "1")
    dead_job = job + "-dead"
    dead = Served(dead_job, "--learners", "1", "--no-watchdog")
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(timeout=30)
    assert os.path.exists(shm_path(dead_job))

    def clean(*flags: str) -> str:
        return subprocess.run([sys.executable, "-m", "psd.cli", "clean", *flags], capture_output=True, text=True,
                              env=child_env(), timeout=60, check=True).stdout

    # Every job on the machine, as a dry run: a removal here would take other tests' dead arenas (pytest -n).
    out = clean("--dry-run")
    assert f"would remove {shm_path(dead_job)}: its server (pid {dead.proc.pid}) is dead" in out, out
    assert f"keeping {shm_path(job)}: its server (pid {arena_header(job)['server_pid']}) is alive" in out, out
    assert os.path.exists(shm_path(dead_job))
    out = clean("--job", job)
    assert f"keeping {shm_path(job)}" in out and "removed 0 arena(s)" in out, out
    out = clean("--job", dead_job)
    assert f"removing {shm_path(dead_job)}: its server (pid {dead.proc.pid}) is dead" in out, out
    assert "removed 1 arena(s)" in out and f"{shm_path(job)}:" not in out, out
    assert not os.path.exists(shm_path(dead_job))
    assert os.path.exists(shm_path(job)), "a live job's arena must be kept"
    out = clean("--job", dead_job)
    assert f"nothing to remove: job {dead_job!r} has no arena" in out and "removed 0 arena(s)" in out, out
    live.stop()


def test_clean_keeps_an_arena_it_cannot_read_while_a_process_maps_it(job, serve):
    """An arena of another psd version (here: the layout version moved on) may be a live job's: `psd clean`
    keeps it while a process maps it, and removes it once none does."""
    import struct
    from pathlib import Path

    served = serve(job, "--learners", "1", "--no-watchdog")  # only for a real arena's first page
    with open(shm_path(job), "rb") as f:
        head = bytearray(f.read(4096))
    served.stop()
    struct.pack_into("<I", head, 8, struct.unpack_from("<I", head, 8)[0] + 1)  # magic, then layout_version
    other = Path(shm_path(job + "-other"))
    other.write_bytes(bytes(head))
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys; f = open(sys.argv[1], 'r+b'); "
                               "m = mmap.mmap(f.fileno(), 0); print('ready', flush=True); sys.stdin.read()",
                               str(other)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"

        def clean() -> str:
            return subprocess.run([sys.executable, "-m", "psd.cli", "clean", "--job", job + "-other"],
                                  capture_output=True, text=True,
                                  env=child_env(), timeout=60, check=True).stdout

        out = clean()
        assert f"keeping {other}" in out and f"pids {holder.pid}" in out, out
        assert other.exists()
        holder.stdin.close()
        holder.wait(timeout=30)
        out = clean()
        assert f"removing {other}" in out, out
        assert not other.exists()
    finally:
        holder.kill()
        holder.wait()
        other.unlink(missing_ok=True)


def test_the_header_view_reads_each_field_as_the_header_dict_does(job, serve):
    from psd import _native
    from psd.arena import Header, HeaderView, SlotInfo, open_job

    s = serve(job, "--no-watchdog", "--learners", "2", "--lr", "0.25")
    model = Flat()
    with learner.attach(model, job=job) as ps:
        model.w.sum().backward()
        ps.step()
        ps.flush()
        a = open_job(job, role="reader")
        try:
            moving = {"heartbeat_ns", "loop_busy_ns", "loop_idle_ns", "loop_wakeups", "loop_naps", "doorbell_seq",
                      "sleeping"}  # sleeping: the idle loop naps between the two reads
            view, whole = HeaderView(a), a.header()
            assert set(_native.HEADER_FIELDS) <= set(whole) and len(_native.HEADER_FIELDS) > 50
            for name in _native.HEADER_FIELDS:
                if name not in moving:
                    assert getattr(view, name) == whole[name], name
            assert view.clock == 1 and view.n_slots == 2
            with pytest.raises(AttributeError):
                view.no_such_field  # noqa: B018
            with pytest.raises(KeyError, match="not a header field"):
                a.field("no_such_field")
            # The snapshots status reads: every field of header() / slot_info(), each an attribute.
            whole, info = a.header(), a.slot_info(0)
            snap, slot = Header(whole), SlotInfo(info)
            assert all(getattr(snap, k) == v for k, v in whole.items()) and Header.read(a).clock == 1
            assert set(info) == set(SlotInfo.__slots__)
            assert all(getattr(slot, k) == v or v != v for k, v in info.items())  # v != v: last_loss, NaN: none yet
            assert SlotInfo.read(a, 0).state == _native.SLOT_ACTIVE
            for bad in (snap, slot):
                with pytest.raises(AttributeError):
                    bad.no_such_field  # noqa: B018
                with pytest.raises(AttributeError):
                    bad.applied = 1
            with pytest.raises(TypeError, match="differ"):
                SlotInfo({**info, "no_such_field": 1})
        finally:
            a.close()
    s.stop()


def test_the_header_views_heartbeat_age_is_the_header_dicts(job, serve):
    """HeaderView.heartbeat_age_s (what the watchdog polls) derives the age as header() does: with the server
    stopped (SIGSTOP: no beat moves), a view's reading lies between two of the dict's."""
    from psd.arena import HeaderView, open_job

    s = serve(job, "--no-watchdog", "--learners", "1")
    a = open_job(job, role="reader")
    try:
        view = HeaderView(a)
        assert 0 <= view.heartbeat_age_s < 5
        os.kill(s.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(0.2)  # the age grows while nothing beats
            before = a.header()["heartbeat_age_s"]
            age = view.heartbeat_age_s
            after = a.header()["heartbeat_age_s"]
        finally:
            os.kill(s.proc.pid, signal.SIGCONT)
        assert 0.2 <= before <= age <= after < before + 5, (before, age, after)
    finally:
        a.close()
    s.stop()


def test_a_stop_flag_set_by_a_signal_handler_at_any_line_never_blocks():
    """`psd serve`'s SIGTERM handler once set a threading.Event: a signal that came while the main thread was
    inside the Event's lock blocked the handler on that lock for ever, and the server never stopped (seen in CI).
    A signal raised at every line of the stop flag's methods runs a handler that sets it; SignalFlag comes
    through, and the same harness with a threading.Event hangs in the lock's __enter__ (the harness can fail)."""
    def run(kind: str, seconds: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(HELPERS / "signal_at_every_line.py"), kind, seconds],
                              capture_output=True, text=True, timeout=120, env=child_env())

    ok = run("flag", "60")
    assert ok.returncode == 0, ok.stderr
    assert int(ok.stdout.split()[-1]) > 100  # handlers really ran inside its methods
    hung = run("event", "3")
    assert hung.returncode == 1 and "Timeout" in hung.stderr, hung.stderr
    assert "in __enter__" in hung.stderr and "in handler" in hung.stderr, hung.stderr


def test_a_nudge_or_a_readable_descriptor_ends_a_stop_flags_wait_early_without_setting_it():
    """The poll loops' "look now": a nudge (a SIGCHLD handler's) or one of the descriptors given (the fork server's
    socket, a learner's pidfd) ends the wait at once, the flag unset; without either the wait sleeps its timeout."""
    from psd.signals import SignalFlag

    flag = SignalFlag()
    t0 = time.monotonic()
    assert not flag.wait(0.05) and time.monotonic() - t0 >= 0.05
    flag.nudge()
    t0 = time.monotonic()
    assert not flag.wait(30) and not flag.is_set() and time.monotonic() - t0 < 10
    t0 = time.monotonic()
    assert not flag.wait(0.05) and time.monotonic() - t0 >= 0.05, "a nudge ends one wait, not every one after"
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        t0 = time.monotonic()
        assert not flag.wait(30, also=(r,)) and time.monotonic() - t0 < 10
        assert os.read(r, 1) == b"x", "the wait leaves the descriptor's data to its reader"
        t0 = time.monotonic()
        assert not flag.wait(0.05, also=(r,)) and time.monotonic() - t0 >= 0.05
    finally:
        os.close(r)
        os.close(w)
    # a real child's end, through a SIGCHLD handler that nudges
    old = signal.signal(signal.SIGCHLD, lambda s, f: flag.nudge())
    try:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        t0 = time.monotonic()
        flag.wait(60)
        assert time.monotonic() - t0 < 30 and child.wait(timeout=30) == 0
    finally:
        signal.signal(signal.SIGCHLD, old)
    flag.set()
    assert flag.wait(0) and flag.is_set()


def test_a_read_only_mapping_waits_for_the_state_and_is_refused_the_servers_calls(job, serve):
    """`open_job(role="reader")` (psd status's mapping) may wait for the arena's state: the wait announced
    itself with a write, and a reader's mapping is read-only everywhere, so the process died of SIGSEGV. A
    reader's or a learner's call of what only the server may do (its writes would fault the same way) is a
    PermissionError saying whose mapping it needs, and the process goes on."""
    code = f"""
import sys
from psd import _native
from psd.arena import open_job
r = open_job({job!r}, role="reader")
assert r.state == _native.ARENA_WAITING_SPEC
assert r.wait_state(_native.ARENA_WAITING_SPEC, 0.05) is False  # timed out: no change
for role in ("reader", "learner"):
    a = r if role == "reader" else open_job({job!r}, role="learner")
    for call, args in (("beat", ()), ("set_state", (_native.ARENA_STOPPED,)), ("reap", ()),
                       ("set_gain_level", (1.0, 0.0)), ("note_watchdog", (1, 1)), ("resume", ())):
        try:
            getattr(a, call)(*args)
        except PermissionError as e:
            assert "only a full's mapping may" in str(e), e
        else:
            sys.exit(f"{{role}}: {{call}} went through")
print("refused", flush=True)
assert r.wait_state(_native.ARENA_WAITING_SPEC, 30.0) is True  # the state changes (the test's learner offers)
print("changed", r.state, flush=True)
"""
    serve(job, "--no-watchdog", "--learners", "1")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env())
    try:
        assert proc.stdout.readline().strip() == "refused", proc.communicate(timeout=30)
        with learner.attach(Flat(), job=job) as ps:
            ps.step()
            out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (proc.returncode, out, err)
    assert out.startswith("changed"), out
    assert arena_header(job)["state"] == 4, "a refused call changed the arena"


@pytest.mark.timeout(60)
def test_the_bindings_waits_go_on_through_signals_whose_handlers_return(job, serve):
    """A blocking call of the binding that a signal interrupts goes on when its Python handler returns (PEP 475),
    for what is left of its timeout: the watchdog's pause for a checkpoint (a SIGCHLD, or a second SIGUSR1, raised
    InterruptedError there and the watchdog died with its job) and a learner's claim of a slot (a DataLoader's
    SIGCHLD, a user's SIGALRM: it failed as "the server refused this process"). Signals come every 10 ms while
    the server is stopped (SIGSTOP), so that both wait: the pause for a loop that no longer beats, the claim for
    an answer that never comes."""
    from psd import _native
    from psd.arena import open_job
    from psd.errors import Error

    s = serve(job, "--no-watchdog", "--learners", "2")
    full = open_job(job)
    me = os.getpid(), _native.proc_start_time(os.getpid())
    handled = []
    old = signal.signal(signal.SIGALRM, lambda sig, frame: handled.append(sig))
    with learner.attach(Flat(), job=job) as ps:
        ps.step()
        os.kill(s.proc.pid, signal.SIGSTOP)
        try:
            # stopped before the pause is asked for: a loop still running would grant it at once
            wait_until(lambda: psutil.Process(s.proc.pid).status() == psutil.STATUS_STOPPED, what="the stop")
            signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
            full.pause(*me, 20.0)  # returns once the stopped loop's last beat is a hung loop's (1 s)
            paused = len(handled)
            full.resume()
            mine = open_job(job, role="learner")
            t0 = time.monotonic()
            with pytest.raises(Error) as e:
                mine.claim(*me, -1, 1.0)
            claimed = len(handled) - paused
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            assert not isinstance(e.value, InterruptedError) and time.monotonic() - t0 >= 0.9, e.value
            assert paused > 10 and claimed > 10, (paused, claimed)
            mine.close()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            signal.signal(signal.SIGALRM, old)
            os.kill(s.proc.pid, signal.SIGCONT)
    full.close()


@pytest.mark.timeout(120)
def test_a_dead_learners_slot_is_reaped_as_it_dies_not_at_the_servers_next_look(job):
    """The server's poll sleeps on its live learners' pidfds: once its polls are a minute apart, a learner killed is
    still reaped and its slot freed at once (without the pidfds: at the next poll, a minute on), and everything it
    pushed is applied first."""
    from psd import _native
    from psd.arena import open_job
    from psd.server import ServeConfig, Server
    from psd.signals import SignalFlag

    server = Server(ServeConfig(job=job, learners=1, lr=1.0))
    polls = []
    look = server.poll
    server.poll = lambda: (polls.append(time.monotonic()), look())  # counts the server's looks
    server.start()
    stop = SignalFlag()
    loop = threading.Thread(target=server.run, args=(stop,), name="test-server-poll")
    loop.start()
    honest = subprocess.Popen([sys.executable, str(HELPERS / "honest.py"), job, "0", str(10**9)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env())
    a = None
    try:
        assert honest.stdout.readline().strip() == "ready"
        a = open_job(job, role="reader")
        honest.stdin.write("go\n")
        honest.stdin.flush()
        wait_until(lambda: a.slot_info(0)["applied"] >= 50, timeout=60, what="its gradients")
        server.config.poll_interval = 60.0
        n = len(polls)
        wait_until(lambda: len(polls) > n, timeout=30, what="a look after which the next is a minute away")
        assert server._deaths.fds(), "that look opened no pidfd for the learner"
        honest.kill()
        honest.wait(timeout=30)
        t0 = time.monotonic()
        wait_until(lambda: a.slot_info(0)["state"] == _native.SLOT_FREE, timeout=40, what="the slot freed")
        # the look after the change, the pidfd's wake, and the look again its ended pidfd asks for: no tick
        assert time.monotonic() - t0 < 40 and len(polls) <= n + 4, (len(polls), n)
        info = a.slot_info(0)
        assert info["head"] == info["tail"], "freed before what it pushed was applied"
    finally:
        if a is not None:
            a.close()
        if honest.poll() is None:
            honest.kill()
        stop.set()
        loop.join(timeout=60)
        server.stop()


@pytest.mark.parametrize("watchdog", [False, True], ids=["bare", "watchdog"])
def test_psd_serve_stops_on_sigterms_raised_inside_its_stop_flags_wait(job, watchdog, tmp_path):
    """The wiring, not the flag alone: `psd serve` (the server bare, or its watchdog) gets a SIGTERM at every
    line its main thread runs inside its stop flag's wait, and exits cleanly with its arena removed. The control
    puts threading.Event back as the stop flag (the code before SignalFlag): it hangs in the Event's lock."""
    args = ["serve", "--job", job, "--learners", "1"] + ([] if watchdog else ["--no-watchdog"])
    rc, out = signalled_in_wait(tmp_path / "serve.log", "60", *args, timeout=120)
    assert rc == 0, out
    assert watchdog or "arena removed" in out  # the watchdog's server logs elsewhere
    assert not os.path.exists(shm_path(job))
    rc, out = signalled_in_wait(tmp_path / "serve-event.log", "--event", "3", *args, timeout=120)
    # what the hang left goes the way a user would clear it: the arena of the dead server (bare: it made it
    # before its wait); under the watchdog its live server, which may still be starting on a loaded machine
    if watchdog:
        wait_for_job(job, timeout=60)
    subprocess.run([sys.executable, "-m", "psd.cli", "stop", "--job", job], capture_output=True, timeout=60,
                   env=child_env())
    assert rc == 1 and "Timeout" in out, out
    assert "in __enter__" in out and "in on_s" in out, out


def test_an_arena_watch_adopts_a_mapping_and_tells_its_arena_from_none_and_a_new_one(job, serve):
    """The learner's use of the watch: it opens its mapping itself, and looks whether the job's file still
    holds that arena ("same"), holds none ("gone": keep the mapping) or holds another ("new": attach again)."""
    from psd.arena import ArenaWatch, open_job

    watch = ArenaWatch(job, role="reader")
    assert watch.look() == "gone" and watch.replaced()
    s = serve(job, "--no-watchdog", "--learners", "1")
    assert watch.look() == "new" and watch.arena is None  # a file, and no mapping of it: nothing opened
    first = open_job(job, role="reader")
    watch.adopt(first)
    assert watch.arena is first and not watch.opened
    assert watch.look() == "same" and not watch.replaced()
    assert watch.current() is first and not watch.opened  # the adopted mapping is the watch's own
    s.stop()
    assert watch.look() == "gone" and watch.arena is first and not first.closed  # noticed; the mapping kept
    s = serve(job, "--no-watchdog", "--learners", "1")
    assert watch.look() == "new" and watch.replaced()
    second = open_job(job, role="reader")
    watch.adopt(second)
    assert first.closed and watch.arena is second and watch.look() == "same"
    watch.close()
    assert second.closed and watch.arena is None and watch.look() == "new"
    s.stop()


def test_an_arena_watch_follows_the_job_from_server_to_server(job, serve):
    from psd.arena import ArenaWatch
    from psd.watchdog.restarts import Backoff

    watch = ArenaWatch(job, role="reader")
    assert watch.current() is None and not watch.opened  # no job yet
    s = serve(job, "--no-watchdog", "--learners", "1")
    first = watch.current()
    assert first is not None and watch.opened
    assert watch.current() is first and not watch.opened  # the same arena: the same mapping
    assert not watch.replaced()
    ident = first.identity()
    s.stop()
    assert watch.replaced() and watch.arena is first  # noticed, and the mapping kept (the node link's look)
    assert watch.current() is None  # its file is gone: the mapping is dropped
    s = serve(job, "--no-watchdog", "--learners", "1")
    second = watch.current()
    assert second is not None and watch.opened and second.identity() != ident  # a new server's arena
    watch.close()
    s.stop()
    assert [Backoff(0.1, 1.0).delay(n) for n in range(6)] == [0.0, 0.1, 0.2, 0.4, 0.8, 1.0]
    assert [Backoff.every(0.05).delay(n) for n in range(4)] == [0.0, 0.05, 0.05, 0.05]  # a poll
    stop = threading.Event()
    for n in Backoff.every(0.001).tries(stop=stop):
        if n == 3:
            stop.set()  # no try after the one that saw it set
    assert n == 3
    t0 = time.monotonic()
    for n in Backoff.every(0.01).tries(time.monotonic() + 0.05):  # noqa: B007
        pass
    assert 0.05 <= time.monotonic() - t0 < 2 and 1 <= n <= 7


def test_a_server_killed_while_paused_leaves_its_successor_unpaused(job, serve):
    """A server SIGKILLed while its loop was paused for a snapshot leaves `paused` set in the arena. The server that
    takes over clears it (become_server): its loop is not paused, and a pauser that took the dead loop's flag for
    the new one's would copy weights the new loop is writing."""
    from psd import _native
    from psd.arena import open_job

    args = ("--no-watchdog", "--learners", "1")
    first = serve(job, *args)
    pusher = subprocess.Popen([sys.executable, str(HELPERS / "pusher.py"), job, "--forever"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env())
    a = open_job(job)
    try:
        wait_until(lambda: arena_header(job)["applied"] > 0, timeout=60, what="updates")  # the pusher imports torch
        me = os.getpid()
        a.pause(me, _native.proc_start_time(me), 10.0)
        assert arena_header(job)["paused"] == 1
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
        a.resume()  # the snapshot is over; the dead loop's flag stays
        assert arena_header(job)["paused"] == 1
        second = serve(job, *args)
        assert arena_header(job)["paused"] == 0
        applied = arena_header(job)["applied"]
        wait_until(lambda: arena_header(job)["applied"] > applied, what="the new loop to apply the pusher's gradients")
        a.pause(me, _native.proc_start_time(me), 10.0)  # now waits for the new loop to pause
        assert arena_header(job)["paused"] == 1
        a.resume()
    finally:
        a.close()
        pusher.kill()
        pusher.wait()
    second.stop()
