"""What every benchmark records beside its figures, and how it puts its files in place.

- :func:`machine`: the machine a run measured (CPU model, cores, last-level cache, memory, Python, torch,
  psd, the date and the load), so that a figure quoted in the README can say where it comes from;
- :func:`command_line`: the command that produced the run, as a user would type it again;
- :class:`Staged` (:func:`staged`): a run's output files are written into a staging directory beside the
  results and moved over them only once every file (tables, JSON, plots) has been written: a run that
  fails, or is interrupted, leaves the results that were there untouched;
- :func:`require_matplotlib`: a script that draws plots checks for matplotlib before it measures
  anything, not after.

Every script under ``benchmarks/`` that writes into ``benchmarks/results/`` uses these.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["MACHINE_FIELDS", "RESULTS", "Staged", "command_line", "machine", "machine_line", "require_matplotlib",
           "staged", "write_results"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"  # where the README's figures are regenerated
# What machine() always returns (a value it cannot read is None, never a missing key).
MACHINE_FIELDS = ("cpu_model", "cpus", "cpus_usable", "llc_bytes", "llc_source", "memory_bytes", "python", "torch",
                  "psd", "platform", "date", "load_average", "niceness")


def _cpu_model(cpuinfo: Path) -> str | None:
    """The CPU's name from /proc/cpuinfo ("model name" on x86, else "Processor", "cpu model" or "Hardware")."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return platform.processor() or None
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            found.setdefault(key.strip().lower(), value.strip())
    for key in ("model name", "processor name", "cpu model", "hardware", "uarch"):
        if key in found:
            return found[key]
    return platform.processor() or None


def _memory_bytes(meminfo: Path) -> int | None:
    """MemTotal from /proc/meminfo, in bytes."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                value, *unit = line.split(":", 1)[1].split()
                return int(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    except (OSError, ValueError):
        pass
    return None


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def machine(cpuinfo: str | os.PathLike = "/proc/cpuinfo", meminfo: str | os.PathLike = "/proc/meminfo",
            cache_root: str | os.PathLike | None = None) -> dict[str, Any]:
    """The machine this process runs on: every key of :data:`MACHINE_FIELDS` (None where it cannot be read).

    ``cpus`` is ``os.cpu_count()``; ``cpus_usable`` the CPUs this process may run on (its affinity: a
    container or ``taskset`` may give fewer). ``llc_bytes`` is the last-level cache from sysfs, as
    ``psd bench`` reads it (``llc_source`` says where it came from, or that it is a default).
    """
    from psd import __version__
    from psd.bench.kernels import CACHE_SYSFS, last_level_cache

    llc = last_level_cache(cache_root if cache_root is not None else CACHE_SYSFS)
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    try:
        niceness: int | None = os.nice(0)
    except OSError:
        niceness = None
    return {
        "cpu_model": _cpu_model(Path(cpuinfo)),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "llc_bytes": None if llc.fallback else llc.bytes,
        "llc_source": llc.source,
        "memory_bytes": _memory_bytes(Path(meminfo)),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "psd": __version__,
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": load,  # 1, 5 and 15 minutes, when the run started: how busy the machine was
        "niceness": niceness,  # of this process (`nice -n 10` runs at 10): its share of a busy machine
    }


def machine_line(m: dict[str, Any] | None) -> str:
    """``m`` (a :func:`machine` record) in one line, for a results table's heading."""
    if not m:
        return "machine not recorded (a run from before psd recorded it)"
    cpus = f"{m.get('cpus')} CPUs" + (f" ({m['cpus_usable']} usable)" if m.get("cpus_usable") not in (None,
                                                                                                      m.get("cpus"))
                                      else "")
    llc = f"{m['llc_bytes'] / (1 << 20):g} MiB last-level cache" if m.get("llc_bytes") else "last-level cache unknown"
    mem = f"{m['memory_bytes'] / (1 << 30):.1f} GiB memory" if m.get("memory_bytes") else "memory unknown"
    load = f", load average {' / '.join(f'{x:g}' for x in m['load_average'])}" if m.get("load_average") else ""
    load += f", run at niceness {m['niceness']}" if m.get("niceness") else ""
    return (f"{m.get('cpu_model') or 'CPU unknown'}, {cpus}, {llc}, {mem}; Python {m.get('python')}, "
            f"torch {m.get('torch')}, psd {m.get('psd')}; {m.get('date')}{load}")


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as it would be typed again from the repository's root:
    ``python benchmarks/x.py --flag ...``."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        script = Path(argv[0])
        try:
            argv[0] = str(script.resolve().relative_to(ROOT))
        except ValueError:
            pass
    return shlex.join(["python", *argv])


def require_matplotlib(script: str, results: str | os.PathLike = "benchmarks/results") -> None:
    """Exit, before anything is measured, when matplotlib (the ``bench`` extra) is missing: ``script``
    draws plots and would otherwise fail only after its run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(f"{script}: matplotlib is not installed, and this run ends by drawing its plots; "
                         f"install it with `pip install -e '.[bench]'` and run again. Nothing was measured and "
                         f"{results} is as it was.") from None


class Staged:
    """The output files of one run, written into a staging directory inside ``out`` and moved over the
    files of the same names in ``out`` only by :meth:`commit`; :meth:`discard` removes them instead.

    The staging directory lies in ``out`` itself, so that each move is a rename within one file system
    (a file is replaced whole, never seen half written).
    """

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.out))
        self.names: list[str] = []

    def path(self, name: str) -> Path:
        """Where to write the file that becomes ``out/name`` (for writers that take a path, as savefig)."""
        if Path(name).name != name:
            raise ValueError(f"{name!r}: give a file name, not a path; the file goes into {self.out}")
        if name not in self.names:
            self.names.append(name)
        return self.dir / name

    def write_text(self, name: str, text: str) -> Path:
        """Stage ``text`` as ``out/name``."""
        p = self.path(name)
        p.write_text(text, encoding="utf-8")
        return p

    def commit(self) -> list[Path]:
        """Move every staged file into ``out`` (each replacing its namesake at once); the final paths."""
        missing = [n for n in self.names if not (self.dir / n).exists()]
        if missing:
            self.discard()
            raise RuntimeError(f"staged files never written: {', '.join(missing)}; {self.out} is as it was")
        done = []
        for n in self.names:
            os.replace(self.dir / n, self.out / n)
            done.append(self.out / n)
        shutil.rmtree(self.dir, ignore_errors=True)
        return done

    def discard(self) -> None:
        """Remove the staging directory and whatever was written into it."""
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def staged(out: str | os.PathLike) -> Iterator[Staged]:
    """A :class:`Staged` for ``out``, committed when the block ends normally and discarded when it raises
    (an interrupt included), so that ``out`` holds either all of the new files or none of them."""
    s = Staged(out)
    try:
        yield s
    except BaseException:
        s.discard()
        raise
    s.commit()


def write_results(out: str | os.PathLike, name: str, result: dict[str, Any], markdown: str) -> list[Path]:
    """``result`` as ``out/name.json`` and ``markdown`` as ``out/name.md``: both replace their namesakes
    together once both are written, or neither does. ``result`` should carry ``machine`` and ``command``."""
    import json

    with staged(out) as s:
        s.write_text(f"{name}.json", json.dumps(result, indent=1, allow_nan=False) + "\n")
        s.write_text(f"{name}.md", markdown)
    return [Path(out) / f"{name}.json", Path(out) / f"{name}.md"]
