"""The ``psd`` command line: ``psd serve``, ``psd run``, ``psd status``, ``psd clean``.

Shape follows torch's distributed/run.py: get_args_parser() -> parse_args()
-> a config object -> run(config). Every flag can also come from a
PSD_<FLAG> environment variable (flag in upper case, dashes as underscores).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from psd import __version__, _native
from psd.arena import default_job, list_jobs, open_job, shm_name, shm_path
from psd.errors import Error
from psd.server import ServeConfig, Server

__all__ = ["get_args_parser", "main"]


def _env(flag: str, default, kind=str):
    """Default for --flag: $PSD_FLAG if set, else ``default``."""
    raw = os.environ.get("PSD_" + flag.upper().replace("-", "_"))
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"psd: PSD_{flag.upper().replace('-', '_')}={raw!r} is not a valid {kind.__name__}") from None


def get_args_parser() -> argparse.ArgumentParser:
    """The parser for every psd subcommand."""
    p = argparse.ArgumentParser(prog="psd", description="psd: a shared-memory parameter server.")
    p.add_argument("--version", action="version", version=f"psd {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("serve", help="run a job's server under a watchdog", description=(
        "Create the job's arena in /dev/shm and apply the gradients its learners push. "
        "The model comes from the first learner to attach, from --init, or from a checkpoint (--resume). "
        "A watchdog restarts the server if it dies or hangs and writes checkpoints. Stop with Ctrl-C or "
        "SIGTERM: a last checkpoint is written and the arena removed. SIGUSR1 asks for a checkpoint now."))
    _serve_flags(s)
    s.add_argument("--no-watchdog", action="store_true",
                   help="run the bare server in this process, without restarts or checkpoints")
    s.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")

    r = sub.add_parser("run", help="launch a whole job: watchdog, server and N learners (like torchrun)",
                       description="Start the watchdog and server, then N copies of COMMAND as learners "
                       "(PSD_JOB, PSD_RANK, PSD_WORLD tell each its job and rank). A learner that dies is "
                       "restarted alone; so is the server. Exits with the learners' status.",
                       usage="psd run --learners N [serve options] -- COMMAND [ARGS...]")
    _serve_flags(r)
    r.add_argument("--max-restarts", type=int, default=_env("max-restarts", 5, int),
                   help="a learner that dies this many times in a row without progress fails the job "
                        "(default: %(default)s)")
    r.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    r.add_argument("learner_command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the learner command, after --")

    st = sub.add_parser("status", help="show a job's counters and learners, read from its arena")
    st.add_argument("--job", default=_env("job", None), help="job name (default: every job)")
    st.add_argument("--json", action="store_true", help="machine-readable output")

    c = sub.add_parser("clean", help="remove arenas whose server is dead")
    c.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    return p


def _serve_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--job", default=_env("job", default_job()), help="job name (default: %(default)s)")
    s.add_argument("--learners", type=int, default=_env("learners", 8, int),
                   help="learner slots: how many learners may attach at once (default: %(default)s)")
    s.add_argument("--lr", type=float, default=_env("lr", 0.01, float),
                   help="learning rate of the update w -= lr*g (default: %(default)s)")
    s.add_argument("--slots", type=int, default=_env("slots", 4, int),
                   help="ring entries per learner, a power of two (default: %(default)s)")
    s.add_argument("--threads", type=int, default=_env("threads", 0, int),
                   help="update-loop threads; 0 = a quarter of the cores, 1..8 (default: %(default)s)")
    s.add_argument("--spin-us", type=int, default=_env("spin-us", 50, int),
                   help="how long the update loop spins for more work before sleeping (default: %(default)s)")
    s.add_argument("--init", default=_env("init", None),
                   help="start from these weights (.safetensors) instead of the first learner's")
    s.add_argument("--resume", nargs="?", const="", default=_env("resume", None), metavar="DIR",
                   help="start from the newest valid checkpoint in DIR (default: the checkpoint dir)")
    s.add_argument("--checkpoint-dir", default=_env("checkpoint-dir", None),
                   help="where checkpoints go (default: the --resume DIR, else ~/.local/state/psd/checkpoints/JOB)")
    s.add_argument("--checkpoint-every", type=float, default=_env("checkpoint-every", 60.0, float),
                   help="seconds between checkpoints; 0: only on demand and at stop (default: %(default)s)")
    s.add_argument("--keep", type=int, default=_env("keep", 3, int),
                   help="checkpoints to keep (default: %(default)s)")
    s.add_argument("--heartbeat-timeout", type=float, default=_env("heartbeat-timeout", 2.0, float),
                   help="restart a server whose heartbeat is older than this, in seconds (default: %(default)s)")


def _watchdog_config(args: argparse.Namespace):
    from psd.watchdog.supervisor import WatchdogConfig

    ckpt_dir = args.checkpoint_dir or args.resume or None
    serve = ServeConfig(job=args.job, learners=args.learners, lr=args.lr, slots=args.slots,
                        threads=args.threads, spin_us=args.spin_us, init=args.init,
                        resume=None if args.resume is None else (ckpt_dir or ""))
    try:
        serve.validate()
        if args.keep < 1:
            raise ValueError(f"--keep must be 1 or more, not {args.keep}")
        if args.heartbeat_timeout <= 0 or args.checkpoint_every < 0:
            raise ValueError("--heartbeat-timeout must be positive and --checkpoint-every 0 or more")
    except ValueError as e:
        raise SystemExit(f"psd {args.command}: {e}") from None
    cfg = WatchdogConfig(serve, Path(ckpt_dir) if ckpt_dir else None, args.checkpoint_every, args.keep,
                         args.heartbeat_timeout)
    if serve.resume == "":
        serve.resume = str(cfg.ckpt_dir)
    return cfg


def _logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format=f"%(asctime)s psd {args.command}[%(process)d]: %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    _logging(args)
    cfg = _watchdog_config(args)
    if args.no_watchdog:
        return serve_bare(cfg.serve)
    from psd.watchdog.supervisor import serve_forever

    return serve_forever(cfg)


def _run(args: argparse.Namespace) -> int:
    from psd.watchdog.launcher import Launcher

    _logging(args)
    command = args.learner_command[1:] if args.learner_command[:1] == ["--"] else args.learner_command
    if not command:
        raise SystemExit("psd run: give the learner command after --, e.g. "
                         "`psd run --learners 4 -- python train.py`")
    return Launcher(_watchdog_config(args), command, max_restarts=args.max_restarts).run()


def serve_bare(cfg: ServeConfig) -> int:
    """The server alone (what the watchdog runs): until SIGINT/SIGTERM, or SIGUSR2 to hand over."""
    stop = threading.Event()
    handover = threading.Event()

    def on_signal(signum, frame):
        if signum == signal.SIGUSR2:
            handover.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, on_signal)
    server = Server(cfg)
    try:
        server.start()
        server.run(stop)
    finally:
        server.stop(remove=not handover.is_set())
    return 0


def _job_status(job: str) -> dict:
    a = open_job(job)
    try:
        if a.state == _native.ARENA_READY:
            a.remap()
        h = a.header()
        out = {
            "job": job,
            "arena": shm_path(job),
            "psd_version": h["psd_version"],
            "state": {1: "waiting for a model", 2: "model offered", 3: "loading weights", 4: "ready",
                      5: "stopped"}.get(h["state"], str(h["state"])),
            "server_pid": h["server_pid"],
            "server_alive": a.server_alive(),
            "generation": h["generation"],
            "heartbeat_age_s": round(h["heartbeat_age_s"], 3),
            "n_params": h["n_params"],
            "lr": h["lr"],
            "learner_slots": h["n_slots"],
            "ring_entries": h["ring_k"],
            "arena_bytes": h["total_size"],
            **a.counters(),
            "staleness_mean": (h["staleness_sum"] / h["applied"]) if h["applied"] else 0.0,
            "staleness_max": h["staleness_max"],
            "reclaimed_slots": h["reclaimed"],
            "learners": [],
        }
        if a.state == _native.ARENA_READY:
            for i in range(h["n_slots"]):
                s = a.slot_info(i)
                if s["state"] != _native.SLOT_FREE:
                    out["learners"].append({
                        "slot": i, "pid": s["pid"],
                        "state": "active" if s["state"] == _native.SLOT_ACTIVE else "draining",
                        "pushed": s["tail"], "applied": s["applied"], "queued": s["tail"] - s["head"],
                        "clock": s["learner_clock"], "pulls": s["pulls"], "pulls_skipped": s["pulls_skipped"],
                        "staleness_mean": s["staleness_sum"] / s["applied"] if s["applied"] else 0.0,
                        "last_loss": s["last_loss"],
                    })
        return out
    finally:
        a.close()


def _status(args: argparse.Namespace) -> int:
    jobs = [args.job] if args.job else list_jobs()
    out = []
    for job in jobs:
        try:
            out.append(_job_status(job))
        except Error as e:
            if args.job:
                raise
            out.append({"job": job, "error": str(e)})
    if args.json:
        print(json.dumps(out if not args.job else out[0], indent=2))
        return 0
    if not out:
        print("no psd jobs on this machine (start one with `psd serve --job NAME --learners N`)")
    for j in out:
        if "error" in j:
            print(f"job {j['job']}: {j['error']}")
            continue
        print(f"job {j['job']}: {j['state']}, server pid {j['server_pid']} "
              f"({'alive' if j['server_alive'] else 'DEAD'}), generation {j['generation']}, "
              f"{j['n_params']:,} parameters, lr {j['lr']:g}")
        print(f"  clock {j['clock']}  pushed {j['pushed']}  applied {j['applied']}  rejected {j['rejected']}"
              f"  pending {j['pending']}  staleness mean {j['staleness_mean']:.2f} max {j['staleness_max']}")
        for s in j["learners"]:
            print(f"  slot {s['slot']:3d} pid {s['pid']:7d} {s['state']:8s} pushed {s['pushed']:8d} "
                  f"queued {s['queued']} staleness {s['staleness_mean']:.2f} loss {s['last_loss']:.4f}")
    return 0


def _clean(args: argparse.Namespace) -> int:
    removed = 0
    for job in list_jobs():
        try:
            a = open_job(job)
        except Error as e:
            reason = str(e)
        else:
            try:
                if a.server_alive():
                    print(f"keeping {shm_path(job)}: its server (pid {a.header()['server_pid']}) is alive")
                    continue
                reason = f"its server (pid {a.header()['server_pid']}) is dead"
            finally:
                a.close()
        print(f"{'would remove' if args.dry_run else 'removing'} {shm_path(job)}: {reason}")
        if not args.dry_run:
            try:
                _native.unlink(shm_name(job))
                removed += 1
            except FileNotFoundError:
                pass
    if not args.dry_run:
        print(f"removed {removed} arena(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``psd`` command."""
    args = get_args_parser().parse_args(argv)
    try:
        return {"serve": _serve, "run": _run, "status": _status, "clean": _clean}[args.command](args)
    except Error as e:
        print(f"psd {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
