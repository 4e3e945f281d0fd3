"""A learner that writes garbage into its own slot cannot break the job.

A stray write (a buggy C extension, a bit flip) into the fields of a learner's slot that the update loop
reads: a rank out of range (this crashed every server that took over the arena), a tail far ahead of the
head (the loop re-applied stale entries millions of times a second), an entry whose sequence number is
not its index. Each time the server evicts the rogue, keeps running, and applies every gradient of an
honest learner exactly once; the counters stay exact; SIGTERM still ends the server promptly.
"""

from __future__ import annotations

import json
import mmap
import os
import time

import numpy as np
import pytest
import torch

from conftest import arena_header, wait_until
from psd import _native, learner
from psd.arena import open_job, shm_name, shm_path
from psd.errors import ArenaCorrupt, Error, SpecError


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


@pytest.mark.parametrize("fault", ["rank", "tail", "seq"])
def test_a_rogue_write_evicts_the_learner_and_the_job_goes_on(job, serve, fault):
    served = serve(job, "--learners", "2", "--lr", "1")
    honest_model, rogue_model = torch.nn.Linear(4, 1, bias=False), torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        honest_model.weight.zero_()
    honest = learner.attach(honest_model, job=job, timeout=10)
    rogue = learner.attach(rogue_model, job=job, timeout=10)
    rogue_pid = os.getpid()  # both learners live in this process
    for _ in range(3):  # both train honestly first
        for m, ps in ((honest_model, honest), (rogue_model, rogue)):
            m.weight.grad = torch.ones(1, 4)
            ps.step()
    honest.flush()
    rogue.flush()
    h = arena_header(job)
    slot = h["slots_off"] + rogue.slot * h["slot_stride"]
    if fault == "rank":
        poke(job, slot + _native.SLOT_RANK_OFFSET, 1_000_000, np.int32)
    elif fault == "tail":
        poke(job, slot + _native.SLOT_TAIL_OFFSET, rogue._tail + (1 << 40), np.uint64)
    else:  # an entry published with a sequence number that is not its index
        entry = rogue._arena.grad_offset(rogue.slot, rogue._tail % h["ring_k"]) - 64
        poke(job, entry + _native.ENTRY_SEQ_OFFSET, 999, np.uint64)
        poke(job, slot + _native.SLOT_TAIL_OFFSET, rogue._tail + 1, np.uint64)
    wait_until(lambda: arena_header(job)["evicted"] == 1, timeout=10, what="the rogue's eviction")
    # The honest learner goes on; each of its gradients is applied exactly once.
    for _ in range(5):
        honest_model.weight.grad = torch.ones(1, 4)
        honest.step()
    honest.flush()
    c = honest._arena.counters()
    h = arena_header(job)
    assert h["evicted"] == 1 and h["evicted_pid"] == rogue_pid
    rogue_model.weight.grad = torch.ones(1, 4)
    with pytest.raises(Error, match=r"taken back"):  # the rogue's next push finds its slot gone
        rogue.step()
    rogue.close(flush=False)
    assert c["pushed"] == c["applied"] + c["rejected"] + c["dropped"] and c["pending"] == 0
    assert c["applied"] == 11  # the honest learner's 8 and the rogue's 3 valid gradients, each once
    assert torch.equal(learner.pull_state_dict(job)["weight"], torch.full((1, 4), -11.0))
    honest.close()
    t0 = time.monotonic()
    out = served.stop()
    assert time.monotonic() - t0 < 10, out



def entry_base(ps, k: int) -> int:
    """Byte offset of ring entry k of learner ps's slot (its header; the gradient follows at +64)."""
    return ps._arena.grad_offset(ps.slot, k) - 64


def publish_crafted(raw: RawArena, ps, h: dict, **fields) -> None:
    """Write an entry at ps's tail as a learner would (seq, clock 0, batch 1, a dense gradient of
    1000s), with `fields` changed, then move the tail past it."""
    e, offs = entry_base(ps, ps._tail % h["ring_k"]), _native.OFFSETS["entry"]
    header = {"seq": ps._tail, "clock": 0, "batch_size": 1, "flags": 0}
    types = {"seq": np.uint64, "clock": np.uint64, "batch_size": np.uint32, "flags": np.uint32}
    for f, v in {**header, **{k: v for k, v in fields.items() if k in header}}.items():
        raw.write(e + offs[f], v, types[f])
    grad = e + 64
    raw.view[grad:grad + 4 * h["n_train"]].view(np.float32)[:] = 1000.0
    for i, b in enumerate(fields.get("payload", b"")):  # a sparse piece: count, rows, values
        raw.view[grad + i] = b
    raw.view[grad + (4 * h["n_train"] + 7) // 8 * 8 + 8 * h["n_buffers"]] = fields.get("kind", _native.PIECE_DENSE)
    slot = h["slots_off"] + ps.slot * h["slot_stride"]
    raw.write(slot + _native.OFFSETS["slot"]["tail"], ps._tail + 1, np.uint64)


def sparse_piece(count: int, rows: list[int]) -> bytes:
    return np.array([count, *rows], dtype=np.uint64).tobytes()


ROGUE_FAULTS = {  # what the rogue writes, and the rule (EVICTION_RULES in psd/server.py) it breaks
    "head": (lambda raw, ps, h, slot: raw.write(slot + _native.OFFSETS["slot"]["head"], ps._tail - 1, np.uint64),
             "head, which only the server writes"),
    "flags": (lambda raw, ps, h, slot: publish_crafted(raw, ps, h, flags=0x80), "flags this psd does not know"),
    "batch": (lambda raw, ps, h, slot: publish_crafted(raw, ps, h, batch_size=0xFFFFFFFF), "batch size"),
    "clock": (lambda raw, ps, h, slot: publish_crafted(raw, ps, h, clock=1 << 50), "newer than the server's"),
    "kind": (lambda raw, ps, h, slot: publish_crafted(raw, ps, h, kind=7), "piece map or sparse rows"),
    "sparse count": (lambda raw, ps, h, slot: publish_crafted(raw, ps, h, kind=_native.PIECE_SPARSE,
                                                              payload=sparse_piece(1 << 40, [0])),
                     "piece map or sparse rows"),
    "sparse row": (lambda raw, ps, h, slot: publish_crafted(raw, ps, h, kind=_native.PIECE_SPARSE,
                                                            payload=sparse_piece(1, [5])),
                   "piece map or sparse rows"),
}


def evictions(path) -> list[dict]:
    """The learner_evicted events the server wrote so far."""
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == "learner_evicted"]


def test_a_rogue_writing_anything_into_what_it_can_reach_cannot_break_the_job(job, serve, tmp_path):
    """While two honest learners train, a rogue learner writes each value the update loop checks, then
    random garbage, into its slot, its entries' headers and payloads, and the header fields a learner
    can reach. The server never dies, each honest gradient is applied exactly once, each rogue is
    evicted (logged with pid, rank and rule), and the weights are exactly what the valid gradients make."""
    events = tmp_path / "events.jsonl"
    served = serve(job, "--no-watchdog", "--learners", "3", "--lr", "1", "--ring-depth", "4",
                   "--event-log", str(events))
    make = lambda: torch.nn.Linear(8, 2, bias=False)  # noqa: E731
    models = [make() for _ in range(2)]
    with torch.no_grad():
        models[0].weight.zero_()
    honest = [learner.attach(m, job=job, timeout=10, rank=r) for r, m in enumerate(models)]
    raw = RawArena(job)
    h = honest[0]._arena.header()
    valid = 0  # gradients of ones that should be applied: every honest one, and the rogues' before they turn

    def train(steps: int = 2) -> None:
        nonlocal valid
        for _ in range(steps):
            for m, ps in zip(models, honest, strict=True):
                m.weight.grad = torch.ones(2, 8)
                ps.step()
                valid += 1

    rng = np.random.default_rng(13)
    faults = [*ROGUE_FAULTS, "garbage"]
    for n, fault in enumerate(faults, 1):
        train()
        rogue_model = make()
        rogue = learner.attach(rogue_model, job=job, timeout=10, rank=2)
        rogue_model.weight.grad = torch.ones(2, 8)
        rogue.step()
        rogue.flush()
        valid += 1
        slot = h["slots_off"] + rogue.slot * h["slot_stride"]
        if fault == "garbage":  # its slot's indices and figures, every entry of its ring, its tail last
            so = _native.OFFSETS["slot"]
            for f in ("head", "rank", "ssp_base", "learner_clock", "pulls", "pulls_skipped", "full_waits",
                      "round_joined", "waiters"):
                raw.view[slot + so[f]:slot + so[f] + 4] = rng.integers(0, 256, 4, dtype=np.uint8)
            for k in range(h["ring_k"]):
                e = entry_base(rogue, k)
                raw.view[e:e + h["entry_stride"]] = rng.integers(0, 256, h["entry_stride"], dtype=np.uint8)
            raw.write(slot + so["tail"], rng.integers(0, 1 << 63), np.uint64)
        else:
            ROGUE_FAULTS[fault][0](raw, rogue, h, slot)
        wait_until(lambda n=n: len(evictions(events)) == n, timeout=10, what=f"the server to log eviction {fault}")
        ev = evictions(events)[-1]
        assert ev["evicted"] == n and ev["learner_pid"] == os.getpid(), (fault, ev)
        if fault != "garbage":
            assert ev["rank"] == 2 and ROGUE_FAULTS[fault][1] in ev["rule"], (fault, ev)
        rogue.close(flush=False)
    # The header fields any learner can write: the offer, the spec's length, the waiter counts (hints).
    ho = _native.OFFSETS["header"]
    raw.write(ho["spec_len"], 1 << 62, np.uint64)
    raw.write(ho["offer_pid"], -5, np.int32)
    raw.write(ho["offer_start_time"], 12345, np.uint64)
    for f in ("state_cond.waiters", "doorbell.waiters", "sync_cond.waiters"):
        raw.write(ho[f], 0xFFFFFFFF, np.uint32)
    for ps in honest:
        raw.write(h["slots_off"] + ps.slot * h["slot_stride"] + _native.OFFSETS["slot"]["waiters"], 7, np.uint32)
    with pytest.raises(SpecError, match="longer than the spec region"):
        honest[0]._arena.spec()
    train(3)
    for ps in honest:
        ps.flush()
        info = ps._arena.slot_info(ps.slot)
        assert (info["applied"], info["rejected"], info["dropped"]) == (ps._tail, 0, 0)
    c = honest[0]._arena.counters()
    assert c["pushed"] == c["applied"] + c["rejected"] + c["dropped"] and c["pending"] == 0
    assert c["applied"] == valid
    assert served.proc.poll() is None and honest[0]._arena.header()["server_pid"] == served.proc.pid
    honest[0].pull()
    assert torch.equal(models[0].weight, torch.full((2, 8), -float(valid)))
    raw.close()
    for ps in honest:
        ps.close()
    log = served.stop()
    assert log.count(f"evicted learner pid {os.getpid()} (rank ") == len(faults), log
