"""What a job is doing, read straight from its arena: for `psd status`, `psd top` and the metrics.

Everything here reads the arena header and slots directly, never asks the
server, so it works the same against a live, a hung or a dead server.
"""

from __future__ import annotations

import math
import time
from typing import Any, TypedDict

from psd import _native
from psd.arena import EVICTION_RULES, Header, SlotInfo, list_jobs, open_job, shm_path
from psd.errors import Error

__all__ = ["STATES", "EvictedStatus", "JobStatus", "LearnerStatus", "all_jobs", "format_job", "job_status",
           "stale_bucket_label"]

STATES = {1: "waiting for a model", 2: "model offered", 3: "loading weights", 4: "ready", 5: "stopped"}
LIVENESS_METHODS = {_native.LIVE_BY_PROC: "proc", _native.LIVE_BY_LEASE: "lease"}  # how the reaper judged a slot


def stale_bucket_label(i: int) -> str:
    """The staleness values histogram bucket ``i`` counts."""
    if i == 0:
        return "0"
    lo, hi = 1 << (i - 1), (1 << i) - 1
    return str(lo) if lo == hi else (f"{lo}-{hi}" if i < 15 else f">={lo}")


class LearnerStatus(TypedDict):
    """One attached learner in ``JobStatus["learners"]`` (its slot's record, and its own figures)."""

    slot: int
    pid: int
    rank: int
    alive: bool
    liveness: str | None
    state: str
    pushed: int
    applied: int
    rejected: int
    dropped: int
    ignored: int
    queued: int
    clock: int
    pulls: int
    pulls_skipped: int
    staleness_mean: float
    staleness_max: int
    last_loss: float | None


class EvictedStatus(TypedDict):
    """One evicted learner in ``JobStatus["evicted_learners"]``."""

    slot: int
    pid: int
    rule: str
    entries_taken: int
    age_s: float


class JobStatus(TypedDict, total=False):
    """What ``job_status`` gives (and ``psd status --json`` prints): a key it may leave out is marked so below
    (the optimizer, sync mode and schedule only once the job is READY; a job that cannot be read is
    ``{"job", "arena", "error"}`` in ``all_jobs``)."""

    job: str
    arena: str
    error: str  # all_jobs: this job could not be read
    psd_version: str
    state: str
    server_pid: int
    server_alive: bool
    server_uptime_s: float | None
    heartbeat_age_s: float
    watchdog_pid: int
    watchdog_alive: bool
    generation: int
    server_restarts: int
    n_params: int
    lr: float
    lr_now: float
    optimizer: str  # Arena.training(): once READY
    sync: str
    schedule: str
    sync_param: int
    push_every: int
    staleness_lr: bool
    predict: bool
    overlap: str  # --overlap: auto, on, off
    waits_for_own: bool  # what --overlap comes to for this job's CPU learners: a step waits for its own update
    grad_dtype: str
    max_staleness: int | None
    opt_steps: int
    rounds: int
    learner_slots: int
    ring_entries: int
    arena_bytes: int
    pushed: int  # Arena.counters()
    applied: int
    rejected: int
    dropped: int
    ignored: int
    pending: int
    clock: int
    active_learners: int
    applied_per_s: float | None
    model_traffic_gbs: float | None
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict[str, int]
    reclaimed_slots: int
    liveness: str
    lease_s: float
    lock_recoveries: int
    checkpoint_clock: int | None
    checkpoint_age_s: float | None
    learners: list[LearnerStatus]
    evicted_learners: list[EvictedStatus]
    node_link: dict[str, Any] | None


def _snapshot(a: _native.Arena) -> tuple[Header, dict[str, int], list[SlotInfo]]:
    if a.state == _native.ARENA_READY:
        a.remap()
    h = Header.read(a)
    slots = [SlotInfo.read(a, i) for i in range(h.n_slots)] if a.state == _native.ARENA_READY else []
    return h, a.counters(), slots


def job_status(job: str, sample: float = 0.0) -> JobStatus:
    """The job's figures as a dict; with ``sample`` > 0, rates measured over that many seconds."""
    a = open_job(job, role="reader")
    try:
        h, c, slots = _snapshot(a)
        rate = pull_rate = None
        if sample > 0:
            t0 = time.monotonic()
            time.sleep(sample)  # a measurement window: the arena keeps counters, not rates
            h2, c2, slots2 = _snapshot(a)
            dt = time.monotonic() - t0
            rate = (h2.applied - h.applied) / dt
            pulls = sum(s.pulls for s in slots2) - sum(s.pulls for s in slots)
            pull_rate = max(0.0, pulls / dt)
            h, c, slots = h2, c2, slots2
        now_ns = time.time_ns()
        lease_only = bool(h.cfg_flags & _native.CFG_LEASE_ONLY)
        out: JobStatus = {
            "job": job,
            "arena": shm_path(job),
            "psd_version": h.psd_version,
            "state": STATES.get(h.state, str(h.state)),
            "server_pid": h.server_pid,
            "server_alive": a.server_alive(),
            "server_uptime_s": round((now_ns - h.server_started_unix_ns) / 1e9, 1)
            if h.server_started_unix_ns else None,
            "heartbeat_age_s": round(h.heartbeat_age_s, 3),
            "watchdog_pid": h.watchdog_pid,
            "watchdog_alive": _native.owner_alive(h.watchdog_pid, h.watchdog_start_time),
            "generation": h.generation,
            "server_restarts": h.server_restarts,
            "n_params": h.n_params,
            "lr": h.lr,
            "lr_now": h.lr_now,
            **(a.training() if h.state >= _native.ARENA_READY else {}),
            "sync_param": h.sync_param,
            "push_every": h.push_every,
            "staleness_lr": bool(h.cfg_flags & _native.CFG_STALENESS_LR),
            "predict": bool(h.cfg_flags & _native.CFG_PREDICT),
            "overlap": "on" if h.cfg_flags & _native.CFG_OVERLAP else "off" if h.cfg_flags & _native.CFG_NO_OVERLAP
            else "auto",
            "waits_for_own": h.learners_wait_for_their_own,
            "grad_dtype": "bf16" if h.cfg_flags & _native.CFG_GRAD_BF16 else "float32",
            "max_staleness": None if h.max_staleness >= (1 << 63) else h.max_staleness,
            "opt_steps": h.opt_steps,
            "rounds": h.rounds,
            "learner_slots": h.n_slots,
            "ring_entries": h.ring_k,
            "arena_bytes": h.total_size,
            **c,
            "applied_per_s": None if rate is None else round(rate, 1),
            # GaDei's measure of model traffic: gradients in plus weights out, 4 bytes a parameter.
            "model_traffic_gbs": None if rate is None else round((rate + pull_rate) * h.n_params * 4 / 1e9, 3),
            "staleness_mean": (h.staleness_sum / h.applied) if h.applied else 0.0,
            "staleness_max": h.staleness_max,
            "staleness_hist": {stale_bucket_label(i): n for i, n in enumerate(h.staleness_hist) if n},
            "reclaimed_slots": h.reclaimed,
            "liveness": "lease" if lease_only else "auto",
            "lease_s": h.lease_ms / 1000,
            "lock_recoveries": h.lock_recoveries,
            "checkpoint_clock": h.checkpoint_clock if h.checkpoint_unix_ns else None,
            "checkpoint_age_s": round((now_ns - h.checkpoint_unix_ns) / 1e9, 1) if h.checkpoint_unix_ns else None,
            "learners": [],
            "node_link": _node_link(job, h),
        }
        k = h.ring_k
        out["evicted_learners"] = []
        for i, s in enumerate(slots):
            if s.state == _native.SLOT_EVICTED:
                out["evicted_learners"].append({
                    "slot": i, "pid": s.evicted_pid,
                    "rule": EVICTION_RULES.get(s.evicted_rule, f"rule {s.evicted_rule}"),
                    "entries_taken": s.evicted_entries,
                    "age_s": round(max(0, now_ns - s.evicted_unix_ns) / 1e9, 1),
                })
                continue
            if s.state not in (_native.SLOT_ACTIVE, _native.SLOT_DRAINING):
                continue
            # Everything here is the server's record of the slot; the learner's own words (its tail, its pull
            # figures) only where they are its business, and its tail only as far as the ring holds.
            waiting = (s.tail - s.head) % (1 << 64)
            waiting = waiting if waiting <= k else 0
            out["learners"].append({
                "slot": i, "pid": s.pid, "rank": s.rank,
                # /proc where it can tell; else (another PID namespace, hidepid) the server's lease decides
                "alive": _native.liveness(s.pid, s.start_time, s.pid_ns, lease_only) != "dead",
                "liveness": LIVENESS_METHODS.get(s.liveness),
                "state": "active" if s.state == _native.SLOT_ACTIVE else "draining",
                "pushed": s.head + waiting, "applied": s.applied, "rejected": s.rejected,
                "dropped": s.dropped, "ignored": s.ignored, "queued": waiting, "clock": s.learner_clock,
                "pulls": s.pulls, "pulls_skipped": s.pulls_skipped,
                "staleness_mean": s.staleness_sum / s.applied if s.applied else 0.0,
                "staleness_max": s.staleness_max,
                "last_loss": s.last_loss if math.isfinite(s.last_loss) else None,  # None: none reported
            })
        return out
    finally:
        a.close()


def _node_link(job: str, h: Header) -> dict[str, Any] | None:
    """The node link's state file (--nnodes > 1), if it belongs to this run of the job."""
    from psd.nodelink import read_state

    st = read_state(job)
    if st is None or (not st["alive"] and st.get("last_exchange_unix", 0) * 1e9 < h.server_started_unix_ns):
        return None
    st["hold_clock"] = h.hold_clock
    return st


def all_jobs(sample: float = 0.0) -> list[JobStatus]:
    """Status of every job on the machine; a job that cannot be read says why."""
    out = []
    for job in list_jobs():
        try:
            out.append(job_status(job, sample))
        except Error as e:
            out.append({"job": job, "arena": shm_path(job), "error": str(e)})
    return out


def format_job(j: JobStatus) -> str:
    """The human-readable block `psd status` and `psd top` print for one job."""
    if "error" in j:
        return f"job {j['job']}: {j['error']}"
    server = f"server pid {j['server_pid']} ({'alive' if j['server_alive'] else 'DEAD'}"
    if j["server_alive"] and j["heartbeat_age_s"] > 0.5:  # it beats at least every 0.1 s
        server += f", no heartbeat for {j['heartbeat_age_s']:.1f} s: HUNG?"
    server += ")"
    wd = f"watchdog pid {j['watchdog_pid']} ({'alive' if j['watchdog_alive'] else 'dead'})" \
        if j["watchdog_pid"] else "no watchdog"
    lines = [f"job {j['job']}: {j['state']}, {server}, {wd}, generation {j['generation']}, "
             f"up {j['server_uptime_s'] or 0:.0f} s"]
    rate = f"  {j['applied_per_s']:,.0f} grad/s  {j['model_traffic_gbs']:.3f} GB/s" if j["applied_per_s"] is not None \
        else ""
    lines.append(f"  {j['n_params']:,} parameters  lr {j['lr']:g}  clock {j['clock']}{rate}")
    if "optimizer" in j:
        sync = j["sync"] + (f":{j['sync_param']}" if j["sync"] in ("ssp", "kasync") else "")
        extras = [f"push-every {j['push_every']}"] * (j["push_every"] > 1) + ["staleness-lr"] * j["staleness_lr"] \
            + [f"max-staleness {j['max_staleness']}"] * (j["max_staleness"] is not None) + ["predict"] * j["predict"] \
            + ["grad-dtype bf16"] * (j["grad_dtype"] == "bf16") \
            + [f"overlap {'off' if j['waits_for_own'] else 'on'}{' (auto)' * (j['overlap'] == 'auto')}"] \
            * (j["sync"] in ("asp", "ssp"))
        lines.append(f"  {j['optimizer']} ({j['schedule']} schedule, lr now {j['lr_now']:g}, {j['opt_steps']} "
                     f"updates)  sync {sync}" + "".join(f"  {e}" for e in extras))
    lines.append(f"  pushed {j['pushed']}  applied {j['applied']}  rejected {j['rejected']} (non-finite)  dropped "
                 f"{j['dropped']} (stale)  ignored {j['ignored']} (old claim)  pending {j['pending']}  "
                 f"staleness mean {j['staleness_mean']:.2f} "
                 f"max {j['staleness_max']}")
    if j["staleness_hist"]:
        lines.append("  staleness histogram: " + "  ".join(f"{k}:{v}" for k, v in j["staleness_hist"].items()))
    ck = f"clock {j['checkpoint_clock']}, {j['checkpoint_age_s']:.0f} s ago" if j["checkpoint_clock"] is not None \
        else "none yet"
    lines.append(f"  last checkpoint: {ck}   slots reclaimed {j['reclaimed_slots']}  "
                 f"server restarts {j['server_restarts']}  liveness {j['liveness']} (lease {j['lease_s']:g} s)")
    n = j.get("node_link")
    if n:
        ago = f"{time.time() - n['last_exchange_unix']:.1f} s ago" if n["last_exchange_unix"] else "none yet"
        lines.append(f"  node {n['node_rank']} of {n['nnodes']}: link pid {n['pid']} "
                     f"({n['state'] if n['alive'] else 'DEAD'}), peers {n['peers']}, epoch {n['epoch']}, round "
                     f"{n['round']}, last exchange {ago} ({n['last_exchange_ms']:.1f} ms), "
                     f"{n['bytes_sent'] / 1e6:.3f} MB sent, lag {n['lag']} of {n['max_node_lag']}")
    if j["learners"]:
        lines.append(f"  {'slot':>4} {'rank':>4} {'pid':>7} {'state':8} {'by':5} {'pushed':>8} {'queued':>6} "
                     f"{'rejected':>8} {'dropped':>7} {'clock':>8} {'stale':>6} {'loss':>8}")
        for s in j["learners"]:
            state = s["state"] if s["alive"] else "dead"
            lines.append(f"  {s['slot']:>4} {s['rank']:>4} {s['pid']:>7} {state:8} {s['liveness'] or '-':5} "
                         f"{s['pushed']:>8} "
                         f"{s['queued']:>6} {s['rejected']:>8} {s['dropped']:>7} {s['clock']:>8} "
                         f"{s['staleness_mean']:>6.2f} "
                         + (f"{s['last_loss']:>8.4f}" if s["last_loss"] is not None else f"{'n/a':>8}"))
    for e in j.get("evicted_learners", []):
        lines.append(f"  slot {e['slot']}: EVICTED pid {e['pid']} {e['age_s']:g} s ago: {e['rule']} (that process "
                     f"gets no slot again; the slot is free once it exits)")
    return "\n".join(lines)
