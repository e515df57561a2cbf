"""The WAN bench's delaying forwarder: bytes arrive intact, and no sooner than the delay allows."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

from meshd.daemon.local_swarm import REPO_ROOT, child_env

DELAY_MS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_round_trip_through_the_proxy_takes_twice_the_delay_and_keeps_the_bytes():
    echo = socket.socket()
    echo.bind(("127.0.0.1", 0))
    echo.listen(1)

    def serve():
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    port = _free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "meshd.benchmarks.delay_proxy", str(DELAY_MS),
                              f"127.0.0.1:{port}=127.0.0.1:{echo.getsockname()[1]}"], cwd=REPO_ROOT,
                             env=child_env(1), stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout.readline().strip() == "ready"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            payload = bytes(range(256)) * 4096          # 1 MiB: several chunks, order kept
            t0 = time.monotonic()
            c.sendall(payload)
            got = b""
            while len(got) < len(payload):
                got += c.recv(1 << 20)
            elapsed = time.monotonic() - t0
        assert got == payload
        assert elapsed >= 2 * DELAY_MS / 1000 * 0.95   # a lower bound by construction, not a speed target
    finally:
        proxy.terminate()
        proxy.wait(10)
        echo.close()
