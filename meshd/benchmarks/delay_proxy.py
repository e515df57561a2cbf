"""A TCP forwarder that delays every byte by a fixed one-way time (the WAN bench's wire).

    python -m meshd.benchmarks.delay_proxy DELAY_MS LISTEN_HOST:PORT=TARGET_HOST:PORT ...

Why userspace: this machine's kernel has no ``sch_netem`` (``tc qdisc add ...
netem`` answers "Specified qdisc kind is unknown" and there are no modules to
load), so the delay is added here. Each accepted connection gets a connection
to its target and two pumps; a pump stamps every chunk it reads with
``now + delay`` and a writer sends it when that time comes. Chunks are
pipelined (a second chunk does not wait for the first one's delay to end), so
this emulates latency, not a bandwidth limit: a round trip through it costs
2 x DELAY plus loopback. Both directions are delayed, so DELAY = RTT / 2.

Bounds: MAX_CONNECTIONS live connections, reads of READ_BYTES; it exits on
SIGTERM. It prints "ready" once every listener is bound.
"""
from __future__ import annotations

import heapq
import signal
import socket
import sys
import threading
import time

MAX_CONNECTIONS = 256
READ_BYTES = 256 * 1024


def _pump(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
    pending: list[tuple[float, int, bytes | None]] = []
    cond = threading.Condition()
    seq = 0

    def writer() -> None:
        while True:
            with cond:
                while not pending:
                    cond.wait()
                due, _, data = pending[0]
                wait = due - time.monotonic()
                if wait > 0:
                    cond.wait(wait)
                    continue
                heapq.heappop(pending)
            if data is None:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        while True:
            try:
                data = src.recv(READ_BYTES)
            except OSError:
                data = b""
            with cond:
                seq += 1
                heapq.heappush(pending, (time.monotonic() + delay_s, seq, data or None))
                cond.notify()
            if not data:
                break
    finally:
        thread.join(timeout=delay_s + 30)


def _serve(listen: tuple[str, int], target: tuple[str, int], delay_s: float, live: threading.BoundedSemaphore,
           ready: threading.Barrier) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(listen)
    server.listen(64)
    ready.wait()
    while True:
        conn, _ = server.accept()
        if not live.acquire(blocking=False):
            conn.close()
            continue
        threading.Thread(target=_connection, args=(conn, target, delay_s, live), daemon=True).start()


def _connection(conn: socket.socket, target: tuple[str, int], delay_s: float, live: threading.BoundedSemaphore) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
        upstream.settimeout(None)
        for s in (conn, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=_pump, args=(upstream, conn, delay_s), daemon=True)
        back.start()
        _pump(conn, upstream, delay_s)
        back.join()
    except OSError:
        pass
    finally:
        conn.close()
        live.release()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    delay_s = float(argv[0]) / 1000.0
    pairs = [tuple(_addr(x) for x in spec.split("=", 1)) for spec in argv[1:]]
    live = threading.BoundedSemaphore(MAX_CONNECTIONS)
    ready = threading.Barrier(len(pairs) + 1)
    for listen, target in pairs:
        threading.Thread(target=_serve, args=(listen, target, delay_s, live, ready), daemon=True).start()
    ready.wait(timeout=30)
    print("ready", flush=True)
    stop: list[int] = []   # no Event.set() in a signal handler: it can deadlock against Event.wait()
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    while not stop:
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
