"""Worker restarts back off exponentially and `meshd status` shows the last failure.

Under trio's MockClock (autojump) with lives that are real subprocesses: a child
that fails (exit code, or a signal) costs no virtual time, so the start times are
exactly the backoff schedule. The pump that carries a worker's output is the
daemon's own (WorkerProcess._pump): tracebacks stay in worker.log.
"""
from __future__ import annotations

import os
import sys

import pytest
import trio
import trio.testing

from meshd.cli.status_view import failure_lines, render_status
from meshd.daemon.supervisor import Backoff, Supervisor, WorkerReady
from meshd.daemon.worker_process import ChildProcess, WorkerProcess, stop_child
from proto import shard_runtime_pb2 as pb
from shard.session.worklog import TRACE_MARK
from tests._daemon_helpers import subprocess_env

FAILS_TO_LOAD = r"""
import sys
print("[shard load 0:1/2] building layers on meta", file=sys.stderr)
print("[worker] ERROR meshd.worker: loading failed", file=sys.stderr)
print("  | Traceback (most recent call last):", file=sys.stderr)
print("  | KeyError: 'no_such_act'", file=sys.stderr)
print("cannot load /models/odd layers 0:1: unexpected KeyError: 'no_such_act'", file=sys.stderr)
sys.exit(1)
"""
KILLED_AFTER_READY = r"""
import os, signal
print("ready 127.0.0.1:1", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _run(fn):
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def subprocess_life(script: str, log_path, *, ready_on_line: bool = False, progress=None):
    """A real life: spawn ``python -c script`` as the daemon spawns its worker, pump its output
    with the daemon's pump into ``log_path``, report ready on its "ready" line, return its exit code."""
    pumps = WorkerProcess(spec=None, progress=progress)

    async def life(on_ready, state) -> int:
        proc = ChildProcess.spawn([sys.executable, "-c", script], subprocess_env())
        state.pid, state.log_path = proc.pid, str(log_path)
        ready = trio.Event()
        try:
            async with trio.open_nursery() as nursery:      # both pumps end at the child's EOF
                nursery.start_soon(pumps._pump, proc.stdout, log_path, state, ready)
                nursery.start_soon(pumps._pump, proc.stderr, log_path, state, None)
            if ready_on_line and ready.is_set():
                await on_ready(WorkerReady("127.0.0.1:1", "", proc.pid, pb.CapabilityReport()))
            return await proc.wait()
        finally:
            with trio.CancelScope(shield=True):
                await stop_child(proc)
    return life


async def _noop(*_):
    pass


def test_a_worker_that_never_loads_is_retried_on_the_backoff_schedule_and_status_says_why(tmp_path):
    starts: list[float] = []
    shown: list[str] = []
    log_path = tmp_path / "worker.log"
    real = subprocess_life(FAILS_TO_LOAD, log_path, progress=shown.append)

    async def main():
        t0 = trio.current_time()
        five = trio.Event()

        async def life(on_ready, state):
            starts.append(trio.current_time() - t0)
            if len(starts) == 5:
                five.set()
                await trio.sleep_forever()
            return await real(on_ready, state)

        sup = Supervisor(life, on_ready=_noop, on_down=_noop, backoff=Backoff(1.0, 4.0, 10.0), wall=lambda: 1e9)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            await five.wait()
            status = sup.state.as_dict()
            nursery.cancel_scope.cancel()
        assert starts == [0, 1, 3, 7, 11]                 # 1, 2, 4, then the cap
        assert status["state"] == "starting" and status["restarts"] == 4 and status["log"] == str(log_path)
        assert status["last_failure"] == {
            "at_unix_s": 1e9, "message": "the worker exited with code 1", "exit_code": 1, "signal": None,
            "was_ready": False, "next_restart_in_s": None,       # it has been restarted since
            "stderr_tail": ["[shard load 0:1/2] building layers on meta",
                            "[worker] ERROR meshd.worker: loading failed",
                            "cannot load /models/odd layers 0:1: unexpected KeyError: 'no_such_act'"]}

    _run(main)
    text = log_path.read_text()
    assert text.count(TRACE_MARK + "KeyError: 'no_such_act'") == 4      # every life's traceback, in the log
    assert not any(line.startswith(TRACE_MARK) for line in shown)       # none on the user's terminal
    assert shown.count("cannot load /models/odd layers 0:1: unexpected KeyError: 'no_such_act'") == 4


def test_a_signal_is_named_and_the_wait_shows_in_status(tmp_path):
    async def main():
        t0 = trio.current_time()
        seen: dict = {}
        real = subprocess_life(KILLED_AFTER_READY, tmp_path / "worker.log", ready_on_line=True)
        lives = [0]

        async def life(on_ready, state):
            lives[0] += 1
            if lives[0] > 1:
                await trio.sleep_forever()
            return await real(on_ready, state)

        down = trio.Event()

        async def on_down():
            down.set()

        sup = Supervisor(life, on_ready=_noop, on_down=on_down, backoff=Backoff(30.0, 300.0), wall=lambda: 1e9)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            await down.wait()                  # no timer is pending while the child runs: time stays put
            assert trio.current_time() == t0
            await trio.sleep(12.5)             # inside the 30 s wait
            seen = sup.state.as_dict()
            nursery.cancel_scope.cancel()
        failure = seen["last_failure"]
        assert failure["message"] == "the worker was killed by SIGKILL"
        assert (failure["exit_code"], failure["signal"], failure["was_ready"]) == (-9, "SIGKILL", True)
        assert failure["next_restart_in_s"] == 17.5 and seen["state"] == "restarting"
        assert seen["pid"] is None and seen["last_exit"] == -9
        text = render_status({"peer_id": "p", "addresses": [], "peers": [], "routing_table": 0, "coverage": {},
                              "own": {"layers": None}, "worker": seen})
        assert "worker     restarting, 0 restarts, next start in 18 s" in text   # 17.5 rounds to even
        assert "  failed   " in text and "the worker was killed by SIGKILL" in text

    _run(main)


def test_the_backoff_starts_over_after_a_worker_served_long_enough():
    served = iter([5.0, 5.0, 130.0, 5.0, 1000.0])
    starts: list[float] = []

    async def life(on_ready, state):
        starts.append(trio.current_time())
        await trio.sleep(2.0)                                # loading does not count as service
        await on_ready(WorkerReady("127.0.0.1:1", "", 1, pb.CapabilityReport()))
        await trio.sleep(next(served))
        return 1

    async def main():
        t0 = trio.current_time()
        sup = Supervisor(life, on_ready=_noop, on_down=_noop, backoff=Backoff(1.0, 300.0, 120.0))
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            await trio.sleep(200)     # the fifth life is still serving then
            nursery.cancel_scope.cancel()
        # lives of 7 s (2 loading + 5 serving); delays 1, 2, then 130 s served: 1 again, then 2
        assert [round(t - t0, 3) for t in starts] == [0, 8, 17, 150, 159]

    _run(main)


def test_failure_lines_render_when_how_and_the_tail():
    failure = {"at_unix_s": 1_000_000.0, "message": "the worker exited with code 1", "exit_code": 1,
               "signal": None, "was_ready": False, "next_restart_in_s": 4.0,
               "stderr_tail": ["cannot load /m layers 0:1: bad file"]}
    lines = failure_lines(failure, "/data/worker.log", now=1_000_042.0)
    assert lines[0].endswith("(42 s ago): the worker exited with code 1 before it was ready")
    assert lines[1:] == ["           cannot load /m layers 0:1: bad file", "  log      /data/worker.log"]
    assert os.path.basename(lines[-1].split()[-1]) == "worker.log"


# ------------------------------------------------------------------ through a real daemon

BAD_MODEL_CONFIG = ('{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, '
                    '"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, '
                    '"hidden_act": "no_such_act"}')
DAEMON_TIMEOUT_S = 240


@pytest.mark.slow
def test_a_daemon_whose_worker_cannot_load_the_model_says_why_in_status_not_with_a_traceback(tmp_path):
    import json
    import signal
    import subprocess
    import time

    import torch
    from safetensors.torch import save_file

    from tests._daemon_helpers import REPO_ROOT

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(BAD_MODEL_CONFIG)
    save_file({"x": torch.zeros(2)}, str(model / "model.safetensors"))
    data = tmp_path / "data"
    terminal = open(tmp_path / "terminal.txt", "w")
    daemon = subprocess.Popen([sys.executable, "-m", "meshd", "join", "--model", str(model), "--layers", "0:1",
                               "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(data)],
                              cwd=REPO_ROOT, env=subprocess_env(), stdout=terminal, stderr=subprocess.STDOUT)

    def status(as_json=True):
        r = subprocess.run([sys.executable, "-m", "meshd", "status", "--data-dir", str(data)]
                           + (["--json"] if as_json else []), cwd=REPO_ROOT, env=subprocess_env(),
                           capture_output=True, text=True, timeout=60)
        return (json.loads(r.stdout) if as_json else r.stdout) if r.returncode == 0 else None

    try:
        deadline = time.monotonic() + DAEMON_TIMEOUT_S
        worker = None
        while time.monotonic() < deadline and daemon.poll() is None:
            s = status()
            worker = s and s["worker"]
            if worker and worker.get("last_failure"):
                break
            time.sleep(1.0)
        assert daemon.poll() is None, (tmp_path / "terminal.txt").read_text()[-3000:]
        failure = worker["last_failure"]
        assert failure["exit_code"] == 1 and not failure["was_ready"]
        why = f"cannot load {model} layers 0:1: unexpected KeyError: 'no_such_act' (traceback in the worker log)"
        assert failure["stderr_tail"][-1] == why
        # the daemon built its host through the host builder, and runs our DCUtR policy: all on
        assert {a["name"]: a["applied"] for a in s["libp2p"]["adjustments"]} == {
            "dcutr_policy": True, "libp2p_fastpath": True, "yamux_release_on_read": True, "inbound_limits": True,
            "yamux_window_batching": True, "dial_head_start": True, "no_auto_connect": True, "peer_record_gc": True,
            "dht_inbound_handlers": True, "dht_maintenance": True}
        text = status(as_json=False)
        assert "the worker exited with code 1 before it was ready" in text and why in text
        assert f"log      {data / 'worker.log'}" in text
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
        terminal.close()
    shown = (tmp_path / "terminal.txt").read_text()
    assert code == 0 and why in shown
    assert "Traceback" not in shown and TRACE_MARK not in shown and '  File "' not in shown, shown[-3000:]
    assert TRACE_MARK + "KeyError: 'no_such_act'" in (data / "worker.log").read_text()


def test_status_shows_how_old_the_worker_health_is_and_its_push_streams():
    import time

    from meshd.daemon.supervisor import WorkerState

    state = WorkerState()
    state.state, state.pid = "serving", 42
    state.health = {"state": "serving", "active_sessions": 2, "checked_monotonic_s": time.monotonic() - 3.0,
                    "push_streams": {"frames": 5, "grpc": 1}}
    seen = state.as_dict(now=0.0)
    assert "checked_monotonic_s" not in seen["health"] and 2.9 <= seen["health"]["age_s"] <= 60
    text = render_status({"peer_id": "p", "addresses": [], "peers": [], "routing_table": 0, "coverage": {},
                          "own": {"layers": None}, "worker": seen})
    assert "serving, 2 sessions (health 3 s old)" in text
    assert "streams to successors: 5 over frames, 1 over gRPC" in text
