"""The serve bench's CPU accounting (meshd/benchmarks/serve.py ``_Cpu``): it books the CPU time of
the processes it is given (read from /proc) plus the client's own, per concurrency, and a process
that has exited is left out instead of failing the run. Real processes; no timing asserted."""
from __future__ import annotations

import os
import subprocess
import sys

from meshd.benchmarks.serve import _Cpu, _cpu_seconds
from tests.conftest import wait_until_blocking

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\ninput()\n"


def test_cpu_books_the_processes_and_the_client_per_concurrency():
    burner = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        cpu = _Cpu([burner.pid, gone.pid])
        start = _cpu_seconds(burner.pid)

        def wave():
            wait_until_blocking(lambda: _cpu_seconds(burner.pid) >= 0.3, 60, "the burner's 0.3 s of CPU")
            gone.wait(60)                                      # and this one exited meanwhile
            return [(0, ["a", "b", "c"], [0.0, 0.1, 0.2]), (1, ["d"], [0.0])]

        runs = cpu.measure(8, wave)
        assert len(runs) == 2 and cpu.tokens[8] == 4
        assert cpu.cpu_s[8] >= 0.3 - start - 0.02   # the burner's CPU (clock ticks of 10 ms)
        assert _cpu_seconds(gone.pid) is None
        report = cpu.report()
        assert report["machine_cores"] == len(os.sched_getaffinity(0))
        assert report["cpu_ms_per_token_c8"] == round(1e3 * cpu.cpu_s[8] / 4, 3)
        assert report["cpu_cores_busy_c8"] == round(cpu.cpu_s[8] / cpu.wall_s[8], 3)
        assert "cpu_per_token_ratio_c8" not in report   # no c=1 rounds booked
    finally:
        burner.kill()
        burner.wait(60)
