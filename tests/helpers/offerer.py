"""A learner that offers its model and never writes its weights, as one killed while it writes them leaves the job.

    offerer.py JOB

Offers the spec of one tensor "w" of 64 float32s, prints "ready" once the server has grown the arena for it
(INIT_WEIGHTS, the weights still zero), then blocks until killed.
"""

import os
import signal
import sys

from psd import _native
from psd.arena import ParamSpec, encode_spec, model_sizes, open_job

job = sys.argv[1]
a = open_job(job, role="learner")
spec = [ParamSpec("w", (64,))]
data, digest = encode_spec(spec)
me = os.getpid()
if not a.set_spec(data, digest, model_sizes(spec), me, _native.proc_start_time(me)):
    sys.exit("the job already has a model")
a.wait_state(_native.ARENA_SPEC_OFFERED, 30.0)
if a.state != _native.ARENA_INIT_WEIGHTS:
    sys.exit(f"the server did not take the model (state {a.state}: {a.header()['fail_msg']})")
print("ready", flush=True)
signal.pause()  # until killed
