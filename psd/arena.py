"""Naming, sizing and opening a job's arena, and the parameter spec stored in it.

The server and the learner client both need to turn a job name into a
shared-memory name safely, check /dev/shm for space before allocating, and
compare parameter specs; that shared vocabulary lives here. Creating, growing
and removing arenas stays with the server (psd.server); the client only opens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from psd import _native
from psd.choices import DEFAULT_JOB, default_job
from psd.errors import (
    ArenaCorrupt,
    ArenaIncomplete,
    ArenaLost,
    Error,
    InvalidJobName,
    JobNotFound,
    OutOfSharedMemory,
    SpecMismatch,
)

__all__ = [
    "ARENA_LOST_EXIT",
    "DEFAULT_JOB",
    "HEADER_DERIVED",
    "SET_BUFFER_DTYPES",
    "SHM_DIR",
    "WEIGHTLESS",
    "ArenaWatch",
    "Header",
    "HeaderView",
    "ParamSpec",
    "SlotInfo",
    "arena_spec",
    "buffers_set",
    "check_space",
    "decode_spec",
    "default_job",
    "encode_hash",
    "encode_spec",
    "first_difference",
    "install_sigbus_handler",
    "list_jobs",
    "model_sizes",
    "open_job",
    "piece_geometry",
    "recover_from_sigbus",
    "shm_name",
    "shm_path",
    "shrunk",
    "wait_for_job",
]

SHM_DIR = "/dev/shm"
_PREFIX = "psd."
_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MIB = 1 << 20
_PAGE = 4096  # PSD_PAGE
# The states of an arena that holds no model's weights yet (enum psd_arena_state): nothing trained is in it, and
# a server or checkpoint that takes one for the job's model takes whatever a learner brings next.
WEIGHTLESS = (_native.ARENA_WAITING_SPEC, _native.ARENA_SPEC_OFFERED, _native.ARENA_INIT_WEIGHTS)
# What the update loop found in a learner's memory when it evicted it: enum psd_rule (psd_layout.h).
EVICTION_RULES = {1: "its ring's tail ran more than the ring's depth ahead of the head",
                  2: "a ring entry's sequence number was not the index it was published at",
                  3: "its rank was outside the job's ranks",
                  4: "its ring's head, which only the server writes, was moved",
                  5: "a ring entry had flags this psd does not know",
                  6: "a ring entry's batch size was beyond any real batch",
                  7: "a ring entry claimed weights newer than the server's",
                  8: "a ring entry's piece map or sparse rows did not fit the model",
                  9: "a gradient it marked finite held a NaN or an infinity where the server read it",
                  10: "a ring entry's buffer range was outside the job's real-valued buffers"}

_CACHELINE = 64  # PSD_CACHELINE, and sizeof(struct psd_rank)
# The exit status of a process that died of SIGBUS on an arena (its file was truncated or replaced): the
# handler that native/sigbus.c installs says so on stderr and exits with it. The watchdog restarts a server
# that exits with it from the last checkpoint; `psd run` restarts a learner that does.
ARENA_LOST_EXIT = 87


class HeaderView:
    """One arena's header, a field at a time: ``HeaderView(arena).held`` reads that one field when asked
    (``Arena.field``), where ``arena.header()`` builds the dict of all of them. Its attributes are the
    layout's header fields (``PSD_HEADER_FIELDS`` in native/psd.h, exported as ``_native.HEADER_FIELDS``):
    a name the layout does not have is an AttributeError at once, not a KeyError at the first poll."""

    __slots__ = ("_arena",)

    def __init__(self, arena: _native.Arena) -> None:
        self._arena = arena

    def __dir__(self) -> list[str]:
        return [*_native.HEADER_FIELDS, *super().__dir__()]

    @property
    def heartbeat_age_s(self) -> float:
        """Seconds since the last heartbeat, -1 before any: ``header()``'s ``heartbeat_age_s`` (py_inspect.c), from
        ``heartbeat_ns`` alone (CLOCK_MONOTONIC, as ``psd_now_ns``; the clock read after the field, as there)."""
        beat = self._arena.field("heartbeat_ns")
        return (time.monotonic_ns() - beat) / 1e9 if beat else -1.0


def _header_property(name: str) -> property:
    return property(lambda self: self._arena.field(name), doc=f"the header's {name} (read when asked)")


for _name in _native.HEADER_FIELDS:
    setattr(HeaderView, _name, _header_property(_name))
del _name

# What ``Arena.header()`` holds besides the layout's fields: values py_inspect.c derives (the version and failure
# texts, the heartbeat's age, the mapping's size, the state vectors, whether learners wait for their own update
# (--overlap), the current lr and momentum, the gain level and damping, the mean staleness, the staleness held
# since the job last lost a learner and the one the momentum rule reads (the larger), the histogram).
# Checked against the dict's keys at the first Header made (``_check_keys``).
HEADER_DERIVED = ("psd_version", "fail_msg", "heartbeat_age_s", "mapped_size", "state_vectors",
                  "learners_wait_for_their_own", "lr_now", "momentum_now", "gain_level", "damping", "staleness_avg",
                  "staleness_held", "staleness_rule", "staleness_hist")


def _check_keys(cls: type, keys: Iterable[str], fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Raise TypeError unless ``keys`` are ``fields`` and a subset of ``optional``: the binding and these typed
    snapshots agree on the layout, checked once per set of keys (the fields come from the binding's X-macro)."""
    keys = frozenset(keys)
    if keys in cls._seen:
        return
    missing, unknown = set(fields) - keys, keys - set(fields) - set(optional)
    if missing or unknown:
        raise TypeError(f"{cls.__name__}: the extension's fields differ from psd.arena's (missing {sorted(missing)}, "
                        f"unknown {sorted(unknown)}): rebuild the extension (`python setup.py build_ext --inplace`)")
    cls._seen = cls._seen | {keys}


class Header:
    """One arena's whole header, read at once (``Header.read(arena)``: one ``Arena.header()`` call, a snapshot
    of every field), as attributes: ``h.applied``, ``h.hold_clock``. Its attributes are the layout's header
    fields (``_native.HEADER_FIELDS``, from ``PSD_HEADER_FIELDS`` in native/psd.h) and the values the binding
    derives (``HEADER_DERIVED``); a name that is neither is an AttributeError. Where one field is polled,
    ``HeaderView`` reads only that field."""

    FIELDS: ClassVar[tuple[str, ...]] = (*_native.HEADER_FIELDS, *HEADER_DERIVED)
    __slots__ = FIELDS
    _seen: ClassVar[frozenset[frozenset[str]]] = frozenset()

    def __init__(self, values: Mapping[str, Any]) -> None:
        _check_keys(Header, values.keys(), self.FIELDS)
        for k in self.FIELDS:
            object.__setattr__(self, k, values[k])

    @classmethod
    def read(cls, arena: _native.Arena) -> Header:
        """A snapshot of ``arena``'s header now."""
        return cls(arena.header())

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Header is a snapshot: {name} cannot be set")

    def __repr__(self) -> str:
        return f"Header(clock={self.clock}, state={self.state}, applied={self.applied})"


class SlotInfo:
    """One learner slot read at once (``SlotInfo.read(arena, i)``: one ``Arena.slot_info(i)`` call), as
    attributes: the server's record (``RECORD_FIELDS``, from ``PSD_SLOT_FIELDS`` in native/psd.h, whose names
    the binding exports as the keys of ``_native.OFFSETS["slot"]``) and the learner's block (``BLOCK_FIELDS``,
    ``PSD_LSLOT_FIELDS``, ``_native.OFFSETS["lslot"]``), each None before the arena holds its model (the
    blocks do not exist yet). A name the layout does not have is an AttributeError."""

    RECORD_FIELDS: ClassVar[tuple[str, ...]] = tuple(k for k in _native.OFFSETS["slot"] if k.isidentifier())
    BLOCK_FIELDS: ClassVar[tuple[str, ...]] = tuple(_native.OFFSETS["lslot"])
    __slots__ = (*RECORD_FIELDS, *BLOCK_FIELDS)
    _seen: ClassVar[frozenset[frozenset[str]]] = frozenset()

    def __init__(self, values: Mapping[str, Any]) -> None:
        _check_keys(SlotInfo, values.keys(), self.RECORD_FIELDS, self.BLOCK_FIELDS)
        for k in self.RECORD_FIELDS:
            object.__setattr__(self, k, values[k])
        for k in self.BLOCK_FIELDS:
            object.__setattr__(self, k, values.get(k))

    @classmethod
    def read(cls, arena: _native.Arena, slot: int) -> SlotInfo:
        """A snapshot of ``arena``'s slot ``slot`` now."""
        return cls(arena.slot_info(slot))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a SlotInfo is a snapshot: {name} cannot be set")

    def __repr__(self) -> str:
        return f"SlotInfo(state={self.state}, pid={self.pid}, rank={self.rank}, head={self.head})"


def shm_name(job: str) -> str:
    """The POSIX shared-memory name of ``job`` ("/psd.<job>"), after validating it.

    Job names are 1-64 characters of letters, digits, ``_``, ``.`` and ``-``,
    starting with a letter or digit and never containing ``..``, so no name can
    reach outside /dev/shm or collide with another program's objects.
    """
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job) or ".." in job:
        raise InvalidJobName(
            f"invalid job name {job!r}: use 1-64 letters, digits, '_', '.' or '-', "
            f"starting with a letter or digit (for example --job demo)"
        )
    return "/" + _PREFIX + job


def shm_path(job: str) -> str:
    """The file that backs ``job``'s arena."""
    return SHM_DIR + shm_name(job)


def list_jobs() -> list[str]:
    """Names of the jobs that have an arena in /dev/shm (live or not)."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n[len(_PREFIX):] for n in names if n.startswith(_PREFIX))


def check_space(needed: int, what: str) -> None:
    """Raise OutOfSharedMemory unless /dev/shm has ``needed`` bytes free."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise OutOfSharedMemory(
            f"{what} needs {needed / _MIB:,.1f} MiB of shared memory but {SHM_DIR} has only "
            f"{free / _MIB:,.1f} MiB free (of {st.f_blocks * st.f_frsize / _MIB:,.1f} MiB): "
            f"remove stale arenas with `psd clean`, use fewer --learners or a smaller --ring-depth, or enlarge "
            f"{SHM_DIR} (e.g. `mount -o remount,size=32G {SHM_DIR}`; in Docker, --shm-size)"
        )


def open_job(job: str, settle: float = 1.0, role: str = "full") -> _native.Arena:
    """Map ``job``'s arena, or raise an error that says how to start it.

    ``role`` says what this process may write: ``full`` (the server, the watchdog: everything),
    ``learner`` (only the header's shared page, the slots it claims, and its offer window) or
    ``reader`` (nothing: ``psd status``, ``top``, ``inspect``). A write outside them faults.

    An arena that a server is creating this very moment is waited for, up to
    ``settle`` seconds (creation takes milliseconds; a creator that died halfway
    leaves an incomplete arena, reported as ArenaCorrupt).
    """
    import time

    name = shm_name(job)
    install_sigbus_handler()
    deadline = time.monotonic() + settle
    while True:
        try:
            a = _native.open(name, role)
        except ArenaIncomplete:
            size = _size(SHM_DIR + name)
            if 0 < size < _PAGE:  # a creator sizes the file in one step: 0 bytes, then its whole header span
                raise ArenaCorrupt(f"{SHM_DIR}{name} is {size} bytes, less than an arena's header: it is not a psd "
                                   f"arena, or was truncated; remove it with `psd clean`") from None
            if time.monotonic() > deadline or _never_completed(SHM_DIR + name, settle):
                raise ArenaCorrupt(f"{SHM_DIR}{name} was never completed (its server died while creating it); "
                                   f"remove it with `psd clean`") from None
            time.sleep(0.005)  # the creator announces nothing but the magic number
        except FileNotFoundError:
            break
        except ArenaCorrupt as e:
            raise ArenaCorrupt(f"{e}: {SHM_DIR}{name} is not a psd arena; remove it with `psd clean`") from None
        else:
            try:
                why = _geometry_problem(a.header())
                if why:  # a server growing the arena sizes the file, then writes the fields: look once more
                    time.sleep(0.01)
                    a.remap()  # to the file's size now
                    why = _geometry_problem(a.header())
            except BaseException:
                a.close()
                raise
            if not why:
                return a
            a.close()
            raise ArenaCorrupt(f"{SHM_DIR}{name} is damaged: {why}; if its job is still running, the arena file was "
                               f"truncated or overwritten: restart the server with `psd serve --job {job} --resume` "
                               f"(it starts over from the last checkpoint), or remove it with `psd clean`")
    raise JobNotFound(
        f"no psd job {job!r} on this machine ({SHM_DIR}{name} does not exist): start its server "
        f"first with `psd serve --job {job} --learners N`"
    )


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _never_completed(path: str, settle: float) -> bool:
    """Whether an arena without its magic number is past waiting for: its creator writes the magic within
    milliseconds of sizing the file, so one not changed for ``settle`` seconds is not being created."""
    import time

    try:
        return time.time() - os.stat(path).st_mtime > settle
    except FileNotFoundError:
        return False  # removed meanwhile: the next open says so


_sigbus_handled = False
_sigbus_recovers = False


def install_sigbus_handler() -> None:
    """Make a SIGBUS on an arena mapping (its file truncated by another process) a message on stderr and exit
    status ARENA_LOST_EXIT instead of a core dump (or, after ``recover_from_sigbus``, an ArenaLost). Once per
    process; every process that maps an arena calls it."""
    global _sigbus_handled
    if not _sigbus_handled:
        _native.install_sigbus_handler(ARENA_LOST_EXIT, _sigbus_recovers)
        _sigbus_handled = True


def recover_from_sigbus() -> None:
    """Outlive a SIGBUS on an arena mapping: the processes that supervise a job (the watchdog, ``psd run``,
    ``psd status``) call it before they map one. The faulting mapping becomes zero pages (native/sigbus.c), and
    every read of it from then on raises ArenaLost, as ``Arena.lost()`` says: a copy out of a buffer view asks
    that after it. The server and the learners keep the exit: what they hold in flight is not to be trusted
    on zeros, and the watchdog restarts them."""
    global _sigbus_handled, _sigbus_recovers
    _sigbus_recovers = True
    _native.install_sigbus_handler(ARENA_LOST_EXIT, True)
    _sigbus_handled = True


def shrunk(arena: _native.Arena, file_size: int) -> bool:
    """Whether the arena's file is now shorter than this mapping of it (truncated by another process):
    touching the mapping past the file's end would raise SIGBUS, so the caller must drop it unread."""
    with memoryview(arena) as mapped:
        return file_size < mapped.nbytes


class ArenaWatch:
    """A process's mapping of a job's arena, kept current (the watchdog's, ``psd run``'s and the node link's):
    ``current()`` is the mapping of the arena the job's file holds now, opened again once the file was replaced
    (a new server's), dropped unread once it was truncated under the mapping (touching it would fault with
    SIGBUS), and None while there is none to open. ``opened`` says whether that call mapped it anew. A process
    that must not follow a replaced arena (the node link: its next life rejoins) asks ``replaced()``. A learner,
    whose reopen is an attach (the job brought to READY, a slot claimed), opens its mapping itself and
    ``adopt()``s it, then asks ``look()`` while it waits for a server (learner/connection.py)."""

    def __init__(self, job: str, role: str = "full") -> None:
        self.job, self.role = job, role
        self.arena: _native.Arena | None = None
        self._ident: tuple[int, int] | None = None
        self.opened = False
        self.truncated = False  # the last current() dropped the mapping: its file was truncated under it

    def current(self) -> _native.Arena | None:
        self.opened = self.truncated = False
        try:
            st = os.stat(shm_path(self.job))
        except FileNotFoundError:
            self.close()
            return None
        if self.arena is not None and self._ident == (st.st_dev, st.st_ino):
            try:
                if not self.arena.lost() and not shrunk(self.arena, st.st_size):
                    return self.arena
            except ArenaLost:  # lost between the two looks (recover_from_sigbus): as truncated
                pass
            self.close()  # the same arena, truncated under us (its server dies of SIGBUS): nothing to reopen
            self.truncated = True
            return None
        self.close()
        try:
            a = open_job(self.job, role=self.role)
        except (Error, OSError):
            return None
        self.arena, self._ident, self.opened = a, a.identity(), True
        return a

    def adopt(self, arena: _native.Arena) -> None:
        """Watch ``arena``, a mapping of the job's arena this process opened itself (``open_job``, which says
        why it cannot where ``current()`` answers None); a mapping the watch held before is dropped."""
        if self.arena is not None and self.arena is not arena:
            self.close()
        self.arena, self._ident, self.opened = arena, arena.identity(), False

    def look(self) -> Literal["same", "gone", "new"]:
        """What the job's file holds now, against this watch's mapping: ``"same"``, the arena it maps;
        ``"gone"``, no file; ``"new"``, another object (a new server's arena), or a file while it maps none.
        Opens nothing and keeps the mapping."""
        try:
            st = os.stat(shm_path(self.job))
        except FileNotFoundError:
            return "gone"
        return "same" if self.arena is not None and (st.st_dev, st.st_ino) == self._ident else "new"

    def replaced(self) -> bool:
        """Whether the job's file no longer holds the arena this watch maps (removed, or another object: a new
        server's), or it maps none; opens nothing and keeps the mapping."""
        return self.arena is None or self.look() != "same"

    def release(self) -> _native.Arena | None:
        """The current mapping (or None), now the caller's to close: this watch forgets it."""
        a = self.current()
        self.arena = self._ident = None
        return a

    def close(self) -> None:
        """Drop the mapping (a tensor that still maps it keeps it until the tensor goes)."""
        if self.arena is not None:
            try:
                self.arena.close()
            except Error:
                pass
            self.arena = self._ident = None


def _page_up(v: int) -> int:
    return -(-v // _PAGE) * _PAGE


def learner_writable(job: str, h: dict, slot: int) -> list[dict]:
    """Every byte range the learner of ``slot`` can write in ``job``'s arena file (the trust boundary's
    contract, `psd inspect --json`): the header's shared page (wake-up words, the learners' admission mutex)
    and its slot's learner block (claim request, tail, its own figures, its ring). The server's records,
    the weights, the optimizer state and the rest of the header are mapped read-only. (The first learner
    also writes the spec, the weights and the buffers while it offers the model, before the job is READY.)"""
    path = shm_path(job)
    ranges = [{"file": path, "offset": _PAGE, "length": _native.HEADER_SIZE - _PAGE, "what": "header shared page"}]
    if h.get("slot_stride"):
        ranges.append({"file": path, "offset": h["slots_off"] + slot * h["slot_stride"], "length": h["slot_stride"],
                       "what": f"slot {slot} learner block (request, tail, figures, ring)"})
    return ranges


def _geometry_problem(h: dict) -> str:
    """What is wrong with an arena header's geometry, checked against the size of the mapping ('' if nothing).

    Every offset the native side follows must lie inside the file, so a truncated or overwritten arena is
    refused here instead of faulting later.
    """
    size, n_slots, ring_k, cap = h["mapped_size"], h["n_slots"], h["ring_k"], h["spec_cap"]
    if not 1 <= n_slots <= _native.MAX_SLOTS or not 1 <= ring_k <= _native.MAX_RING or ring_k & (ring_k - 1):
        return f"its geometry is impossible ({n_slots} learner slots of ring depth {ring_k})"
    if not _native.ARENA_WAITING_SPEC <= h["state"] <= _native.ARENA_STOPPED:
        return f"its state {h['state']} is not one psd knows"
    records = _native.HEADER_SIZE + _page_up(n_slots * _CACHELINE)  # after the ranks: the server's slot records
    span = records + _page_up(n_slots * _native.SLOT_RECORD_SIZE)
    if (h["ranks_off"] != _native.HEADER_SIZE or h["slotrec_off"] != records or h["spec_off"] != span
            or cap > 1 << 40 or h["spec_len"] > cap):
        return "its header regions are out of place"
    span += _page_up(cap)
    if not span <= h["total_size"] <= size:
        return (f"it should be {h['total_size']:,} bytes (at least {span:,}) but the file has {size:,}: it was "
                f"truncated")
    if h["state"] < _native.ARENA_INIT_WEIGHTS or not h["weights_off"]:
        return ""  # no model geometry yet (or, while a spec is offered, the last one's)
    sizes = [h[k] for k in ("n_params", "n_train", "n_buffers", "n_pieces")]
    try:
        expected = _native.arena_size(n_slots, ring_k, cap, sizes[0], h["state_vectors"], *sizes[1:])
    except (ValueError, OverflowError):
        return f"its model sizes {sizes} are impossible"
    offs = [h[k] for k in ("weights_off", "optstate_off", "buffers_off", "pieces_off", "slots_off", "slot_stride")]
    if (h["total_size"] != expected or h["weights_off"] != span or any(o % _PAGE for o in offs)
            or h["weights_off"] + 4 * sizes[0] > h["optstate_off"] or h["optstate_off"] > h["buffers_off"]
            or h["buffers_off"] + 8 * sizes[2] > h["pieces_off"] or h["pieces_off"] + 16 * sizes[3] > h["slots_off"]
            or h["slots_off"] + n_slots * h["slot_stride"] != expected or h["entry_stride"] % _CACHELINE
            or h["entry_stride"] < _CACHELINE + 4 * sizes[1] + 8 * sizes[2] + sizes[3]
            or ring_k * h["entry_stride"] >= h["slot_stride"]):
        return "its model regions do not add up to its size"
    return ""


@dataclass(frozen=True)
class ParamSpec:
    """One tensor of a model's state: its name, shape, dtype, and kind.

    ``kind`` is ``param`` (trained), ``frozen`` (a parameter with ``requires_grad=False``: held and
    exported, never updated) or ``buffer`` (a persistent buffer, such as BatchNorm's statistics).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    kind: str = "param"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def encode_spec(spec: Iterable[ParamSpec]) -> tuple[bytes, int]:
    """The spec as stored in the arena (canonical JSON) and its 64-bit hash."""
    # A trained parameter's entry has no "kind": specs of models without frozen parameters or buffers
    # (and their hashes) read as they did before kinds existed.
    data = json.dumps(
        [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype, **({"kind": p.kind} if p.kind != "param" else {})}
         for p in spec],
        separators=(",", ":"),
    ).encode()
    return data, encode_hash(data)


def decode_spec(data: bytes) -> list[ParamSpec]:
    """Inverse of encode_spec."""
    return [ParamSpec(d["name"], tuple(d["shape"]), d["dtype"], d.get("kind", "param")) for d in json.loads(data)]


def arena_spec(arena: _native.Arena) -> list[ParamSpec]:
    """The model spec stored in ``arena``, checked against the hash stored beside it (ArenaCorrupt if the
    two disagree: something overwrote the arena), for callers that read it once the arena holds a spec."""
    data = arena.spec() or b""
    bad = ""
    if encode_hash(data) != HeaderView(arena).spec_hash:
        bad = "does not match its checksum"
    else:
        try:
            return decode_spec(data)
        except (ValueError, KeyError, TypeError) as e:  # JSON, UTF-8 or shape errors: written by no psd
            bad = f"cannot be read ({type(e).__name__}: {e})"
    raise ArenaCorrupt(f"the model spec in {SHM_DIR}{arena.name} {bad}: the arena was overwritten; restart its "
                       f"server with `psd serve --resume` to start over from the last checkpoint, or remove it with "
                       f"`psd clean`")


def encode_hash(data: bytes) -> int:
    """The 64-bit hash of an encoded spec, as encode_spec gives it and the arena stores it."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def model_sizes(spec: Iterable[ParamSpec]) -> tuple[int, int, int, int]:
    """(n_params, n_train, n_buffers, n_pieces): float32 weights, trainable ones, float64 buffer elements,
    trainable tensors."""
    spec = list(spec)
    n_train = sum(p.numel for p in spec if p.kind == "param")
    n_params = n_train + sum(p.numel for p in spec if p.kind == "frozen")
    n_buffers = sum(p.numel for p in spec if p.kind == "buffer")
    return n_params, n_train, n_buffers, sum(1 for p in spec if p.kind == "param")


def piece_geometry(spec: Iterable[ParamSpec]) -> list[tuple[int, int]]:
    """(elements, elements per row) of each trainable tensor: what the update loop needs for sparse rows."""
    return [(p.numel, p.numel // p.shape[0] if p.shape and p.shape[0] else 1)
            for p in spec if p.kind == "param"]


def _kind_note(a: ParamSpec, b: ParamSpec) -> str:
    return f" ({a.kind})" if a.kind != b.kind else ""


# Buffers of these dtypes are statistics or flags: an entry's value replaces the job's. Integer buffers are
# counters: an entry's increment is added. The spec lists the first kind first.
SET_BUFFER_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16", "bool"})


def buffers_set(spec: Iterable[ParamSpec]) -> int:
    """How many leading buffer elements entries set (real-valued and boolean buffers); the rest add up."""
    return sum(p.numel for p in spec if p.kind == "buffer" and p.dtype in SET_BUFFER_DTYPES)


def first_difference(job: str, ours: list[ParamSpec], theirs: list[ParamSpec]) -> SpecMismatch | None:
    """An error naming the first tensor where ``ours`` (the learner's) differs from the job's."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return SpecMismatch(
                f"model does not match job {job!r}: tensor #{i} is {a.name!r} {list(a.shape)} {a.dtype}"
                f"{_kind_note(a, b)} in this model but {b.name!r} {list(b.shape)} {b.dtype}{_kind_note(b, a)} in "
                f"the job; attach "
                f"the same model (same frozen parameters and dtype) the job was started with, or start a new job"
            )
    if len(ours) != len(theirs):
        extra = ours[len(theirs)] if len(ours) > len(theirs) else theirs[len(ours)]
        where = "this model" if len(ours) > len(theirs) else "the job"
        return SpecMismatch(
            f"model does not match job {job!r}: this model has {len(ours)} tensors and the job "
            f"{len(theirs)}; the first one only {where} has is {extra.name!r} {list(extra.shape)}"
        )
    return None


def wait_for_job(job: str, timeout: float = 30.0, server_pid: int | None = None) -> None:
    """Return once ``job``'s arena exists and its server is alive, or raise JobNotFound.

    A new server has no way to tell anybody it created its arena, so this polls
    (every 20 ms). If ``server_pid`` is given and that process exits first, give
    up at once.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            a = open_job(job, role="reader")
        except JobNotFound:
            pass
        else:
            try:
                if a.server_alive():
                    return
            except ArenaLost:
                pass  # truncated as it was read: its server dies of SIGBUS; the next look says what follows
            finally:
                a.close()
        if server_pid is not None and _native.proc_start_time(server_pid) == 0:
            raise JobNotFound(f"the server of job {job!r} (pid {server_pid}) exited before it was ready")
        if time.monotonic() > deadline:
            raise JobNotFound(f"job {job!r} did not appear within {timeout:g} s")
        time.sleep(0.02)
