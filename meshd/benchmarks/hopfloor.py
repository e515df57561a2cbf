"""The machine's floor for one hop round trip, measured beside ``bench pipeline``.

A decode hop costs at least one loopback round trip in which the peer is busy
computing while the driver sleeps. On small VMs waking a sleeping process is
itself expensive, so ``per_hop_overhead_ms`` is only meaningful next to what
the same machine charges for a round trip that does no meshd work at all:

* ``grpc``: a bidi stream to a grpcio sync server in a subprocess (the
  worker's own server setup and options, identity serializers), fed from a
  bounded queue like the route driver's hop links; the server spins ``hold_ms`` (the
  hops' measured execution time) and echoes a body of the decode frame's size.
* ``socket``: the same over a raw AF_UNIX socketpair with a forked peer: no
  gRPC, no threads; the floor of any transport on this machine.

Both report median(round trip) - hold, in ms. ``python -m
meshd.benchmarks.hopfloor serve PORT_FILE HOLD_MS`` is the echo server.
"""
from __future__ import annotations

import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVICE = "meshd.cli.bench.Echo"
WARMUP = 20
# Echo server start-up bound (a python + grpc import).
SERVE_TIMEOUT_S = 60.0


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def serve(port_file: str, hold_ms: float) -> None:
    from concurrent import futures

    import grpc

    from shard.edges.grpc_server import GRPC_OPTIONS

    hold = hold_ms / 1000

    def echo(requests, context):
        for body in requests:
            _spin(hold)
            yield body

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.stream_stream_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tmp = Path(port_file + ".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, port_file)
    server.wait_for_termination()


def grpc_floor_ms(hold_ms: float, size: int, rounds: int) -> float:
    import grpc

    from meshd.testing.procs import child_env
    from shard.edges.grpc_server import GRPC_OPTIONS

    port_file = os.path.join(tempfile.mkdtemp(prefix="meshd-hopfloor-"), "port")
    proc = subprocess.Popen([sys.executable, "-m", "meshd.benchmarks.hopfloor", "serve", port_file, str(hold_ms)],
                            env=child_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while not os.path.exists(port_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the echo server did not start")
            time.sleep(0.02)
        channel = grpc.insecure_channel(f"127.0.0.1:{Path(port_file).read_text()}", options=GRPC_OPTIONS)
        sends: queue.Queue[object] = queue.Queue(maxsize=16)
        end = object()
        call = channel.stream_stream(f"/{SERVICE}/Echo", request_serializer=None, response_deserializer=None)
        responses = call(iter(sends.get, end), timeout=600)
        body = os.urandom(size)
        samples = []
        for i in range(WARMUP + rounds):
            t0 = time.perf_counter()
            sends.put(body)
            next(responses)
            if i >= WARMUP:
                samples.append(time.perf_counter() - t0)
        sends.put(end)
        responses.cancel()
        channel.close()
        return statistics.median(samples) * 1000 - hold_ms
    finally:
        proc.kill()
        proc.wait()


def socket_floor_ms(hold_ms: float, size: int, rounds: int) -> float:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the peer: echo after holding, until the pair closes
        ours.close()
        try:
            while True:
                data = b""
                while len(data) < size:
                    piece = theirs.recv(size - len(data))
                    if not piece:
                        os._exit(0)
                    data += piece
                _spin(hold_ms / 1000)
                theirs.sendall(data)
        finally:
            os._exit(0)
    theirs.close()
    body = os.urandom(size)
    samples = []
    try:
        for i in range(WARMUP + rounds):
            t0 = time.perf_counter()
            ours.sendall(body)
            got = 0
            while got < size:
                got += len(ours.recv(size - got))
            if i >= WARMUP:
                samples.append(time.perf_counter() - t0)
    finally:
        ours.close()
        os.waitpid(pid, 0)
    return statistics.median(samples) * 1000 - hold_ms


def measure(hold_ms: float, size: int, rounds: int = 100) -> dict:
    return {"grpc_round_trip_floor_ms": grpc_floor_ms(hold_ms, size, rounds),
            "socket_round_trip_floor_ms": socket_floor_ms(hold_ms, size, rounds),
            "floor_hold_ms": hold_ms, "floor_frame_bytes": size}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], float(sys.argv[3]))
    else:
        print("usage: python -m meshd.benchmarks.hopfloor serve PORT_FILE HOLD_MS", file=sys.stderr)
        sys.exit(2)
