"""Fixtures for relay tests: real libp2p hosts on loopback, a relay between them,
and a real Unix frame socket speaking the Session stream as a worker does (an echo)."""
from __future__ import annotations

import os
import tempfile
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import multiaddr
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service

from dht.host.build import build_host
from dht.identity import Identity
from proto.frames import FrameReader, encode_frame
from proto.limits import MAX_FRAME_BYTES
from relay.client import dial_relayed, reserve, stop_service
from relay.hop import DEFAULT_HOP_LIMITS, HopService
from relay.local_link import READ_BYTES, UNIX_SCHEME
from shard.edges.socket_server import SocketServer, unix_listener

LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
ECHO_PREFIX = b"echo:"


def new_host():
    return build_host(Identity.from_seed(os.urandom(32)))


@contextmanager
def echo_worker():
    """A Unix frame socket whose Session stream answers every frame with ECHO_PREFIX + frame, and
    ends after the caller's half-close: stands in for the worker where only the byte path is under
    test. Yields its ``unix:/path`` endpoint."""
    def session(sock, _address):
        reader = FrameReader(MAX_FRAME_BYTES)
        while data := sock.recv(READ_BYTES):
            reader.feed(data)
            while (body := reader.next_frame()) is not None:
                sock.sendall(encode_frame(ECHO_PREFIX + body))

    path = Path(tempfile.mkdtemp(prefix="echo-")) / "w.sock"
    server = SocketServer(unix_listener(path), session, name="echo-worker", max_connections=64).start()
    try:
        yield UNIX_SCHEME + str(path)
    finally:
        server.stop()
        path.unlink(missing_ok=True)
        path.parent.rmdir()


def echo_once(transport, body: bytes) -> list[bytes]:
    """One Session stream on ``transport`` (a HopTransport): ``body``, our half-close, every answer."""
    stream = transport.open_session()
    stream.send(body)
    stream.close_send()
    answers = []
    while (answer := stream.receive()) is not None:
        answers.append(answer)
    return answers


def info(host) -> PeerInfo:
    return PeerInfo(host.get_id(), host.get_addrs())


@dataclass
class Triangle:
    relay: object
    hop: HopService
    home: object        # reserved on the relay, serves sessions
    dialer: object      # reaches home only through the relay


@asynccontextmanager
async def triangle(limits=DEFAULT_HOP_LIMITS, tap=None, reserve_home=True, connect=True):
    relay, home, dialer = new_host(), new_host(), new_host()
    async with relay.run(LOOPBACK), home.run(LOOPBACK), dialer.run(LOOPBACK):
        hop = HopService(relay, limits, tap=tap)
        async with background_trio_service(hop), stop_service(home):
            await hop.event_started.wait()
            if reserve_home:
                await reserve(home, info(relay))
            if connect:
                await dial_relayed(dialer, info(relay), home.get_id())
            yield Triangle(relay, hop, home, dialer)


REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def subprocess_env() -> dict:
    env = dict(os.environ)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *inherited])
    return env


@contextmanager
def relay_process(data_dir, listen="/ip4/127.0.0.1/tcp/0", extra=(), netns=None, timeout_s=60.0):
    """Run `meshd relay` in a subprocess; yields its ready JSON ({peer_id, addrs, pid})."""
    import json
    import subprocess
    import sys

    from tests.conftest import wait_until_blocking

    ready = os.path.join(str(data_dir), "relay-ready.json")
    cmd = [sys.executable, "-m", "meshd", "relay", "--listen", listen, "--data-dir", str(data_dir),
           "--ready-file", ready, *extra]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def written() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"meshd relay exited: {proc.stderr.read().decode()[-2000:]}")
            return os.path.exists(ready)

        wait_until_blocking(written, timeout_s, "meshd relay's ready file", poll_s=0.1)
        with open(ready) as f:
            yield json.load(f)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
