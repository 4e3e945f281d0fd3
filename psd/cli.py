"""The ``psd`` command line: serve, run, status, top, stop, checkpoint, export, inspect, clean, doctor, bench, chaos.

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
import time
from pathlib import Path

from psd import __version__, _native, chaos, events
from psd.arena import default_job, list_jobs, open_job, shm_name, shm_path
from psd.errors import Error, Timeout
from psd.server import ASYNC_MOMENTUM, OPTIMIZERS, SCHEDULES, ServeConfig, Server
from psd.status import all_jobs, format_job, job_status

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


def _flag(raw: str) -> bool:
    """A PSD_<FLAG> value for an on/off flag."""
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(raw)


_flag.__name__ = "on/off value (1, 0, true, false)"


def _deprecated(old: str, new: str) -> None:
    print(f"psd: {old} is deprecated and will be removed; use {new} instead", file=sys.stderr)


class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores into the new flag's dest and warns on stderr, naming the new flag."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        _deprecated(str(option_string), self.new)
        setattr(namespace, self.dest, values)


def _ring_depth_default() -> int:
    """--ring-depth's default: $PSD_RING_DEPTH, else the deprecated $PSD_SLOTS, else 4."""
    if "PSD_RING_DEPTH" not in os.environ and "PSD_SLOTS" in os.environ:
        _deprecated("PSD_SLOTS", "PSD_RING_DEPTH")
        return _env("slots", 4, int)
    return _env("ring-depth", 4, int)


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
    r.add_argument("--learner-threads", type=int, default=_env("learner-threads", 0, int),
                   help="torch threads per learner; 0: the cores divided among the learners, at least 1 "
                        "(default: %(default)s)")
    r.add_argument("--gpus", default=_env("gpus", ""), metavar="LIST",
                   help="GPU indices, e.g. 0,1: learner RANK gets PSD_DEVICE=cuda:LIST[RANK %% len(LIST)] "
                        "(more learners than GPUs share them)")
    r.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    r.add_argument("learner_command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the learner command, after --")

    st = sub.add_parser("status", help="a job's figures, read straight from its arena (works on a hung job)")
    st.add_argument("--job", default=_env("job", None), help="job name (default: every job on the machine)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--sample", type=float, default=0.25,
                    help="seconds over which rates (gradients/s, GB/s) are measured; 0: none (default: %(default)s)")

    t = sub.add_parser("top", help="psd status, live, refreshing in the terminal (Ctrl-C to leave)")
    t.add_argument("--job", default=_env("job", None), help="job name (default: every job)")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: %(default)s)")
    t.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (0: never)")

    so = sub.add_parser("stop", help="stop a job cleanly (last checkpoint, arena removed), hung or not")
    so.add_argument("--job", default=_env("job", default_job()), help="job name (default: %(default)s)")
    so.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default: %(default)s)")

    ck = sub.add_parser("checkpoint", help="write a checkpoint of a job now")
    ck.add_argument("--job", default=_env("job", default_job()), help="job name (default: %(default)s)")
    ck.add_argument("--checkpoint-dir", default=_env("checkpoint-dir", None),
                    help="where to write it when the job has no watchdog (default: the job's checkpoint dir)")
    ck.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default: %(default)s)")

    ex = sub.add_parser("export", help="write a job's or a checkpoint's weights as a plain PyTorch state_dict")
    src = ex.add_mutually_exclusive_group(required=True)
    src.add_argument("--job", help="take the live weights of this job")
    src.add_argument("--checkpoint", help="take the weights of this checkpoint file (verified first)")
    ex.add_argument("--out", required=True, help="output file, loaded with torch.load + model.load_state_dict")

    ins = sub.add_parser("inspect", help="a job's arena header, field by field, and its learner slots")
    ins.add_argument("--job", default=_env("job", default_job()), help="job name (default: %(default)s)")
    ins.add_argument("--json", action="store_true", help="machine-readable output")

    c = sub.add_parser("clean", help="remove arenas whose server is dead")
    c.add_argument("--dry-run", action="store_true", help="only list what would be removed")

    b = sub.add_parser("bench", help="measure psd on this machine, beside Hogwild and DDP over gloo",
                       description="The update kernel's limit, the update loop, round trips with null learners, "
                       "and training, with torch.multiprocessing Hogwild and DDP's all_reduce over gloo in the same "
                       "run; ratios are psd/peer.")
    b.add_argument("--quick", action="store_true", help="a smoke test: small sizes, short runs")
    b.add_argument("--json", action="store_true", help="print the results as JSON (progress goes to stderr)")
    b.add_argument("--sizes", type=int, nargs="+", help="model sizes in parameters (default: 1e4 .. 1e7)")
    b.add_argument("--learners", type=int, nargs="+", help="learner counts (default: 1 2 4 8)")
    b.add_argument("--batches", type=int, nargs="+", help="mini-batch sizes for training (default: 1 2 4 8)")
    b.add_argument("--duration", type=float, help="seconds per round-trip measurement (default: 1)")
    b.add_argument("--reps", type=int, help="runs of each measurement, psd and peers taking turns; the median "
                   "is reported (default: 3)")
    b.add_argument("--no-peers", action="store_true", help="psd alone")
    b.add_argument("--no-training", action="store_true", help="skip the training workload")

    ch = sub.add_parser("chaos", help="kill parts of a live job at random intervals, to test its fault tolerance",
                        description="Signal a job's learners, server or watchdog (pids read from its arena, so "
                        "only that job's processes) at random intervals; each kill is printed as a JSON line. "
                        "Stops after --count kills, after --duration seconds, or when the job is gone.")
    chaos.add_arguments(ch)

    d = sub.add_parser("doctor", help="check this machine for psd, and say what to change")
    d.add_argument("--learners", type=int, default=None, help="learners the job will run")
    d.add_argument("--threads", type=int, default=None, help="update-loop threads the job will use")
    d.add_argument("--params", type=int, default=None, help="model parameters, to size the arena")
    d.add_argument("--ring-depth", type=int, default=4,
                   help="ring entries per learner: gradients each may have in flight (default: %(default)s)")
    d.add_argument("--slots", dest="ring_depth", type=int, action=_DeprecatedAlias, new="--ring-depth")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _serve_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--job", default=_env("job", default_job()), help="job name (default: %(default)s)")
    s.add_argument("--learners", type=int, default=_env("learners", 8, int),
                   help="learner slots: how many learners may attach at once (default: %(default)s)")
    s.add_argument("--lr", type=float, default=_env("lr", 0.01, float),
                   help="base learning rate of the server's optimizer (default: %(default)s)")
    s.add_argument("--ring-depth", type=int, default=_ring_depth_default(), metavar="K",
                   help="ring entries per learner, a power of two: gradients a learner may have in flight "
                        "(default: %(default)s)")
    s.add_argument("--slots", dest="ring_depth", type=int, action=_DeprecatedAlias, new="--ring-depth")
    s.add_argument("--threads", type=int, default=_env("threads", 0, int),
                   help="update-loop threads; 0 = a quarter of the cores, 1..8 (default: %(default)s)")
    s.add_argument("--spin-us", type=int, default=_env("spin-us", 50, int),
                   help="how long the update loop spins for more work before sleeping (default: %(default)s)")
    t = s.add_argument_group("training semantics (see the README's \"Training semantics\")")
    t.add_argument("--sync", default=_env("sync", "asp"), metavar="MODE",
                   help="asp (fully asynchronous), ssp:S (a learner computes only while at most S pushes ahead of "
                        "the slowest live learner), bsp "
                        "(average one gradient per learner, then update), kasync:K (average every K gradients) "
                        "(default: %(default)s)")
    t.add_argument("--push-every", type=int, default=_env("push-every", 1, int), metavar="W",
                   help="learners sum W mini-batches into one push, a wave (default: %(default)s)")
    t.add_argument("--optimizer", default=_env("optimizer", "sgd"), choices=OPTIMIZERS,
                   help="server-side optimizer; its state lives in the arena (default: %(default)s)")
    t.add_argument("--momentum", type=float, default=_env("momentum", None, float),
                   help="momentum / nesterov factor (default: 0.9)")
    t.add_argument("--dampening", type=float, default=_env("dampening", 0.0, float),
                   help="momentum dampening (default: %(default)s)")
    t.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999), metavar=("B1", "B2"),
                   help="adam / adamw moment decay rates (default: 0.9 0.999)")
    t.add_argument("--eps", type=float, default=_env("eps", None, float),
                   help="adam / adagrad epsilon (default: 1e-8; adagrad 1e-10)")
    t.add_argument("--weight-decay", type=float, default=_env("weight-decay", None, float),
                   help="L2 penalty (adamw: decoupled) (default: 0; adamw 0.01)")
    t.add_argument("--lr-decay", type=float, default=_env("lr-decay", 0.0, float),
                   help="adagrad learning-rate decay (default: %(default)s)")
    t.add_argument("--schedule", default=_env("schedule", "constant"), choices=SCHEDULES,
                   help="learning-rate schedule over optimizer steps (default: %(default)s)")
    t.add_argument("--step-size", type=int, default=_env("step-size", 0, int),
                   help="step schedule: multiply the lr by --gamma every N steps")
    t.add_argument("--gamma", type=float, default=_env("gamma", 0.1, float),
                   help="step schedule factor (default: %(default)s)")
    t.add_argument("--t-max", type=int, default=_env("t-max", 0, int),
                   help="cosine schedule: steps to anneal to --eta-min, then hold")
    t.add_argument("--eta-min", type=float, default=_env("eta-min", 0.0, float),
                   help="cosine schedule floor (default: %(default)s)")
    t.add_argument("--warmup", type=int, default=_env("warmup", 0, int),
                   help="linear warm-up over the first N optimizer steps (default: %(default)s)")
    t.add_argument("--staleness-lr", action="store_true", default=_env("staleness-lr", False, _flag),
                   help="divide the lr by each gradient's staleness (Zhang et al., IJCAI 2016)")
    t.add_argument("--max-staleness", type=int, default=_env("max-staleness", None, int), metavar="D",
                   help="drop (and count) gradients computed on weights more than D updates old")
    t.add_argument("--predict", action="store_true", default=_env("predict", False, _flag),
                   help="learners train on weights extrapolated by their staleness along the optimizer's "
                        "update direction (PipeOptim); needs momentum, nesterov, adam or adamw")
    t.add_argument("--async-momentum", default=_env("async-momentum", "auto"), choices=ASYNC_MOMENTUM,
                   help="momentum / nesterov: auto takes the implicit momentum that asynchrony adds (estimated "
                        "from the measured staleness) off --momentum; off applies --momentum as given, as "
                        "torch.optim (default: %(default)s)")
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
    s.add_argument("--event-log", default=_env("event-log", None), metavar="FILE",
                   help="JSON-lines log of admissions, deaths, restarts, checkpoints, rejections "
                        "(default: ~/.local/state/psd/events/JOB.jsonl; '' for none)")
    s.add_argument("--metrics-port", type=int, default=_env("metrics-port", 0, int),
                   help="serve Prometheus metrics on this port (0: off; default: %(default)s)")
    s.add_argument("--metrics-host", default=_env("metrics-host", "127.0.0.1"),
                   help="address the metrics endpoint binds to (default: %(default)s)")


def _watchdog_config(args: argparse.Namespace):
    from psd.watchdog.supervisor import WatchdogConfig

    ckpt_dir = args.checkpoint_dir or args.resume or None
    serve = ServeConfig(job=args.job, learners=args.learners, lr=args.lr, ring_depth=args.ring_depth,
                        threads=args.threads, spin_us=args.spin_us, init=args.init,
                        resume=None if args.resume is None else (ckpt_dir or ""),
                        sync=args.sync, push_every=args.push_every, optimizer=args.optimizer,
                        momentum=args.momentum, dampening=args.dampening, betas=tuple(args.betas), eps=args.eps,
                        weight_decay=args.weight_decay, lr_decay=args.lr_decay, schedule=args.schedule,
                        step_size=args.step_size, gamma=args.gamma, t_max=args.t_max, eta_min=args.eta_min,
                        warmup=args.warmup, staleness_lr=args.staleness_lr, max_staleness=args.max_staleness,
                        predict=args.predict, async_momentum=args.async_momentum,
                        event_log=str(events.default_path(args.job)) if args.event_log is None else args.event_log)
    try:
        serve.validate()
        if args.keep < 1:
            raise ValueError(f"--keep must be 1 or more, not {args.keep}")
        if args.heartbeat_timeout <= 0 or args.checkpoint_every < 0:
            raise ValueError("--heartbeat-timeout must be positive and --checkpoint-every 0 or more")
    except ValueError as e:
        raise SystemExit(f"psd {args.command}: {e}") from None
    cfg = WatchdogConfig(serve, Path(ckpt_dir) if ckpt_dir else None, args.checkpoint_every, args.keep,
                         args.heartbeat_timeout, metrics_port=args.metrics_port, metrics_host=args.metrics_host)
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
    return Launcher(_watchdog_config(args), command, max_restarts=args.max_restarts, gpus=gpus,
                    learner_threads=args.learner_threads).run()


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


def _status(args: argparse.Namespace) -> int:
    jobs = [job_status(args.job, args.sample)] if args.job else all_jobs(args.sample)
    if args.json:
        print(json.dumps(jobs[0] if args.job else jobs, indent=2))
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
    from psd.watchdog.supervisor import terminate

    a = open_job(args.job)
    h = a.header()
    a.close()
    if _native.owner_alive(h["watchdog_pid"], h["watchdog_start_time"]):
        who, pid = "watchdog", h["watchdog_pid"]
    elif _native.owner_alive(h["server_pid"], h["server_start_time"]):
        who, pid = "server", h["server_pid"]
    else:
        _native.unlink(shm_name(args.job))
        print(f"job {args.job!r}: its server (pid {h['server_pid']}) was already dead; removed {shm_path(args.job)}")
        return 0
    print(f"stopping job {args.job!r}: SIGTERM to its {who} (pid {pid})", flush=True)
    terminate(pid, deadline=args.timeout)
    deadline = time.monotonic() + args.timeout
    while os.path.exists(shm_path(args.job)):  # the watchdog removes it after its last checkpoint
        if time.monotonic() > deadline:
            raise Timeout(f"job {args.job!r} did not stop within {args.timeout:g} s; `psd status --job "
                          f"{args.job}` shows what is left")
        time.sleep(0.05)
    print(f"job {args.job!r} stopped")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    """Ask the watchdog (SIGUSR1) and wait for it; without a live watchdog, snapshot the arena here."""
    from psd.watchdog import checkpoint

    a = open_job(args.job)
    try:
        h = a.header()
        if _native.owner_alive(h["watchdog_pid"], h["watchdog_start_time"]):
            before = h["checkpoint_unix_ns"]
            os.kill(h["watchdog_pid"], signal.SIGUSR1)
            deadline = time.monotonic() + args.timeout
            while a.header()["checkpoint_unix_ns"] == before:
                if time.monotonic() > deadline:
                    raise Timeout(f"the watchdog of job {args.job!r} wrote no checkpoint within {args.timeout:g} s")
                time.sleep(0.05)  # the watchdog announces it only in the header
            print(f"job {args.job!r}: checkpoint written by its watchdog at clock {a.header()['checkpoint_clock']}")
            return 0
        if a.state != _native.ARENA_READY:
            raise Error(f"job {args.job!r} has no weights yet; nothing to checkpoint")
        a.remap()
        snap = checkpoint.snapshot(a, args.job)
        path = checkpoint.write(snap, args.checkpoint_dir or checkpoint.default_dir(args.job))
        a.note_checkpoint(snap.clock, time.time_ns())
        del snap
        print(f"job {args.job!r}: no live watchdog; wrote {path}")
        return 0
    finally:
        a.close()


def _export(args: argparse.Namespace) -> int:
    import torch

    if args.checkpoint:
        from psd.state import in_model_dtypes
        from psd.watchdog import checkpoint

        ckpt = checkpoint.load(args.checkpoint)
        state, src = in_model_dtypes(ckpt.spec, ckpt.weights), args.checkpoint
    else:
        from psd.learner import pull_state_dict

        state, src = pull_state_dict(args.job), f"job {args.job!r}"
    torch.save({k: v.clone() for k, v in state.items()}, args.out)
    print(f"wrote {args.out}: {len(state)} tensors, {sum(v.numel() for v in state.values()):,} values from "
          f"{src}; load it with model.load_state_dict(torch.load({args.out!r}))")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    a = open_job(args.job)
    try:
        if a.state == _native.ARENA_READY:
            a.remap()
        h = a.header()
        slots = [a.slot_info(i) for i in range(h["n_slots"])] if a.state == _native.ARENA_READY else []
    finally:
        a.close()
    if args.json:
        print(json.dumps({"header": h, "slots": slots}, indent=2))
        return 0
    print(f"arena {shm_path(args.job)}")
    for k in sorted(h):
        print(f"  {k:24} {h[k]}")
    for i, s in enumerate(slots):
        print(f"slot {i}: " + "  ".join(f"{k}={v}" for k, v in s.items()))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import dataclasses

    from psd.bench import BenchConfig, run

    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    changes = {k: tuple(v) if isinstance(v, list) else v for k, v in
               {"sizes": args.sizes, "learners": args.learners, "batches": args.batches,
                "duration": args.duration, "reps": args.reps}.items() if v is not None}
    cfg = dataclasses.replace(cfg, **changes, peers=not args.no_peers, training=not args.no_training)
    results = run(cfg, log=lambda line: print(line, file=sys.stderr if args.json else sys.stdout, flush=True))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from psd.doctor import as_dicts, run_checks

    checks = run_checks(args.learners, args.threads, args.params, args.ring_depth)
    if args.json:
        print(json.dumps(as_dicts(checks), indent=2))
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
