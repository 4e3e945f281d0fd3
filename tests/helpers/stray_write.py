"""A learner (or a reader) that writes where it must not, through ctypes at the mapping's address.

    stray_write.py JOB TARGET

TARGET: weights, header (the header's server page), other_slot (a slot it did not claim), own_record (the
server's record of its own slot: state, owner, head, counters), reader
(a read-only mapping, as `psd status` has, written anywhere), or view_param (a learner attached with
pull="view" writing a parameter in place, as a local optimizer would). First it writes where it may (its own
slot, the header's shared page) and prints "own ok"; then the stray write, which must kill it with
SIGSEGV. It writes back the value it read, so a write that went through would change nothing but
this process's exit status (0, "wrote").
"""

import ctypes
import sys

import torch

from psd import _native, learner
from psd.arena import open_job


def rewrite(base: int, offset: int) -> None:
    word = ctypes.c_uint32.from_address(base + offset)
    word.value = word.value  # a store of the same value: faults on a read-only page all the same


def main() -> int:
    job, target = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if target == "reader":
        a = open_job(job, role="reader")
        base = torch.frombuffer(a, dtype=torch.uint8).data_ptr()
        print("own ok", flush=True)
        rewrite(base, a.header()["weights_off"])
        print("wrote", flush=True)
        return 0
    model = torch.nn.Linear(4, 1, bias=False)
    with learner.attach(model, job=job, timeout=30, pull="view" if target == "view_param" else "copy") as ps:
        model.weight.grad = torch.ones(1, 4)
        ps.step()
        ps.flush()
        a = ps._arena
        h = a.header()
        base = torch.frombuffer(a, dtype=torch.uint8).data_ptr()
        slot = h["slots_off"] + ps.slot * h["slot_stride"]
        rewrite(base, slot + _native.SLOT_LEASE_BEAT_OFFSET)  # its own slot
        rewrite(base, _native.HEADER_SHARED_OFFSET)  # the header's shared page (the admission mutex)
        print("own ok", flush=True)
        if target == "view_param":
            with torch.no_grad():
                model.weight.mul_(1.0)  # the parameter is the shared weights, mapped read-only
            print("wrote", flush=True)
            return 0
        offset = {"weights": h["weights_off"], "header": 64,
                  "other_slot": h["slots_off"] + (1 - ps.slot) * h["slot_stride"],
                  "own_record": h["slotrec_off"] + ps.slot * _native.SLOT_RECORD_SIZE}[target]
        rewrite(base, offset)
        print("wrote", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
