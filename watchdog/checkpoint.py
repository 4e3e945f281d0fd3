"""Checkpoints: consistent snapshots of a job's arena, written so that a crash never leaves a torn one.

A checkpoint is one safetensors file (no pickle; safe to load from anyone;
memory-mappable) holding every tensor of the job's state under its own name
(parameters as the float32 master weights, buffers as float64), plus metadata:
format, psd version, weights clock, generation, spec and its hash, config,
per-rank progress, counters, and a SHA-256 of the tensor data. It is written
to a temporary file, fsynced, renamed into place and the directory fsynced
(as Redis's rdbSave does), and only the newest ``keep`` are kept. Loading
checks the format and the checksum, so a torn or corrupt file is detected and
skipped with a message instead of being trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from psd import __version__, _native
from psd.arena import HeaderView, ParamSpec, arena_spec, decode_spec, encode_spec
from psd.errors import ArenaLost, Error

if TYPE_CHECKING:  # torch is imported where it is used: a restarting server must not wait for it
    import torch

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CorruptCheckpoint",
    "default_dir",
    "holds_model",
    "latest",
    "list_checkpoints",
    "load",
    "load_allowance",
    "save_atomic",
    "snapshot",
    "state_views",
    "write",
    "write_allowance",
]

FORMAT = "psd-checkpoint/2"
_READABLE = ("psd-checkpoint/1", FORMAT)  # /1: no buffers, no per-tensor state
SUFFIX = ".safetensors"
OPTSTATE = "__psd_optstate__"  # the tensor holding the optimizer state vectors
PIECES = "__psd_pieces__"  # the update loop's per-tensor state (psd/state.py pieces_view), a row each
log = logging.getLogger("psd.watchdog")


class CorruptCheckpoint(Error):
    """A checkpoint file that is torn, truncated, or fails its checksum."""


def default_dir(job: str) -> Path:
    """Where a job's checkpoints go when no --checkpoint-dir is given."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "psd" / "checkpoints" / job


# What a checkpoint keeps of each eviction record (the slot record's fields, as Arena.slot_info names them).
EVICTED_FIELDS = ("evicted_pid", "evicted_start_time", "evicted_pid_ns", "evicted_rule", "evicted_unix_ns",
                  "evicted_entries", "rank")


def evicted_records(arena: _native.Arena) -> list[dict]:
    """The arena's eviction records still in force (slots in state EVICTED)."""
    out = []
    for i in range(HeaderView(arena).n_slots):
        info = arena.slot_info(i)
        if info["state"] == _native.SLOT_EVICTED:
            out.append({k: int(info[k]) for k in EVICTED_FIELDS})
    return out


@dataclass
class Checkpoint:
    """A snapshot of a job: its state by tensor name (float32 parameters, float64 buffers), and where
    training stood."""

    weights: dict[str, torch.Tensor]
    spec: list[ParamSpec]
    clock: int
    generation: int
    ranks: list[int]
    config: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    job: str = ""
    created_unix_ns: int = 0
    path: Path | None = None
    # Optimizer progress (optimizer, sync, opt_steps, rounds, acc_count, acc_staleness, lr_now, and where a round's
    # finish stood: round_applying, round_applied, 0 but in a snapshot taken inside one) and its
    # state: the arena's state vectors (momentum; Adam's m, v; the bsp/kasync accumulator), each n_train long.
    optim: dict = field(default_factory=dict)
    optstate: torch.Tensor | None = None
    pieces: torch.Tensor | None = None  # int64 (n_pieces, PIECE_WORDS): per tensor, psd/state.py pieces_view
    # Learners the server evicted whose records it still kept (their process may still run): a server that
    # restores this checkpoint keeps refusing them (EVICTED_FIELDS each).
    evicted: list[dict] = field(default_factory=list)
    # The job's lineage when it was written (native/psd_layout.h: the arena's `lineage`); 0 in one made outside a
    # job, or written before checkpoints carried one. Not in the file: when the lineage began (the arena's
    # creation), and the checkpoint it began from (creation time, clock; (0, 0): none), which tell ``write`` what
    # in the directory is another run's.
    lineage: int = 0
    born_unix_ns: int = 0
    origin: tuple[int, int] = (0, 0)

    @property
    def spec_hash(self) -> int:
        return encode_spec(self.spec)[1]


def _digest(weights: dict[str, torch.Tensor], spec: list[ParamSpec]) -> str:
    import torch

    h = hashlib.sha256()
    for p in spec:
        h.update(weights[p.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file so that a crash leaves the old file or the new one, never half of one:
    a temporary file beside it, fsync, rename, fsync of the directory."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


# A checkpoint's temporary file untouched this long, its writer's pid gone, was left by a killed writer.
STALE_TMP_S = 600.0

# The slowest read of a checkpoint or --init file a start allows for (a cold disk, network storage): 100 MB/s.
LOAD_RATE = 100e6


def load_allowance(source: str | os.PathLike | None, job: str = "") -> float:
    """Seconds a server may take to read ``source`` (a checkpoint directory: every checkpoint in it, since a
    torn or corrupt newest one makes the server read the next; or one file, --init's), beyond the start limit
    of a server that loads nothing: their bytes at ``LOAD_RATE``. 0 where there is nothing to read. With
    ``job``, a directory's checkpoints of that job alone where it has any there (``latest(job=)`` reads no
    other): a directory that jobs share holds every ended job's own newest."""
    if not source:
        return 0.0
    path = Path(source)
    try:
        files = list_checkpoints(path) if path.is_dir() else [path]
        if job and path.is_dir():
            files = [f for f in files if _of_job(job_of(f), job)] or files
        return sum(f.stat().st_size for f in files) / LOAD_RATE
    except OSError:
        return 0.0


def file_name(created_unix_ns: int, clock: int) -> str:
    """The name ``write`` gives a checkpoint."""
    return f"ckpt-{created_unix_ns:020d}-c{clock}{SUFFIX}"


def job_sources(own: str | os.PathLike, asked: str | os.PathLike | None) -> list[Path]:
    """Where a job's checkpoints are: its checkpoint directory ``own``, then what it resumed from (``asked``:
    --resume DIR or FILE), once each."""
    return list(dict.fromkeys(Path(p) for p in (own, asked) if p))


def lineage_in(header: HeaderView) -> tuple[int, tuple[int, int]]:
    """A READY arena's lineage and origin (native/psd_layout.h), as ``of_job`` takes them."""
    return header.lineage, (header.origin_unix_ns, header.origin_clock)


def of_job(own: str | os.PathLike, asked: str | os.PathLike | None, lineage: int,
           origin: tuple[int, int] = (0, 0)) -> Checkpoint | None:
    """A job's newest checkpoint, from its checkpoint directory ``own`` or what it resumed from (``asked``: --resume
    DIR or FILE): the newest of its ``lineage`` (the arena's: what the job wrote since its weights were last loaded),
    or before it wrote one, the checkpoint they were loaded from, ``origin`` (its creation time and clock, the
    arena's; (0, 0): none). Another run's checkpoint in the same directory, a run's forked from the same checkpoint,
    or those a job resumed from an older one rolled back from, are not the job's. Without a lineage (0: the job
    never held a model), the newest in either."""
    sources = job_sources(own, asked)
    for source in sources:
        ckpt = latest(source, lineage)
        if ckpt is not None:
            return ckpt
    if lineage and origin[0]:
        # By its metadata, not its name: --resume FILE takes a checkpoint copied or renamed
        for source in sources:
            for path in [source] if source.is_file() else list_checkpoints(source):
                ident = identity_of(path)
                if ident is not None and ident[1:] == tuple(origin):
                    try:
                        return load(path)
                    except CorruptCheckpoint as e:
                        log.warning("skipping checkpoint: %s", e)
    return None


def write_allowance(header: HeaderView) -> float:
    """Seconds a checkpoint of the arena with this header may take to write, at the slowest rate allowed for
    (``LOAD_RATE``): its weights and optimizer state. What a stop gives the watchdog's last checkpoint beyond
    its own time limit."""
    return (header.weights_bytes + header.optstate_bytes) / LOAD_RATE


def holds_model(arena: _native.Arena, seen_ready: bool) -> bool:
    """Whether ``arena`` holds a model's weights to checkpoint: READY, or STOPPED after it held them (the caller
    saw it READY, ``seen_ready``, or updates were applied to them). A server stopped while its arena waited for
    a model's weights (a learner offered one and died before writing it) leaves it STOPPED with the model's
    sizes and zeros for weights: a checkpoint of those would be the next ``--resume``'s model."""
    if not HeaderView(arena).n_params:
        return False
    st = arena.state
    return st == _native.ARENA_READY or (st == _native.ARENA_STOPPED and (seen_ready or arena.clock() > 0))


def snapshot(arena: _native.Arena, job: str, config: dict | None = None, pause_timeout: float = 30.0) -> Checkpoint:
    """Copy the arena's weights consistently: pause the update loop, copy, resume.

    Learners keep computing meanwhile (each waits at its next push: for ring space, or, where --overlap says
    so, for the update); the pause lasts one memory copy of the weights. The loop pauses between gradients:
    ``pause_timeout`` is how long one update may take (a large model's Adam, a loaded machine) before this
    gives up; a loop that stopped beating (hung) or none running is no wait at all (native/pause.c).
    """
    from psd.state import buffers_view, pieces_view, split, weights_view

    me = os.getpid()
    h = arena.header()
    spec = arena_spec(arena)
    arena.pause(me, _native.proc_start_time(me), pause_timeout)
    try:
        flat = weights_view(arena, h).clone()
        bufs = buffers_view(arena, h).clone()
        pieces = pieces_view(arena, h).clone()
        clock = arena.clock()
        ranks = arena.ranks()
        counters = arena.counters()
        optim, optstate = _optimizer_state(arena)
        evicted = evicted_records(arena)
        if arena.lost():  # truncated while copied (psd.arena.recover_from_sigbus): the copies hold zeros
            raise ArenaLost(f"job {job!r}: the arena's file was truncated while its weights were copied; no "
                            f"checkpoint of it")
    finally:
        arena.resume()
    tensors = [p for p in spec if p.kind != "buffer"]
    buffers = [p for p in spec if p.kind == "buffer"]
    weights = dict(zip((p.name for p in tensors), split(flat, tensors), strict=True))
    weights.update(zip((p.name for p in buffers), split(bufs, buffers), strict=True))
    return Checkpoint(weights, spec, clock, h["generation"], ranks, dict(config or {}, lr=h["lr"]),
                      counters, job, time.time_ns(), optim=optim, optstate=optstate, pieces=pieces,
                      evicted=evicted, lineage=h["lineage"], born_unix_ns=h["created_unix_ns"],
                      origin=(h["origin_unix_ns"], h["origin_clock"]))


def _optimizer_state(arena: _native.Arena) -> tuple[dict, torch.Tensor | None]:
    """The optimizer's progress and state vectors, copied (call with the update loop paused)."""
    import torch

    h = arena.header()
    optim = dict(arena.training(), **{k: h[k] for k in ("opt_steps", "rounds", "acc_count", "acc_staleness",
                                                         "lr_now", "round_applying", "round_applied")})
    views = state_views(arena, h)
    return optim, torch.stack([v.clone() for v in views]) if views else None


def state_views(arena: _native.Arena, h: dict) -> list[torch.Tensor]:
    """The arena's optimizer-state vectors, as tensors over the mapping (none for plain sgd in asp)."""
    import torch

    k = h["state_vectors"]
    stride = h["optstate_bytes"] // k if k else 0
    return [torch.frombuffer(arena, dtype=torch.float32, count=h["n_train"], offset=h["optstate_off"] + i * stride)
            for i in range(k)]


def restore_optimizer_state(arena: _native.Arena, ckpt: Checkpoint) -> bool:
    """Put a checkpoint's optimizer state into a (not yet READY) arena if it was made for the same
    optimizer and sync mode; returns whether it did."""
    from psd.state import pieces_view

    h = arena.header()
    made = arena.training()
    optim = ckpt.optim
    same = optim and (optim.get("optimizer"), optim.get("sync")) == (made["optimizer"], made["sync"])
    k = h["state_vectors"]
    if not same or (k and (ckpt.optstate is None or tuple(ckpt.optstate.shape) != (k, h["n_train"]))):
        return False
    for dst, src in zip(state_views(arena, h), ckpt.optstate if k else [], strict=True):
        dst.copy_(src)
    pieces = pieces_view(arena, h)
    if ckpt.pieces is not None and tuple(ckpt.pieces.shape) == tuple(pieces.shape):
        pieces.copy_(ckpt.pieces)
        return True
    if ckpt.pieces is not None and tuple(ckpt.pieces.shape) == (pieces.shape[0], 2):
        pieces[:, :2] = ckpt.pieces  # written before tensors counted the gradients they took (layout 17)
    else:  # written before tensors counted their own steps: every tensor had every step
        pieces[:, 0] = optim.get("opt_steps", 0)
        pieces[:, 1] = optim.get("rounds", 0) + 1 if optim.get("acc_count") else 0
    pieces[:, 2:] = 0
    if made["sync"] == "kasync" and h["sync_param"] > 1 and made["optimizer"] in ("adam", "adamw"):
        # As the builds that wrote it counted Adam's steps: each tensor in every gradient of every round
        in_round = pieces[:, 1] == optim.get("rounds", 0) + 1
        acc = int(optim.get("acc_count", 0))
        pieces[:, 2] = pieces[:, 0] * h["sync_param"] + in_round * acc
        pieces[:, 3] = in_round * acc
    return True


def write(ckpt: Checkpoint, directory: str | os.PathLike, keep: int = 3) -> Path:
    """Write ``ckpt`` atomically into ``directory``; keep the newest ``keep``; return its path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    name = file_name(ckpt.created_unix_ns, ckpt.clock)
    spec_json, spec_hash = encode_spec(ckpt.spec)
    meta = {
        "format": FORMAT,
        "psd_version": __version__,
        "job": ckpt.job,
        "clock": str(ckpt.clock),
        "generation": str(ckpt.generation),
        "spec": spec_json.decode(),
        "spec_hash": str(spec_hash),
        "config": json.dumps(ckpt.config, sort_keys=True),
        "ranks": json.dumps(ckpt.ranks),
        "counters": json.dumps(ckpt.counters, sort_keys=True),
        "created_unix_ns": str(ckpt.created_unix_ns),
        "sha256": _digest(ckpt.weights, ckpt.spec),
        "optim": json.dumps(ckpt.optim, sort_keys=True),
        "evicted": json.dumps(ckpt.evicted, sort_keys=True),
        "lineage": str(ckpt.lineage),
    }
    tensors = {k: v.contiguous() for k, v in ckpt.weights.items()}
    if ckpt.optstate is not None:
        tensors[OPTSTATE] = ckpt.optstate.contiguous()
        meta["optstate_sha256"] = hashlib.sha256(ckpt.optstate.contiguous().numpy().tobytes()).hexdigest()
    if ckpt.pieces is not None:
        tensors[PIECES] = ckpt.pieces.contiguous()
        meta["pieces_sha256"] = hashlib.sha256(ckpt.pieces.contiguous().numpy().tobytes()).hexdigest()
    save_atomic(tensors, d / name, meta)
    for tmp in d.glob(f".ckpt-*{SUFFIX}.tmp-*"):  # a writer killed mid-write leaves its temporary file
        # Untouched for STALE_TMP_S and its writer gone from here: a directory shared by several nodes holds
        # other hosts' writes in progress, whose pids mean nothing here, but which a write keeps touching.
        pid = tmp.name.rsplit("-", 1)[-1]
        try:
            old = time.time() - tmp.stat().st_mtime > STALE_TMP_S
        except FileNotFoundError:
            continue
        if old and pid.isdigit() and int(pid) != os.getpid() and not _native.proc_start_time(int(pid)):
            tmp.unlink(missing_ok=True)
    _prune(d, ckpt, keep, d / name)
    _fsync_dir(d)
    ckpt.path = d / name
    return ckpt.path


def _prune(d: Path, ckpt: Checkpoint, keep: int, written: Path) -> None:
    """Remove the checkpoints in ``d`` beyond its newest ``keep`` (by name: by creation time), but not ``written``
    (``ckpt``, just written: a wall clock stepped back names it older than the job's last ones), nor ``ckpt``'s
    lineage's newest ``keep`` by clock, nor another run's: of another lineage, written since ``ckpt``'s lineage
    began (a run forked from the same checkpoint, or several nodes, writing beside it: their clocks agreeing
    within a checkpoint interval), or the checkpoint it began from. An earlier run's, or an earlier life's of
    this job, go as before. Another job's (by the job each names: jobs given one --checkpoint-dir) are never
    pruned: each job keeps its own ``keep``."""
    metas = {p: _metadata(p) for p in list_checkpoints(d)}  # each file's metadata read once
    files = [p for p, meta in metas.items() if not ckpt.job or _of_job(_job(meta), ckpt.job)]
    idents = {p: _identity(metas[p], p) for p in files} if ckpt.lineage else {}
    own = sorted((p for p in files if (i := idents.get(p)) is not None and i[0] == ckpt.lineage),
                 key=lambda p: idents[p][2], reverse=True)[:keep]
    spared = {written, *files[:keep], *own}
    for old in files:
        ident = idents.get(old)
        if old in spared or (ident is not None and ident[0] != ckpt.lineage and (
                ident[1:] == tuple(ckpt.origin) or 0 < ckpt.born_unix_ns <= ident[1])):
            continue
        old.unlink(missing_ok=True)


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoint files in ``directory``, newest first (temporary files are not listed)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((p for p in d.glob(f"ckpt-*{SUFFIX}") if p.is_file()), key=lambda p: p.name, reverse=True)


def load(path: str | os.PathLike) -> Checkpoint:
    """Load and verify one checkpoint; raise CorruptCheckpoint if it cannot be trusted."""
    import torch
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") not in _READABLE:
                raise CorruptCheckpoint(f"{path}: not a psd checkpoint (format {meta.get('format')!r})")
            spec = decode_spec(meta["spec"].encode())
            weights = {p.name: f.get_tensor(p.name) for p in spec}
            optstate = f.get_tensor(OPTSTATE) if OPTSTATE in f.keys() else None
            pieces = f.get_tensor(PIECES) if PIECES in f.keys() else None
    except CorruptCheckpoint:
        raise
    except Exception as e:  # safetensors raises its own error types for torn files
        raise CorruptCheckpoint(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    for p in spec:
        dtype = torch.float64 if p.kind == "buffer" else torch.float32
        if tuple(weights[p.name].shape) != p.shape or weights[p.name].dtype != dtype:
            raise CorruptCheckpoint(f"{path}: tensor {p.name!r} does not match the spec")
    if _digest(weights, spec) != meta.get("sha256"):
        raise CorruptCheckpoint(f"{path}: checksum mismatch (the file is damaged)")
    if optstate is not None and \
            hashlib.sha256(optstate.contiguous().numpy().tobytes()).hexdigest() != meta.get("optstate_sha256"):
        raise CorruptCheckpoint(f"{path}: optimizer-state checksum mismatch (the file is damaged)")
    if pieces is not None and \
            hashlib.sha256(pieces.contiguous().numpy().tobytes()).hexdigest() != meta.get("pieces_sha256"):
        raise CorruptCheckpoint(f"{path}: per-tensor state checksum mismatch (the file is damaged)")
    return Checkpoint(weights, spec, int(meta["clock"]), int(meta["generation"]), json.loads(meta["ranks"]),
                      json.loads(meta["config"]), json.loads(meta["counters"]), meta.get("job", ""),
                      int(meta["created_unix_ns"]), path, optim=json.loads(meta.get("optim", "{}")),
                      optstate=optstate, pieces=pieces, evicted=_evicted_meta(meta.get("evicted", "[]"), path),
                      lineage=_lineage(meta, path))


def _evicted_meta(text: str, path: Path) -> list[dict]:
    """A checkpoint's eviction records, checked (the file's checksum covers the weights, not the metadata)."""
    try:
        records = json.loads(text)
        if not isinstance(records, list) or not all(
                isinstance(r, dict) and all(isinstance(r.get(k), int) for k in EVICTED_FIELDS) for r in records):
            raise ValueError("not a list of eviction records")
    except ValueError as e:
        raise CorruptCheckpoint(f"{path}: its eviction records are malformed ({e})") from None
    return records


def _lineage(meta: dict, path: Path) -> int:
    try:
        return int(meta.get("lineage") or 0)
    except ValueError:
        raise CorruptCheckpoint(f"{path}: its lineage is malformed") from None


def _metadata(path: str | os.PathLike) -> dict | None:
    """A checkpoint file's metadata alone, without its tensors (None if it cannot be read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # torn, foreign or malformed: load() says which, where it is read
        return None


def _identity(meta: dict | None, path: str | os.PathLike) -> tuple[int, int, int] | None:
    if meta is None:
        return None
    try:
        return _lineage(meta, Path(path)), int(meta["created_unix_ns"]), int(meta["clock"])
    except (CorruptCheckpoint, KeyError, ValueError):  # malformed: load() says which, where it is read
        return None


def identity_of(path: str | os.PathLike) -> tuple[int, int, int] | None:
    """A checkpoint file's lineage, creation time and clock, from its metadata alone (None if it cannot be read):
    what says whose it is, whatever the file is named."""
    return _identity(_metadata(path), path)


def lineage_of(path: str | os.PathLike) -> int | None:
    """A checkpoint file's lineage, from its metadata alone (None if it cannot be read)."""
    ident = identity_of(path)
    return ident[0] if ident is not None else None


def _job(meta: dict | None) -> str | None:
    return None if meta is None else str(meta.get("job", ""))


def job_of(path: str | os.PathLike) -> str | None:
    """The job a checkpoint file was written by, from its metadata alone ("" for a file older than the field, None
    if it cannot be read)."""
    return _job(_metadata(path))


def _of_job(whose: str | None, job: str) -> bool:
    """Whether a file whose metadata names ``whose`` counts as ``job``'s: it names the job, or no job (older
    files), or cannot be read (load() says why, where it is read; pruning removes it as the job's)."""
    return whose in (job, "", None)


def latest(source: str | os.PathLike, lineage: int = 0, job: str = "", others: bool = True) -> Checkpoint | None:
    """The newest checkpoint in the directory ``source`` (or the file ``source``) that verifies; corrupt ones are
    skipped with a warning. With ``lineage``, only the job's of that lineage: another run's in the same directory
    is not the job's. With ``job`` (and a directory), the job's own newest: where jobs share a directory (a
    sweep's runs given one --checkpoint-dir), one's resume does not take another's newer checkpoint; where the
    job has none there (a job started from another's directory, or renamed), with ``others`` the directory's
    newest, else None."""
    path = Path(source)
    paths = [path] if path.is_file() else list_checkpoints(path)
    if job and not path.is_file():
        own = [p for p in paths if _of_job(job_of(p), job)]
        if len(own) < len(paths):
            ckpt = _newest(own, lineage)
            if ckpt is not None or not others:
                return ckpt
            ckpt = _newest([p for p in paths if p not in own], lineage)
            if ckpt is not None:
                log.warning("job %r has no checkpoint of its own in %s: taking the newest there (of job %r): %s",
                            job, source, ckpt.job, ckpt.path)
            return ckpt
    return _newest(paths, lineage)


def _newest(paths: list[Path], lineage: int) -> Checkpoint | None:
    """The first of ``paths`` (newest first) that verifies, and with ``lineage``, is of it."""
    for p in paths:
        theirs = lineage_of(p) if lineage else None
        if theirs not in (lineage, None):
            log.info("skipping checkpoint %s: another run's (lineage %s, not the job's %d)", p, theirs, lineage)
            continue
        try:
            ckpt = load(p)
        except CorruptCheckpoint as e:
            log.warning("skipping checkpoint: %s", e)
            continue
        if not lineage or ckpt.lineage == lineage:
            return ckpt
    return None
