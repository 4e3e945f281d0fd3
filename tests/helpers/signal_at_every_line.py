"""Raise a signal at every line of a stop flag's methods, whose handler sets that flag: prints how many handlers
ran, or hangs (the caller's timeout) where a handler blocks on a lock its own thread holds.

    python signal_at_every_line.py flag|event [SECONDS]

After SECONDS (default 30) faulthandler prints every thread's stack and exits 1: where a hang is.
"""

import faulthandler
import os
import signal
import sys
import threading
import time

from psd.signals import SignalFlag

faulthandler.dump_traceback_later(float(sys.argv[2]) if len(sys.argv) > 2 else 30.0, exit=True)
flag = SignalFlag() if sys.argv[1] == "flag" else threading.Event()
handled = 0
in_handler = False


def handler(signum, frame):
    global handled, in_handler
    in_handler = True
    try:
        if handled % 2 and hasattr(flag, "nudge"):
            flag.nudge()  # SignalFlag's other handler call: SIGCHLD's "look now"
        else:
            flag.set()
        handled += 1
    finally:
        in_handler = False


# Every method of the flag's class, and of what it is built from (an Event's Condition), gets a signal at each line.
classes = [type(flag)] + ([threading.Condition] if isinstance(flag, threading.Event) else [])
codes = {f.__code__ for c in classes for f in vars(c).values() if callable(f) and hasattr(f, "__code__")}


def local(frame, event, arg):
    if event == "line" and not in_handler:
        os.kill(os.getpid(), signal.SIGUSR1)
    return local


def trace(frame, event, arg):
    return local if frame.f_code in codes else None


signal.signal(signal.SIGUSR1, handler)
sys.settrace(trace)
threading.settrace(trace)
for _ in range(100):
    flag.set()
    flag.wait(0.001)
    flag.clear()
    flag.wait(0.001)
sys.settrace(None)
flag.clear()  # the signals are over: it behaves as an Event still
t0 = time.monotonic()
assert not flag.wait(0.05) and time.monotonic() - t0 >= 0.05
flag.set()
assert flag.wait(0) and flag.is_set()
print("handled", handled, flush=True)
