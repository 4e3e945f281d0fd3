"""A learner that writes garbage into what it can write cannot break the job.

A stray write (a buggy C extension, a wrong tensor view) into the learner's own block (its request line,
tail, figures and ring entries): a tail far ahead of the head, an entry whose sequence number is not its
index, unknown flags, an impossible batch, a clock from the future, a malformed piece map. Each time the
server (under its watchdog) evicts the rogue, keeps running, refuses that process a slot again, and applies
every gradient of an honest learner exactly once; the counters stay exact; SIGTERM still ends it promptly.
The rogues are processes of their own, as in real life: eviction is of a process.
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import HELPERS, arena_header, child_env, kill, read_line, wait_until
from psd import _native, learner
from psd.arena import open_job, shm_name, shm_path
from psd.errors import ArenaCorrupt, Evicted
from psd.status import job_status
from psd.watchdog.checkpoint import state_views


def poke(job: str, offset: int, value: int, dtype) -> None:
    """Write `value` at byte `offset` of `job`'s arena, as a stray write would."""
    a = open_job(job)
    view = np.frombuffer(a, dtype=np.uint8)
    view[offset:offset + np.dtype(dtype).itemsize].view(dtype)[0] = value
    del view
    a.close()


class RawArena:
    """A rogue's own read-write mapping of a job's arena file, beside psd's (it checks nothing)."""

    def __init__(self, job: str) -> None:
        with open(shm_path(job), "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), 0)
        self.view = np.frombuffer(self.mm, dtype=np.uint8)

    def write(self, offset: int, value, dtype) -> None:
        self.view[offset:offset + np.dtype(dtype).itemsize].view(dtype)[0] = value

    def read(self, offset: int, dtype):
        return self.view[offset:offset + np.dtype(dtype).itemsize].view(dtype)[0].item()

    def close(self) -> None:
        del self.view
        self.mm.close()


# Header fields that say where things lie, with their C types.
GEOMETRY = {"n_slots": np.uint32, "ring_k": np.uint32, "ranks_off": np.uint64, "spec_off": np.uint64,
            "spec_cap": np.uint64, "total_size": np.uint64, "n_params": np.uint64, "n_train": np.uint64,
            "n_buffers": np.uint64, "n_pieces": np.uint64, "weights_off": np.uint64, "weights_bytes": np.uint64,
            "optstate_off": np.uint64, "optstate_bytes": np.uint64, "slots_off": np.uint64,
            "slot_stride": np.uint64, "entry_stride": np.uint64, "buffers_off": np.uint64, "pieces_off": np.uint64}


def test_a_stray_write_into_the_header_geometry_moves_nothing(job, serve):
    """Every process keeps the geometry it checked when it mapped the arena: garbage written into the
    header's offsets, strides and sizes moves nothing the server or a learner addresses; a new mapping
    of such an arena is refused as corrupt instead of crashing."""
    served = serve(job, "--no-watchdog", "--learners", "2", "--lr", "1", "--optimizer", "momentum",
                   "--momentum", "0.5", "--async-momentum", "off")
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    ps = learner.attach(model, job=job, timeout=10)
    for _ in range(3):
        model.weight.grad = torch.ones(1, 4)
        ps.step()
    ps.flush()
    raw = RawArena(job)
    offs = _native.OFFSETS["header"]
    saved = {f: raw.read(offs[f], t) for f, t in GEOMETRY.items()}
    try:
        for f, t in GEOMETRY.items():  # far out of the file, or just off by a little
            raw.write(offs[f], np.iinfo(t).max - 7 if f.endswith(("_off", "size")) else saved[f] + 3, t)
        with pytest.raises(ArenaCorrupt, match="geometry"):
            _native.open(shm_name(job))
        for _ in range(5):  # the learner and the server go on with the geometry they checked
            model.weight.grad = torch.ones(1, 4)
            ps.step()
        ps.flush()
        c = ps._arena.counters()
        assert served.proc.poll() is None, "the server died"
        assert c["applied"] == c["pushed"] == 8 and c["pending"] == 0
        h = ps._arena.header()  # geometry as this mapping checked it, not as the header says now
        assert all(h[f] == saved[f] for f in GEOMETRY)
    finally:
        for f, t in GEOMETRY.items():
            raw.write(offs[f], saved[f], t)
        raw.close()
    ps.pull()
    # momentum 0.5, lr 1, gradient 1 every step: the buffer goes 1, 1.5, 1.75, ...
    assert torch.allclose(model.weight, torch.full((1, 4), -sum(2 - 0.5 ** k for k in range(8))))
    ps.close()
    served.stop()



def entry_base(h: dict, slot: int, k: int) -> int:
    """Byte offset of ring entry k of `slot` (its header; the gradient follows at +64)."""
    return h["slots_off"] + slot * h["slot_stride"] + _native.LSLOT_SIZE + k * h["entry_stride"]


def publish_crafted(raw: RawArena, h: dict, slot: int, tail: int, **fields) -> None:
    """Write an entry at `tail` of `slot` as a learner would (seq, clock 0, batch 1, the slot's claim token,
    a dense gradient of 1000s, or of `grad`), with `fields` changed, then move the tail past it."""
    e, offs = entry_base(h, slot, tail % h["ring_k"]), _native.OFFSETS["entry"]
    claim = raw.read(h["slotrec_off"] + slot * _native.SLOT_RECORD_SIZE + _native.OFFSETS["slot"]["claims"],
                     np.uint64)
    header = {"seq": tail, "clock": 0, "batch_size": 1, "flags": 0, "claim": claim}
    types = {"seq": np.uint64, "clock": np.uint64, "batch_size": np.uint32, "flags": np.uint32, "claim": np.uint64,
             "buf_lo": np.uint32, "buf_hi": np.uint32}
    for f, v in {**header, **{k: v for k, v in fields.items() if k in types}}.items():
        raw.write(e + offs[f], v, types[f])
    grad = e + 64
    raw.view[grad:grad + 4 * h["n_train"]].view(np.float32)[:] = fields.get("grad", 1000.0)
    for i, b in enumerate(fields.get("payload", b"")):  # a sparse piece: count, rows, values
        raw.view[grad + i] = b
    raw.view[grad + (4 * h["n_train"] + 7) // 8 * 8 + 8 * h["n_buffers"]] = fields.get("kind", _native.PIECE_DENSE)
    raw.write(h["slots_off"] + slot * h["slot_stride"] + _native.OFFSETS["lslot"]["tail"], tail + 1, np.uint64)


def sparse_piece(count: int, rows: list[int]) -> bytes:
    return np.array([count, *rows], dtype=np.uint64).tobytes()


def _tail(raw, h, slot):
    return raw.read(h["slots_off"] + slot * h["slot_stride"] + _native.OFFSETS["lslot"]["tail"], np.uint64)


ROGUE_FAULTS = {  # what lands in the rogue's block, and the rule (EVICTION_RULES in psd/arena.py) it breaks
    "tail": (lambda raw, h, slot: raw.write(h["slots_off"] + slot * h["slot_stride"] + _native.SLOT_TAIL_OFFSET,
                                            _tail(raw, h, slot) + (1 << 40), np.uint64), "tail ran"),
    "seq": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot), seq=999), "sequence number"),
    "flags": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot), flags=0x80),
              "flags this psd does not know"),
    "batch": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot), batch_size=0xFFFFFFFF),
              "batch size"),
    "clock": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot), clock=1 << 50),
              "newer than the server's"),
    "kind": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot), kind=7),
             "piece map or sparse rows"),
    "sparse count": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot),
                                                          kind=_native.PIECE_SPARSE,
                                                          payload=sparse_piece(1 << 40, [0])),
                     "piece map or sparse rows"),
    "sparse row": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot), kind=_native.PIECE_SPARSE,
                                                        payload=sparse_piece(1, [5])),
                   "piece map or sparse rows"),
    # A partial attach's buffer range beyond the job's real-valued buffers (this job has none).
    "buffer range": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot), buf_lo=0, buf_hi=3,
                                                          flags=_native.ENTRY_BUFFERS | _native.ENTRY_BUF_RANGE),
                     "buffer range"),
    "buffer range alone": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot),
                                                                flags=_native.ENTRY_BUF_RANGE), "buffer range"),
    # A gradient marked finite (flags 0) that is not: what a learner's write after its own check leaves.
    # Taken as zeros (it is applied and moves nothing), then the learner is evicted.
    "values": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot), grad=np.nan),
               "NaN or an infinity"),
    "values inf": (lambda raw, h, slot: publish_crafted(raw, h, slot, _tail(raw, h, slot), grad=-np.inf),
                   "NaN or an infinity"),
}


def evictions(path) -> list[dict]:
    """The learner_evicted events the server wrote so far."""
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == "learner_evicted"]


def tell(proc, line: str) -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return read_line(proc)


@pytest.mark.parametrize("fault", list(ROGUE_FAULTS))
def test_a_rogue_write_evicts_that_process_for_good_and_the_job_goes_on(job, serve, tmp_path, fault):
    events = tmp_path / "events.jsonl"
    served = serve(job, "--learners", "2", "--lr", "1", "--ring-depth", "4", "--event-log", str(events))
    model = torch.nn.Linear(8, 2, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    honest = learner.attach(model, job=job, timeout=10, rank=0)
    rogue = spawn_rogue(job, "--rank", "1", "--pushes", "3")
    slot = int(read_line(rogue).split()[1])
    h = arena_header(job)
    raw = RawArena(job)
    try:
        ROGUE_FAULTS[fault][0](raw, h, slot)  # what a stray pointer in the rogue would write
        wait_until(lambda: len(evictions(events)) == 1, timeout=10, what="the rogue's eviction")
    finally:
        raw.close()
    ev = evictions(events)[0]
    assert ev["learner_pid"] == rogue.pid and ev["rank"] == 1 and ROGUE_FAULTS[fault][1] in ev["rule"], ev
    st = job_status(job)
    (rec,) = st["evicted_learners"]
    assert rec["pid"] == rogue.pid and rec["slot"] == slot and ROGUE_FAULTS[fault][1] in rec["rule"]
    assert tell(rogue, "attach") == "refused Evicted"  # that process gets no slot again
    for _ in range(5):  # the honest learner goes on; each of its gradients is applied exactly once
        model.weight.grad = torch.ones(2, 8)
        honest.step()
    honest.flush()
    c = honest._arena.counters()
    assert c["pushed"] == c["applied"] + c["rejected"] + c["dropped"] + c["ignored"] and c["pending"] == 0
    # The honest learner's 5 and the rogue's 3 valid gradients, each once (and a non-finite entry, which
    # was taken as zeros: it counts and moves nothing).
    crafted = 1 if fault.startswith("values") else 0
    assert c["applied"] == 8 + crafted
    assert torch.equal(learner.pull_state_dict(job)["weight"], torch.full((2, 8), -8.0))
    assert honest._arena.ranks()[:2] == [5, 3 + crafted]
    assert arena_header(job)["server_restarts"] == 0
    # Once the rogue is gone its slot is free again, for anyone.
    kill(rogue)
    wait_until(lambda: not job_status(job)["evicted_learners"], what="the quarantined slot to be freed")
    with learner.attach(torch.nn.Linear(8, 2, bias=False), job=job, timeout=10) as again:
        assert again.slot == slot
    honest.close()
    t0 = time.monotonic()
    out = served.stop()
    assert time.monotonic() - t0 < 10, out
    assert f"evicted learner pid {rogue.pid} (rank 1)" in out


@pytest.mark.parametrize("wait", ["space", "own"])
def test_a_learner_evicted_while_it_waits_for_ring_space_hears_it_at_once(job, serve, wait):
    """A learner waiting (the loop paused) for space in its full ring (--overlap on), or for the server to
    apply its push (--overlap off), whose block a stray write then breaks: once the loop goes on it evicts the
    slot, and the waiting step raises at once (within a wait slice), not after the learner's 30 s timeout."""
    import os
    import threading

    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1", "--ring-depth", "2",
          "--overlap", "on" if wait == "space" else "off")
    model = torch.nn.Linear(8, 2, bias=False)
    ps = learner.attach(model, job=job, timeout=30)
    holder = open_job(job)
    me = os.getpid()
    holder.pause(me, _native.proc_start_time(me), 20.0)
    outcome: dict = {}

    def steps() -> None:
        try:
            while True:  # the third step waits for ring space
                model.weight.grad = torch.ones(2, 8)
                ps.step()
        except Exception as e:  # the eviction, told to the waiting step
            outcome["error"], outcome["at"] = e, time.monotonic()

    t = threading.Thread(target=steps, daemon=True)
    t.start()
    raw = RawArena(job)
    try:
        counter = "full_waits" if wait == "space" else "waiters"
        wait_until(lambda: holder.slot_info(ps.slot)[counter] > 0, what=f"the learner to wait ({wait})")
        h = arena_header(job)
        raw.write(h["slots_off"] + ps.slot * h["slot_stride"] + _native.SLOT_TAIL_OFFSET,
                  _tail(raw, h, ps.slot) + (1 << 40), np.uint64)  # a stray write: rule TAIL
    finally:
        raw.close()
        resumed = time.monotonic()
        holder.resume()
    t.join(timeout=25)
    assert not t.is_alive(), "the evicted learner still waits"
    assert outcome["at"] - resumed < 5, outcome
    assert isinstance(outcome["error"], Evicted), outcome
    assert job_status(job)["evicted_learners"][0]["pid"] == me
    holder.close()
    ps.close(flush=False)


@pytest.mark.parametrize("lo, hi", [(3, 1), (0, 5)], ids=["reversed", "into-the-counters"])
def test_a_buffer_range_outside_the_jobs_real_valued_buffers_evicts(job, serve, lo, hi):
    """Rule BUFFERS on a job with buffers: its model's BatchNorm1d(2) has 4 real-valued elements (the running
    mean and variance) and a counter, so a range that runs backwards, or reaches past the real-valued ones
    into the counter, evicts the learner that wrote it; the job's statistics stay as they were."""
    serve(job, "--no-watchdog", "--learners", "2", "--lr", "1", "--ring-depth", "4")
    rogue = spawn_rogue(job, "--rank", "1", "--pushes", "3", "--batchnorm")
    slot = int(read_line(rogue).split()[1])
    before = learner.pull_state_dict(job)
    h = arena_header(job)
    assert h["n_buffers"] == 5
    raw = RawArena(job)
    try:
        publish_crafted(raw, h, slot, _tail(raw, h, slot), buf_lo=lo, buf_hi=hi,
                        flags=_native.ENTRY_BUFFERS | _native.ENTRY_BUF_RANGE)
        wait_until(lambda: job_status(job)["evicted_learners"], timeout=10, what="the rogue's eviction")
    finally:
        raw.close()
    (rec,) = job_status(job)["evicted_learners"]
    assert rec["pid"] == rogue.pid and "buffer range" in rec["rule"], rec
    after = learner.pull_state_dict(job)
    for k in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(after[k], before[k]), k
    kill(rogue)


def spawn_rogue(job: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HELPERS / "rogue.py"), job, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def test_the_shared_page_and_a_scribbled_request_line_harm_nobody(job, serve):
    """What every attached learner can write besides its own block: the header's shared page (the learners'
    admission mutex, the wake-up words and their waiter counts). Garbage there costs wake-ups, never the
    server; a free slot's request line full of garbage is refused (no such live process), never admitted."""
    served = serve(job, "--learners", "3", "--lr", "1", "--no-watchdog")
    model = torch.nn.Linear(8, 2, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    ps = learner.attach(model, job=job, timeout=10)
    h = arena_header(job)
    raw = RawArena(job)
    rng = np.random.default_rng(7)
    free = next(i for i in range(h["n_slots"]) if i != ps.slot)
    lo = h["slots_off"] + free * h["slot_stride"]
    req = _native.OFFSETS["lslot"]
    raw.view[lo:lo + 64] = rng.integers(0, 256, 64, dtype=np.uint8)  # a free slot's request line
    raw.write(lo + req["req_nonce"], 12345, np.uint64)
    raw.write(lo + req["req_pid"], 1 << 30, np.int32)
    ho = _native.OFFSETS["header"]
    for f in ("state_cond.waiters", "doorbell.waiters", "sync_cond.waiters"):
        raw.write(ho[f], 0xFFFFFFFF, np.uint32)
    shared = _native.HEADER_SHARED_OFFSET  # the admission mutex too: claims never take it
    raw.view[shared:_native.HEADER_SIZE] = rng.integers(0, 256, _native.HEADER_SIZE - shared, dtype=np.uint8)
    raw.close()
    wait_until(lambda: ps._arena.slot_info(free)["answered"] == 12345, what="the server to answer the request")
    info = ps._arena.slot_info(free)
    assert info["state"] == _native.SLOT_FREE and info["refused"] != 0
    for _ in range(20):
        model.weight.grad = torch.ones(2, 8)
        ps.step()
    ps.flush(timeout=10)
    c = ps._arena.counters()
    assert c["applied"] == c["pushed"] == 20 and served.proc.poll() is None
    with learner.attach(torch.nn.Linear(8, 2, bias=False), job=job, timeout=10):  # claims still work
        pass
    ps.close()
    t0 = time.monotonic()
    served.stop()
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("setup", [("--optimizer", "momentum", "--momentum", "0.9"), ("--optimizer", "adam"),
                                   ("--optimizer", "adagrad"), ("--sync", "kasync:2"),
                                   ("--sync", "kasync:2", "--optimizer", "adagrad", "--weight-decay", "0.01"),
                                   ("--grad-dtype", "bf16", "--sync", "kasync:2", "--optimizer", "adagrad"),
                                   ("--grad-dtype", "bf16", "--optimizer", "adamw")])
def test_a_nonfinite_gradient_marked_finite_never_reaches_the_weights(job, serve, tmp_path, setup):
    """Every optimizer's kernel (and the kasync sum, with Adagrad's squares) reads a ring's gradient once per
    value and takes a NaN or an infinity as zero: the weights and the optimizer state stay finite whatever a
    learner wrote after its own check, and that learner is evicted (rule VALUES). The kernels are the server's:
    no watchdog (its last checkpoint costs seconds at each stop)."""
    events = tmp_path / "events.jsonl"
    served = serve(job, "--no-watchdog", "--learners", "2", "--lr", "0.01", "--ring-depth", "4", "--event-log",
                   str(events), *setup)
    honest_model = torch.nn.Linear(8, 2, bias=False)
    honest = learner.attach(honest_model, job=job, timeout=10, rank=0)
    rogue = spawn_rogue(job, "--rank", "1", "--pushes", "3")
    slot = int(read_line(rogue).split()[1])
    h = arena_header(job)
    raw = RawArena(job)
    kind = _native.PIECE_DENSE_BF16 if "bf16" in setup else _native.PIECE_DENSE
    try:
        publish_crafted(raw, h, slot, _tail(raw, h, slot), grad=np.nan, kind=kind)
        wait_until(lambda: len(evictions(events)) == 1, timeout=10, what="the rogue's eviction")
    finally:
        raw.close()
    assert "NaN or an infinity" in evictions(events)[0]["rule"]
    for _ in range(4):  # kasync:2: two more rounds of the honest learner's
        honest_model.weight.grad = torch.ones(2, 8)
        honest.step()
    honest.flush()
    state = learner.pull_state_dict(job)
    assert all(torch.isfinite(v).all() for v in state.values()), state
    a = open_job(job, role="reader")
    try:  # the optimizer state (momentum buffer; Adam's m, v; Adagrad's sum), and the kasync sum
        h = a.header()
        views = state_views(a, h)
        assert views or "momentum" not in setup
        assert all(bool(torch.isfinite(v).all()) for v in views)
        del views
    finally:
        a.close()
    kill(rogue)
    honest.close()
    served.stop()


def test_an_eviction_outlives_the_arena_through_the_checkpoint(job, serve, tmp_path):
    """A server restored from a checkpoint (its arena was lost) still refuses the learner its predecessor
    evicted, and does not announce that old eviction again; the slot comes free once that process exits."""
    import os
    import signal

    from psd.watchdog import checkpoint

    events, ck = tmp_path / "events.jsonl", tmp_path / "ck"
    served = serve(job, "--learners", "2", "--lr", "1", "--ring-depth", "4", "--event-log", str(events),
                   "--checkpoint-dir", str(ck), "--checkpoint-every", "0")
    rogue = spawn_rogue(job, "--pushes", "3")
    slot = int(read_line(rogue).split()[1])
    h = arena_header(job)
    raw = RawArena(job)
    try:
        ROGUE_FAULTS["seq"][0](raw, h, slot)
        wait_until(lambda: len(evictions(events)) == 1, timeout=10, what="the rogue's eviction")
    finally:
        raw.close()
    os.kill(h["watchdog_pid"], signal.SIGUSR1)  # a checkpoint now
    ckpt = checkpoint.load(wait_until(lambda: checkpoint.list_checkpoints(ck), timeout=30, what="a checkpoint")[0])
    assert [r["evicted_pid"] for r in ckpt.evicted] == [rogue.pid]
    generation = h["generation"]
    assert tell(rogue, "close") == "closed"  # its process lives on, without a mapping the truncation would fault
    os.truncate(shm_path(job), 4096)  # the arena is lost: the watchdog restores the checkpoint

    def restored() -> bool:
        try:  # the lost arena is removed and a new one made: it may be missing for a moment
            h = arena_header(job)
        except (OSError, ArenaCorrupt):
            return False
        return h["generation"] > generation and h["state"] == _native.ARENA_READY

    wait_until(restored, timeout=60, what="the restored server")
    assert tell(rogue, "attach") == "refused Evicted"  # from the restored server too
    (rec,) = job_status(job)["evicted_learners"]
    assert rec["pid"] == rogue.pid and "sequence number" in rec["rule"]
    assert len(evictions(events)) == 1  # announced once, not again by the restored server
    kill(rogue)
    wait_until(lambda: not job_status(job)["evicted_learners"], what="the quarantined slot to be freed")
    with learner.attach(torch.nn.Linear(8, 2, bias=False), job=job, timeout=10):
        pass
    served.stop()
