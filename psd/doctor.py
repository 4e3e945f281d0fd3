"""`psd doctor`: check the machine before a job, and say what to change for each problem.

The checks are those behind the most common shared-memory training failures:
a small or full /dev/shm (the "Bus error" of pytorch#5247) and its page size, systemd-logind
removing a user's shared memory at logout (RemoveIPC), locks that do not
survive a dead owner, OpenMP that does not run, more busy threads than
cores, and a locked-memory limit too low to pin memory for GPU copies.
"""

from __future__ import annotations

import glob
import os
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass

from psd import __version__, _native
from psd.arena import SHM_DIR, list_jobs, open_job
from psd.errors import Error

__all__ = ["Check", "run_checks"]

_MIB = 1 << 20


@dataclass
class Check:
    """One finding: ``status`` is ok, warn or fail; ``fix`` says what to do about it."""

    status: str
    name: str
    detail: str
    fix: str = ""


def _shm(needed: int | None) -> Check:
    try:
        st = os.statvfs(SHM_DIR)
    except FileNotFoundError:
        return Check("fail", "shared memory", f"{SHM_DIR} does not exist",
                     f"mount a tmpfs there: `mount -t tmpfs -o size=8G tmpfs {SHM_DIR}`")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{SHM_DIR}: {size / _MIB:,.0f} MiB, {free / _MIB:,.0f} MiB free"
    grow = (f"enlarge it: `mount -o remount,size=16G {SHM_DIR}` (Docker: --shm-size=16g; Kubernetes: an "
            f"emptyDir with medium: Memory)")
    if needed is not None:
        detail += f"; this job needs {needed / _MIB:,.1f} MiB"
        if needed > free:
            return Check("fail", "shared memory", detail, grow)
    if size < 1024 * _MIB:
        return Check("warn", "shared memory", detail + " (small: container default?)", grow)
    return Check("ok", "shared memory", detail)


def _shm_huge_pages() -> Check:
    name = "huge pages for the arena"
    huge = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 4 and fields[1] == SHM_DIR:
                    opts = fields[3].split(",")
                    huge = next((o.split("=", 1)[1] for o in opts if o.startswith("huge=")), "never")
    except OSError:
        pass
    if huge is None:
        return Check("ok", name, f"{SHM_DIR} is not a mount of its own here; nothing to tune")
    if huge in ("always", "within_size"):
        return Check("ok", name, f"{SHM_DIR} is mounted huge={huge}: the arena is backed by 2 MiB pages")
    return Check("warn", name, f"{SHM_DIR} is mounted huge={huge}: the arena is backed by 4 KiB pages, and "
                 "large models (10^7 parameters and more) spend time on TLB misses",
                 f"for large models, `mount -o remount,huge=within_size {SHM_DIR}` before starting the server "
                 "(psd reserves the arena up front, so huge=advise does not apply to it)")


def _remove_ipc() -> Check:
    name = "systemd-logind RemoveIPC"
    if not os.path.isdir("/run/systemd/system"):
        return Check("ok", name, "systemd is not running here; nothing removes shared memory at logout")
    value = "yes (systemd's default)"
    for path in ["/etc/systemd/logind.conf", *sorted(glob.glob("/etc/systemd/logind.conf.d/*.conf"))]:
        try:
            for line in open(path):
                line = line.strip()
                if line.startswith("RemoveIPC="):
                    value = line.split("=", 1)[1].strip() + f" ({path})"
        except OSError:
            continue
    if value.startswith("no"):
        return Check("ok", name, f"RemoveIPC={value}")
    if os.getuid() < 1000:
        return Check("ok", name, f"RemoveIPC={value}, but it spares system users and root (uid {os.getuid()})")
    return Check("warn", name, f"RemoveIPC={value}: logging out removes this user's /dev/shm arenas",
                 "set RemoveIPC=no in /etc/systemd/logind.conf and `systemctl restart systemd-logind`, or run "
                 "psd as a system user")


def _robust_mutex() -> Check:
    name = "robust mutex self-test"
    shm = f"/psd.doctor-{os.getpid()}"
    try:
        a = _native.create(shm, 0o600, 1, 1, 4096, __version__)
    except OSError as e:
        return Check("fail", name, f"cannot create a test arena: {e}", "see the shared memory check")
    try:
        code = ("import os, sys; from psd import _native; a = _native.open(sys.argv[1]); "
                "a.hold_mutex('admission'); os._exit(0)")
        r = subprocess.run([sys.executable, "-c", code, shm], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return Check("fail", name, f"the child could not take the lock: {r.stderr.strip()[-200:]}")
        recovered = a.hold_mutex("admission")
        a.release_mutex("admission")
        if not recovered:
            return Check("fail", name, "a mutex whose owner died was not reported as recovered",
                         "this C library lacks robust process-shared mutexes; psd needs glibc >= 2.17")
        return Check("ok", name, "a lock held by a process that died was recovered (EOWNERDEAD)")
    except Error as e:
        return Check("fail", name, str(e), "psd needs robust process-shared mutexes (glibc on Linux)")
    finally:
        a.close()
        _native.unlink(shm)


def _openmp() -> Check:
    import numpy as np

    info = _native.omp_info()
    n = 1 << 20
    threads = max(1, min(2, info["max_threads"]))
    w = np.ones(n, dtype=np.float32)
    g = np.full(n, 2.0, dtype=np.float32)
    _native.apply_sgd(w, g, 0.25, threads)
    if not np.all(w == 0.5):
        return Check("fail", "OpenMP self-test", "the update kernel computed wrong values",
                     "rebuild psd (`pip install --force-reinstall -e .`) and report the compiler")
    return Check("ok", "OpenMP self-test", f"update kernel correct on {threads} thread(s); OpenMP sees "
                 f"{info['num_procs']} processors, max {info['max_threads']} threads")


def _cores(learners: int | None, threads: int | None) -> Check:
    cores = len(os.sched_getaffinity(0))
    if learners is None:
        return Check("ok", "cores", f"{cores} usable cores (pass --learners/--threads to check a job's plan)")
    from psd.server import auto_threads

    t = threads or auto_threads()
    busy = learners + t
    detail = f"{cores} usable cores for {learners} learners + {t} update thread(s)"
    if busy > cores:
        return Check("warn", "cores", detail + ": oversubscribed",
                     "give each learner one torch thread (psd run does: OMP_NUM_THREADS), or use fewer "
                     "learners; the update loop then naps between gradients instead of spinning, but gets "
                     "only its fair share of a core")
    return Check("ok", "cores", detail)


def _memlock(needed: int | None) -> Check:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    name = "locked memory (GPU pinning)"
    if os.getuid() == 0 or soft == resource.RLIM_INFINITY:
        return Check("ok", name, "unlimited" if soft == resource.RLIM_INFINITY else "root: not limited")
    want = needed or 1024 * _MIB
    detail = f"RLIMIT_MEMLOCK is {soft / _MIB:,.0f} MiB"
    if soft < want:
        return Check("warn", name, detail + f"; GPU learners pin the arena ({want / _MIB:,.0f} MiB)",
                     "raise it: `ulimit -l unlimited`, or memlock in /etc/security/limits.conf (Docker: "
                     "--ulimit memlock=-1); CPU-only jobs do not need it")
    return Check("ok", name, detail)


def _liveness() -> Check:
    """Which way the server will tell a dead learner: /proc where it can, else the lease."""
    name = "learner liveness"
    if os.environ.get("PSD_LIVENESS") == "lease":
        return Check("ok", name, "the lease only (PSD_LIVENESS=lease): a learner is dead once its heartbeat stood "
                     "still for --lease seconds")
    if not _native.pid_ns():
        return Check("warn", name, "/proc/self/ns/pid is unreadable (no /proc?): every learner is judged by its "
                     "lease, so a dead one's slot is freed only after --lease seconds",
                     "mount /proc to get the fast path, or keep --lease short")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = _native.proc_start_time(child.pid)
        seen = _native.liveness(child.pid, start, _native.pid_ns(), False)
    finally:
        child.communicate(b"", timeout=30)
    hidden = ""
    try:
        with open("/proc/mounts") as f:
            opts = [line.split()[3] for line in f if line.split()[1:2] == ["/proc"]]
        if any("hidepid=" in o and "hidepid=0" not in o and "hidepid=off" not in o for o in opts):
            hidden = "; /proc is mounted hidepid, so other users' learners fall back to the lease"
    except OSError:
        pass
    if seen != "alive":
        return Check("warn", name, f"/proc cannot show a child of this process ({seen}): learners are judged by "
                     "their lease (--lease seconds after their last heartbeat)",
                     "check how /proc is mounted (hidepid, a foreign PID namespace)")
    return Check("ok", name, "/proc (pid + start time) for learners in this PID namespace, at once; the lease "
                 f"(--lease, 5 s by default) for learners in other PID namespaces or hidden by /proc{hidden}")


def _stale_arenas() -> Check:
    dead = []
    for job in list_jobs():
        try:
            a = open_job(job, settle=0.2, role="reader")
        except Error:
            dead.append(job)
            continue
        try:
            if not a.server_alive():
                dead.append(job)
        finally:
            a.close()
    if dead:
        return Check("warn", "stale arenas", f"arenas of dead servers: {', '.join(dead)}",
                     "remove them with `psd clean` (or restart their jobs with `psd serve --job NAME`)")
    return Check("ok", "stale arenas", f"{len(list_jobs())} arena(s), none stale")


def run_checks(learners: int | None = None, threads: int | None = None, params: int | None = None,
               ring_depth: int = 4) -> list[Check]:
    """Every check, in order. ``params`` (and learners) size the arena the job would need."""
    needed = None
    if params:
        from psd.server import SPEC_CAPACITY

        needed = _native.arena_size(learners or 8, ring_depth, SPEC_CAPACITY, params)
    return [_shm(needed), _shm_huge_pages(), _remove_ipc(), _robust_mutex(), _openmp(), _cores(learners, threads),
            _memlock(needed), _liveness(), _stale_arenas()]


def as_dicts(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
