"""`psd ARGS...` (`psd serve`, `psd run`) in this process, with SIGTERM raised at every line its main thread runs
inside the wait of its stop flag (a ``threading.Event``'s or a ``SignalFlag``'s): the handler then runs while
that wait is under way, wherever a lock of the flag's may be held. A command whose handler could block there
never exits (the caller's timeout); one whose stop is safe exits as from any SIGTERM.

    python serve_signalled_in_wait.py [--event] SECONDS ARGS...

After SECONDS faulthandler prints every thread's stack and exits 1: where a hang is.

``--event`` puts ``threading.Event`` back where the server, the watchdog and `psd run`'s launcher make their stop
flags (what they did before ``SignalFlag``): the control that shows this harness catches the hang.
"""

import faulthandler
import os
import signal
import sys
import threading

import psd.cli
import psd.watchdog.launcher
import psd.watchdog.supervisor
from psd.signals import SignalFlag


class EventFlag(threading.Event):
    """threading.Event with SignalFlag's other calls, which the poll loops make too: a nudge does nothing, the
    descriptors are not waited on (the control needs only the Event's wait, and its lock)."""

    def wait(self, timeout=None, also=()):
        return super().wait(timeout)

    def nudge(self):
        pass


argv = sys.argv[1:]
if argv[:1] == ["--event"]:
    argv = argv[1:]
    psd.cli.SignalFlag = EventFlag
    psd.watchdog.supervisor.SignalFlag = EventFlag
    psd.watchdog.launcher.SignalFlag = EventFlag
faulthandler.dump_traceback_later(float(argv[0]), exit=True)
argv = argv[1:]
WAITS = {threading.Event.wait.__code__, SignalFlag.wait.__code__}
main = threading.main_thread()


def local(frame, event, arg):
    if event == "line" and threading.current_thread() is main:
        os.kill(os.getpid(), signal.SIGTERM)
    return local


def trace(frame, event, arg):
    return local if frame.f_code in WAITS else None


sys.settrace(trace)
sys.exit(psd.cli.main(argv))
