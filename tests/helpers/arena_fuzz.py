"""Feed damaged and foreign files, placed at /dev/shm/psd.<job>, to psd's commands; one JSON line per case.

    arena_fuzz.py JOB SEED WORKDIR

It first makes a real arena for JOB (a forked server loads a small model and exits, so the arena's server
is dead, as after a crash), then derives the cases from it with a seeded RNG: truncations, random bytes in
the header and in each region, foreign files (random data, an ELF binary, another layout version, an empty
file). For each target (status, inspect, clean --dry-run, serve --resume, learner attach) and case it prints
``{"target", "case"}`` before the call (so a death names its case) and ``{"outcome": ...}`` after: "ok",
"error: <psd.Error message>", or "bad: <any other exception>". A signal death or a hang is the caller's to see.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import struct
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from psd import _native, cli, learner
from psd.arena import shm_path
from psd.errors import Error
from psd.server import ServeConfig, Server

LEARNERS, RING = 2, 2


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(1000))  # in name order, as --init reads a file
        self.b = torch.nn.Parameter(torch.zeros(7))


def make_template(job: str, workdir: str) -> bytes:
    init = os.path.join(workdir, "init.safetensors")
    save_file({k: v.detach().clone() for k, v in Model().state_dict().items()}, init)
    pid = os.fork()
    if pid == 0:  # the server: create, load, start the loop, then die without cleaning up
        code = 1
        try:
            s = Server(ServeConfig(job=job, learners=LEARNERS, ring_depth=RING, init=init))
            s.start()
            s.poll()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the template server failed"
    with open(shm_path(job), "rb") as f:
        data = f.read()
    os.unlink(shm_path(job))
    return data


def cases(template: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    h = dict(zip(("magic", "layout_version", "fingerprint"), struct.unpack_from("<QII", template), strict=True))
    out: list[tuple[str, bytes]] = [
        ("empty file", b""),
        ("random 100 bytes", rng.randbytes(100)),
        ("random page", rng.randbytes(4096)),
        ("random 64 KiB", rng.randbytes(1 << 16)),
        ("another program's file (an ELF binary)", Path(sys.executable).read_bytes()[:1 << 16]),
        ("another layout version", struct.pack_into("<I", t := bytearray(template), 8, h["layout_version"] + 1)
         or bytes(t)),
        ("another fingerprint", struct.pack_into("<I", t := bytearray(template), 12, h["fingerprint"] ^ 1)
         or bytes(t)),
        ("foreign byte order", struct.pack_into(">Q", t := bytearray(template), 0, h["magic"]) or bytes(t)),
        ("never completed (no magic)", bytes(8) + template[8:]),
    ]
    for n in (100, 4095, 4096, 4096 + 64, len(template) // 2, len(template) - 4096, len(template) - 1):
        out.append((f"truncated to {n} bytes", template[:n]))
    # Random bytes: in the geometry lines of the header, anywhere in the header, then in each region.
    regions = {"header geometry": (64, 256), "header": (0, 4096)}
    hdr = header_of(template)
    ends = ["ranks_off", "spec_off", "weights_off", "optstate_off", "buffers_off", "pieces_off", "slots_off"]
    for a, b in zip(ends, [*ends[1:], "total_size"], strict=True):
        if hdr[a] < hdr[b]:  # regions the model does not use (no buffers, no optimizer state) are empty
            regions[a.removesuffix("_off")] = (hdr[a], hdr[b])
    regions["spec JSON"] = (hdr["spec_off"], hdr["spec_off"] + hdr["spec_len"])
    for name, (lo, hi) in regions.items():
        for i in range(3):
            t = bytearray(template)
            for _ in range(rng.choice((1, 4, 32))):
                # The header's first case may hit the magic number; the others get past it to the fields.
                at = rng.randrange(max(lo, 8 if name.startswith("header") and i else 0), hi)
                t[at] = rng.randrange(256)
            out.append((f"random bytes in the {name} ({i})", bytes(t)))
    return out


def header_of(data: bytes) -> dict:
    """The header of an arena image, read through psd itself from a scratch copy."""
    job = f"fuzz-probe-{os.getpid()}"
    place(job, data)
    try:
        a = _native.open("/psd." + job)
        try:
            return a.header()
        finally:
            a.close()
    finally:
        os.unlink(shm_path(job))


def place(job: str, data: bytes) -> None:
    path = shm_path(job)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    # Left behind a while ago, as a crash leaves a file: not one a server is creating this very moment.
    old = os.stat(path).st_mtime - 60
    os.utime(path, (old, old))


def run_cli(*argv: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    if code:
        raise Error(err.getvalue().strip() or f"exit status {code} without a message")


def target(name: str, job: str, workdir: str) -> None:
    if name == "status":
        run_cli("status", "--job", job, "--sample", "0")
    elif name == "inspect":
        run_cli("inspect", "--job", job)
    elif name == "clean":
        run_cli("clean", "--dry-run")
    elif name == "serve --resume":
        s = Server(ServeConfig(job=job, learners=LEARNERS, ring_depth=RING, resume=workdir))
        try:
            s.start()
            s.poll()
            s.poll()
        finally:
            s.stop()
    elif name == "learner attach":
        with learner.attach(Model(), job=job, timeout=0.1, reconnect_timeout=0.1) as ps:
            ps.step()
    else:
        raise ValueError(name)


def main() -> int:
    job, seed, workdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    rng = random.Random(seed)
    all_cases = cases(make_template(job, workdir), rng)
    targets = sys.argv[4:] or ["status", "inspect", "clean", "serve --resume", "learner attach"]
    empty = tempfile.mkdtemp(dir=workdir)  # no checkpoints: serve --resume starts from nothing
    for t in targets:
        for case, data in all_cases:
            place(job, data)
            print(json.dumps({"target": t, "case": case}), flush=True)
            try:
                target(t, job, empty)
                outcome = "ok"
            except Error as e:
                outcome = f"error: {e}"
            except Exception as e:  # what the test reports as not a clear error
                outcome = f"bad: {type(e).__name__}: {e}"
            print(json.dumps({"outcome": outcome}), flush=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shm_path(job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
