"""A worker stops on SIGTERM however the signals arrive.

Its stop flag used to be a threading.Event set from the signal handler: a signal landing while
the main loop sat inside Event.wait() ran the handler inside that wait, whose lock it then tried
to take again -- the worker hung forever (found as workers that outlived their daemon after the
parent-death SIGTERM and the daemon's own). A burst of SIGTERMs makes that moment likely.
"""
from __future__ import annotations

import signal
import subprocess
import time

from meshd.testing.models import build_random_llama
from meshd.testing.procs import spawn_worker

EXIT_WITHIN_S = 30.0


def test_a_burst_of_sigterms_stops_the_worker():
    worker = spawn_worker(build_random_llama(seed=2), "0:2", threads=1)
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)
            time.sleep(0.0005)
        assert worker.proc.wait(EXIT_WITHIN_S) == 0
    except subprocess.TimeoutExpired:
        worker.proc.kill()
        raise AssertionError(f"the worker did not stop within {EXIT_WITHIN_S:g} s of SIGTERM") from None
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()
