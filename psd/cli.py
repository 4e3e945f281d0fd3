"""The ``psd`` command line: serve, run, status, top, stop, checkpoint, export, inspect, clean, doctor, bench, chaos.

Shape follows torch's distributed/run.py: get_args_parser() -> parse_args()
-> a config object -> run(config). The flags are declared once, in
psd.flags.FLAGS; each can also come from its PSD_<FLAG> environment variable
(flag in upper case, dashes as underscores; psd bench's are PSD_BENCH_<FLAG>).
psd chaos alone takes its flags from the command line only (psd.chaos says why).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

from psd import __version__, _native, chaos, events
from psd.arena import HeaderView, learner_writable, list_jobs, open_job, recover_from_sigbus, shm_name, shm_path
from psd.errors import Error, Timeout
from psd.flags import add_flags, check_args, serve_fields
from psd.server import ServeConfig, Server
from psd.signals import SignalFlag
from psd.status import all_jobs, format_job, job_status

__all__ = ["get_args_parser", "main"]


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
    add_flags(s, "serve")

    r = sub.add_parser("run", help="launch a whole job: watchdog, server and N learners (like torchrun)",
                       description="Start the watchdog and server, then N copies of COMMAND as learners "
                       "(PSD_JOB, PSD_RANK, PSD_WORLD tell each its job and rank). A learner that dies is "
                       "restarted alone; so is the server. Exits with the learners' status.",
                       usage="psd run --learners N [serve options] -- COMMAND [ARGS...]")
    add_flags(r, "run")
    r.add_argument("learner_command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the learner command, after --")

    st = sub.add_parser("status", help="a job's figures, read straight from its arena (works on a hung job)")
    add_flags(st, "status")

    t = sub.add_parser("top", help="psd status, live, refreshing in the terminal (Ctrl-C to leave)")
    add_flags(t, "top")

    so = sub.add_parser("stop", help="stop a job cleanly (last checkpoint, arena removed), hung or not")
    add_flags(so, "stop")

    ck = sub.add_parser("checkpoint", help="write a checkpoint of a job now")
    add_flags(ck, "checkpoint")

    ex = sub.add_parser("export", help="write a job's or a checkpoint's weights as a plain PyTorch state_dict")
    add_flags(ex, "export")

    ins = sub.add_parser("inspect", help="a job's arena header, field by field, and its learner slots")
    add_flags(ins, "inspect")

    c = sub.add_parser("clean", help="remove arenas whose server is dead (--job: that job's alone)")
    add_flags(c, "clean")

    b = sub.add_parser("bench", help="measure psd on this machine, beside Hogwild and DDP over gloo",
                       description="The update kernel's limit, the update loop, round trips with null learners, "
                       "and training, with torch.multiprocessing Hogwild and DDP's all_reduce over gloo in the same "
                       "run; ratios are psd/peer.")
    add_flags(b, "bench")

    ch = sub.add_parser("chaos", help="kill parts of a live job at random intervals, to test its fault tolerance",
                        description="Signal a job's learners, server or watchdog (pids read from its arena, so "
                        "only that job's processes) at random intervals; each kill is printed as a JSON line. "
                        "Stops after --count kills, after --duration seconds, or when the job is gone.")
    chaos.add_arguments(ch)

    d = sub.add_parser("doctor", help="check this machine for psd, and say what to change")
    add_flags(d, "doctor")
    return p


def _watchdog_config(args: argparse.Namespace):
    from psd.watchdog.supervisor import WatchdogConfig

    # --resume FILE (one checkpoint): its directory
    ckpt_dir = args.checkpoint_dir or (str(Path(args.resume).parent) if args.resume and Path(args.resume).is_file()
                                       else args.resume) or None
    values = {f.field: getattr(args, f.dest) for f in serve_fields()}
    # --resume DIR is where the job starts from, --checkpoint-dir where its checkpoints go (DIR unless given)
    values.update(betas=tuple(args.betas), resume=None if args.resume is None else (args.resume or ckpt_dir or ""),
                  event_log=str(events.default_path(args.job)) if args.event_log is None else args.event_log)
    serve = ServeConfig(**values)
    try:
        check_args(args, args.command)
        serve.validate()
    except ValueError as e:
        raise SystemExit(f"psd {args.command}: {e}") from None
    cfg = WatchdogConfig(serve, Path(ckpt_dir) if ckpt_dir else None, args.checkpoint_every, args.keep,
                         args.heartbeat_timeout, max_restarts=args.server_restarts, metrics_port=args.metrics_port,
                         metrics_host=args.metrics_host, start_timeout=args.start_timeout)
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
        metrics = None
        if cfg.metrics_port:
            from psd.metrics import serve_metrics

            metrics = serve_metrics(cfg.serve.job, cfg.metrics_port, cfg.metrics_host)
        try:
            return serve_bare(cfg.serve)
        finally:
            if metrics is not None:
                metrics.shutdown()
    from psd.watchdog.supervisor import serve_forever

    return serve_forever(cfg)


def _run(args: argparse.Namespace) -> int:
    from psd.watchdog.launcher import Launcher

    _logging(args)
    command = args.learner_command[1:] if args.learner_command[:1] == ["--"] else args.learner_command
    if not command:
        raise SystemExit("psd run: give the learner command after --, e.g. "
                         "`psd run --learners 4 -- python train.py`")
    try:
        gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    except ValueError:
        raise SystemExit(f"psd run: --gpus takes GPU indices like 0,1 (not {args.gpus!r})") from None
    if args.pull == "view" and (gpus or args.predict):
        # Every learner would refuse it at attach and be restarted until the job fails: say so now.
        raise SystemExit(f"psd run: --pull view makes CPU learners' parameters views of the shared weights; "
                         f"it cannot go with {'--gpus' if gpus else '--predict'}: use --pull copy")
    cfg = _watchdog_config(args)
    cfg.serve.learners *= args.stages  # a slot for every stage of every virtual worker
    return Launcher(cfg, command, max_restarts=args.max_restarts, gpus=gpus,
                    fork_server=args.fork_server, stages=args.stages,
                    learner_threads=args.learner_threads, pull=args.pull, learner_sched=args.learner_sched).run()


def serve_bare(cfg: ServeConfig) -> int:
    """The server alone (what the watchdog runs): until SIGINT/SIGTERM, or SIGUSR2 to hand over."""
    stop = SignalFlag()  # set by the handler: a threading.Event could deadlock there
    handover = SignalFlag()

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
    except BaseException:
        # An internal error is not a stop: leave the arena (its learners, their rings) to the next server.
        server.stop(remove=False)
        raise
    server.stop(remove=not handover.is_set())
    return 0


def _status(args: argparse.Namespace) -> int:
    jobs = [job_status(args.job, args.sample)] if args.job else all_jobs(args.sample)
    if args.json:
        print(json.dumps(finite_json(jobs[0] if args.job else jobs), indent=2, allow_nan=False))
    elif not jobs:
        print("no psd jobs on this machine (start one with `psd serve --job NAME --learners N`)")
    else:
        print("\n\n".join(format_job(j) for j in jobs))
    return 0


def _top(args: argparse.Namespace) -> int:
    n = 0
    sample = min(0.5, args.interval / 2)
    while True:
        jobs = [job_status(args.job, sample)] if args.job else all_jobs(sample)
        body = "\n\n".join(format_job(j) for j in jobs) or "no psd jobs on this machine"
        if sys.stdout.isatty():
            sys.stdout.write("\x1b[H\x1b[2J")
        sys.stdout.write(f"psd top  {time.strftime('%H:%M:%S')}  (Ctrl-C to leave)\n\n{body}\n")
        sys.stdout.flush()
        n += 1
        if args.iterations and n >= args.iterations:
            return 0
        time.sleep(max(0.0, args.interval - sample))  # the display's refresh period


def _stop(args: argparse.Namespace) -> int:
    """SIGTERM the watchdog (it checkpoints, stops the server, removes the arena); else the server; else clean."""
    from psd.watchdog.checkpoint import LOAD_RATE, write_allowance
    from psd.watchdog.supervisor import terminate, terminate_writer

    a = open_job(args.job, role="reader")
    try:
        h = HeaderView(a)
        watchdog, server = (h.watchdog_pid, h.watchdog_start_time), (h.server_pid, h.server_start_time)
        last_checkpoint_s = write_allowance(h)
    finally:
        a.close()
    timeout = args.timeout
    if _native.owner_alive(*watchdog):
        who, pid = "watchdog", watchdog[0]
        # The watchdog writes the last checkpoint after the server stopped, from the only copy left (the arena's
        # name is gone by then): a SIGKILL meanwhile loses what was trained since the last one. Its write at the
        # slowest rate allowed for comes on top of --timeout, and while it goes on writing it is not killed (up
        # to ten times that: a loaded machine or a slow disk writes slower than the rate allowed for).
        timeout += last_checkpoint_s
    elif _native.owner_alive(*server):
        who, pid = "server", server[0]
    else:
        _native.unlink(shm_name(args.job))
        print(f"job {args.job!r}: its server (pid {server[0]}) was already dead; removed {shm_path(args.job)}")
        return 0
    print(f"stopping job {args.job!r}: SIGTERM to its {who} (pid {pid})", flush=True)
    if who == "watchdog":
        idle = max(args.timeout, 1.0)
        cap = args.timeout + 10 * max(last_checkpoint_s, 1.0)

        def waiting(cap: float) -> None:
            print(f"job {args.job!r}: its watchdog is still at work after {timeout:.1f} s (the last checkpoint of "
                  f"{last_checkpoint_s * LOAD_RATE / 1e9:.2f} GB); waiting while it works, up to {cap:.0f} s",
                  flush=True)

        if terminate_writer(pid, watchdog[1], deadline=timeout, idle=idle, cap=cap, waiting=waiting):
            left = (f"; its server (pid {server[0]}) is still running: `psd stop --job {args.job}` again stops it"
                    if _native.owner_alive(*server) else "")
            raise Error(f"job {args.job!r}: its watchdog (pid {pid}) was still running after {timeout:.1f} s, idle "
                        f"for {idle:g} s or past {cap:.1f} s in all, and was killed: its last checkpoint may not "
                        f"have been written (what was trained since the one before is then lost: the job's "
                        f"checkpoint directory, ~/.local/state/psd/checkpoints/JOB unless --checkpoint-dir said "
                        f"otherwise, holds the newest){left}. Give psd stop a larger --timeout")
    else:
        terminate(pid, deadline=timeout)
    deadline = time.monotonic() + timeout
    while os.path.exists(shm_path(args.job)):  # the watchdog removes it after its last checkpoint
        if time.monotonic() > deadline:
            raise Timeout(f"job {args.job!r} did not stop within {timeout:g} s; `psd status --job "
                          f"{args.job}` shows what is left")
        time.sleep(0.05)
    print(f"job {args.job!r} stopped")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    """Ask the watchdog (SIGUSR1) and wait for it; without a live watchdog, snapshot the arena here."""
    from psd.watchdog import checkpoint

    a = open_job(args.job)
    try:
        h = HeaderView(a)
        if _native.owner_alive(h.watchdog_pid, h.watchdog_start_time):
            before = h.checkpoint_unix_ns
            os.kill(h.watchdog_pid, signal.SIGUSR1)
            deadline = time.monotonic() + args.timeout
            while h.checkpoint_unix_ns == before:
                if time.monotonic() > deadline:
                    raise Timeout(f"the watchdog of job {args.job!r} wrote no checkpoint within {args.timeout:g} s")
                time.sleep(0.05)  # the watchdog announces it only in the header
            print(f"job {args.job!r}: checkpoint written by its watchdog at clock {h.checkpoint_clock}")
            return 0
        if a.state != _native.ARENA_READY:
            raise Error(f"job {args.job!r} has no weights yet; nothing to checkpoint")
        a.remap()
        snap = checkpoint.snapshot(a, args.job)
        path = checkpoint.write(snap, args.checkpoint_dir or checkpoint.default_dir(args.job), keep=args.keep)
        a.note_checkpoint(snap.clock, time.time_ns())
        del snap
        print(f"job {args.job!r}: no live watchdog; wrote {path}")
        return 0
    finally:
        a.close()


def _export_source(args: argparse.Namespace) -> None:
    """Leave one of ``args.job`` and ``args.checkpoint`` set: the one given on the command line where the
    other came from its environment variable (PSD_JOB, set in every learner's environment by psd run, must
    not override --checkpoint); exit saying what to do where both came from the environment."""
    if not args.out:
        raise SystemExit("psd export: the output file is empty (--out '' or PSD_OUT=''); give --out FILE")
    if args.job and args.checkpoint:
        given = getattr(args, "given", None) or set()
        if "checkpoint" in given:
            args.job = None
        elif "job" in given:
            args.checkpoint = None
        else:
            raise SystemExit(f"psd export: PSD_JOB ({args.job!r}) and PSD_CHECKPOINT ({args.checkpoint!r}) are both "
                             f"set; give --job or --checkpoint on the command line, or unset one of them")
    elif not (args.job or args.checkpoint):
        raise SystemExit("psd export: give --job NAME or --checkpoint FILE (PSD_JOB / PSD_CHECKPOINT are empty)")


def _export(args: argparse.Namespace) -> int:
    import torch

    _export_source(args)
    if args.checkpoint:
        from psd.state import in_model_dtypes
        from psd.watchdog import checkpoint

        ckpt = checkpoint.load(args.checkpoint)
        state, src = in_model_dtypes(ckpt.spec, ckpt.weights), args.checkpoint
    else:
        from psd.errors import JobNotFound
        from psd.learner import pull_state_dict

        try:
            state, src = pull_state_dict(args.job), f"job {args.job!r}"
        except JobNotFound:
            # The job has ended (its arena is gone): its newest checkpoint that verifies.
            from psd.state import in_model_dtypes
            from psd.watchdog import checkpoint

            where = args.checkpoint_dir or checkpoint.default_dir(args.job)
            ckpt = checkpoint.latest(where, job=args.job, others=False)
            if ckpt is None:
                theirs = sorted({j for p in checkpoint.list_checkpoints(where) if (j := checkpoint.job_of(p))})
                held = f" (it holds checkpoints of job {', '.join(map(repr, theirs))})" if theirs else ""
                raise JobNotFound(f"job {args.job!r} is not running and {where} holds no checkpoint of it that "
                                  f"verifies{held}; give the directory its checkpoints went to (--checkpoint-dir), "
                                  f"or a checkpoint file (--checkpoint)") from None
            state = in_model_dtypes(ckpt.spec, ckpt.weights)
            src = f"job {args.job!r}, which has ended: its newest checkpoint {ckpt.path}"
    torch.save({k: v.clone() for k, v in state.items()}, args.out)
    print(f"wrote {args.out}: {len(state)} tensors, {sum(v.numel() for v in state.values()):,} values from "
          f"{src}; load it with model.load_state_dict(torch.load({args.out!r}))")
    return 0


def finite_json(v):
    """``v`` with every NaN or infinity (whatever a damaged arena holds) as None: strict JSON."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [finite_json(x) for x in v]
    return v


def _inspect(args: argparse.Namespace) -> int:
    a = open_job(args.job, role="reader")
    try:
        if a.state == _native.ARENA_READY:
            a.remap()
        h = a.header()
        slots = [a.slot_info(i) for i in range(h["n_slots"])] if a.state == _native.ARENA_READY else []
    finally:
        a.close()
    for i, s in enumerate(slots):
        s["learner_writable"] = learner_writable(args.job, h, i)
    if args.json:
        print(json.dumps(finite_json({"header": h, "slots": slots}), indent=2, allow_nan=False))
        return 0
    print(f"arena {shm_path(args.job)}")
    for k in sorted(h):
        print(f"  {k:24} {h[k]}")
    for i, s in enumerate(slots):
        print(f"slot {i}: " + "  ".join(f"{k}={v}" for k, v in s.items() if k != "learner_writable"))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import dataclasses

    from psd.bench import BenchConfig, run

    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    changes = {k: tuple(v) if isinstance(v, list) else v for k, v in
               {"sizes": args.sizes, "learners": args.learners, "batches": args.batches,
                "duration": args.duration, "reps": args.reps, "pull_modes": args.pull_modes,
                "grad_dtypes": args.grad_dtypes, "learner_sched": args.learner_sched,
                "loop_sizes": args.loop_sizes, "optimizer_sizes": args.optimizer_sizes,
                "overlap_modes": args.overlap_modes, "server_threads": args.server_threads}.items()
               if v is not None}
    cfg = dataclasses.replace(cfg, **changes, peers=not args.no_peers, training=not args.no_training,
                              limits=not args.no_limits)  # the flags' values were checked (main: check_args)
    results = run(cfg, log=lambda line: print(line, file=sys.stderr if args.json else sys.stdout, flush=True))
    if args.json:
        print(json.dumps(results, indent=2, allow_nan=False))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from psd.doctor import as_dicts, run_checks

    checks = run_checks(args.learners, args.threads, args.params, args.ring_depth)
    if args.json:
        print(json.dumps(finite_json(as_dicts(checks)), indent=2, allow_nan=False))
    else:
        for c in checks:
            print(f"[{c.status.upper() if c.status == 'fail' else c.status:>4}] {c.name}: {c.detail}")
            if c.fix:
                print(f"       fix: {c.fix}")
    return 1 if any(c.status == "fail" for c in checks) else 0


def _chaos(args: argparse.Namespace) -> int:
    cfg = chaos.config_from_args(args)
    try:
        cfg.validate()
    except ValueError as e:
        raise SystemExit(f"psd chaos: {e}") from None
    kills = chaos.run(cfg, out=lambda line: print(line, flush=True))
    print(f"psd chaos: {kills} kill(s) in job {cfg.job!r}", file=sys.stderr)
    return 0


def _mapped_by(path: str) -> list[int]:
    """Pids (in this PID namespace) of the processes that map ``path``: /proc/PID/maps names it."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/maps", encoding="utf-8", errors="replace") as f:
                if any(line.rstrip("\n").endswith(" " + path) or line.rstrip("\n").endswith(path + " (deleted)")
                       for line in f):
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _clean(args: argparse.Namespace) -> int:
    removed = 0
    if args.job and not os.path.exists(shm_path(args.job)):
        print(f"nothing to remove: job {args.job!r} has no arena ({shm_path(args.job)})")
    for job in [args.job] if args.job else list_jobs():
        if not os.path.exists(shm_path(job)):
            continue
        try:
            a = open_job(job)
        except Error as e:
            # An arena this psd cannot read (another psd version, or damaged) may still be a live job's:
            # keep it while any process maps it.
            users = _mapped_by(str(shm_path(job)))
            if users:
                print(f"keeping {shm_path(job)}: this psd cannot read it ({e}), but processes map it "
                      f"(pids {', '.join(map(str, users[:8]))}): stop that job first, with the psd that started it")
                continue
            reason = str(e)
        else:
            try:
                if a.server_alive():
                    print(f"keeping {shm_path(job)}: its server (pid {HeaderView(a).server_pid}) is alive")
                    continue
                reason = f"its server (pid {HeaderView(a).server_pid}) is dead"
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
        check_args(args, args.command)  # every flag's rule (psd serve and run check their ServeConfig's too)
    except ValueError as e:
        print(f"psd {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command in ("status", "top", "inspect"):
        recover_from_sigbus()  # they only read: a job's arena truncated meanwhile is an error, not their death
    try:
        return {"serve": _serve, "run": _run, "status": _status, "top": _top, "stop": _stop,
                "checkpoint": _checkpoint, "export": _export, "inspect": _inspect, "clean": _clean,
                "doctor": _doctor, "bench": _bench, "chaos": _chaos}[args.command](args)
    except Error as e:
        print(f"psd {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
