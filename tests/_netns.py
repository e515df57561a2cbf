"""Network-namespace topology for relay tests: one public network, two homes behind NAT.

    home1 (10.213.1.2) ──veth── public (10.213.1.1 | 10.213.2.1, forwarding on) ──veth── home2 (10.213.2.2)

Each home namespace has an nftables input chain with policy drop that accepts
only ``lo`` and ``ct state established,related``: outbound connections work,
inbound ones are dropped, exactly as behind a home NAT router. The subnet
10.213.0.0/16 exists only inside these namespaces. Names carry the test
process id so parallel runs never collide; ``down()`` removes everything and
runs in ``finally`` blocks.

``python tests/_netns.py capture OUT MAX_BYTES`` (run inside the public
namespace) captures every frame on every interface with an AF_PACKET socket
until SIGTERM and writes the raw bytes to OUT: what the relay host carries.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# What one test capture may write (a generation on the test model is far smaller).
CAPTURE_MAX_BYTES = 256 * 1024 * 1024


def start_capture(prefix: list[str], out: Path) -> subprocess.Popen:
    """Capture every packet inside the namespace ``prefix`` runs in (this file's ``capture``), once ready."""
    proc = subprocess.Popen([*prefix, sys.executable, str(Path(__file__)), "capture", str(out),
                             str(CAPTURE_MAX_BYTES)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not Path(str(out) + ".ready").exists():
        assert proc.poll() is None, f"capture failed: {proc.stderr.read().decode()}"
        assert time.monotonic() < deadline, "capture did not start"
        time.sleep(0.05)
    return proc


def stop_capture(proc: subprocess.Popen, out: Path) -> bytes:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return out.read_bytes()


SUBNET_PREFIX = "10.213"
NFT_RULES = """table inet meshd_home {
  chain input {
    type filter hook input priority 0; policy drop;
    iif "lo" accept
    ct state established,related accept
  }
}
"""


class NetnsUnavailable(RuntimeError):
    """Namespaces could not be created here; the message says why (tests fail with it)."""


def _run(*cmd: str, input: str | None = None) -> None:
    done = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")


@dataclass
class Topology:
    tag: str

    @property
    def public(self) -> str:
        return f"mr{self.tag}-pub"

    @property
    def homes(self) -> tuple[str, str]:
        return f"mr{self.tag}-h1", f"mr{self.tag}-h2"

    def public_ip(self, home: int) -> str:
        return f"{SUBNET_PREFIX}.{home}.1"

    def home_ip(self, home: int) -> str:
        return f"{SUBNET_PREFIX}.{home}.2"

    def prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def up(self) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (CI runs these tests as root)")
        for tool in ("ip", "nft"):
            if shutil.which(tool) is None:
                raise NetnsUnavailable(f"`{tool}` is not installed (apt-get install -y iproute2 nftables)")
        _run("ip", "netns", "add", self.public)
        _run("ip", "-n", self.public, "link", "set", "lo", "up")
        _run("ip", "netns", "exec", self.public, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for i, home in enumerate(self.homes, start=1):
            a, b = f"mr{self.tag}p{i}", f"mr{self.tag}h{i}"
            _run("ip", "netns", "add", home)
            _run("ip", "-n", home, "link", "set", "lo", "up")
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _run("ip", "link", "set", a, "netns", self.public)
            _run("ip", "link", "set", b, "netns", home)
            _run("ip", "-n", self.public, "addr", "add", f"{self.public_ip(i)}/24", "dev", a)
            _run("ip", "-n", home, "addr", "add", f"{self.home_ip(i)}/24", "dev", b)
            _run("ip", "-n", self.public, "link", "set", a, "up")
            _run("ip", "-n", home, "link", "set", b, "up")
            _run("ip", "-n", home, "route", "add", "default", "via", self.public_ip(i))
            _run("ip", "netns", "exec", home, "nft", "-f", "-", input=NFT_RULES)

    def down(self) -> None:
        for ns in (*self.homes, self.public):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def new_topology() -> Topology:
    # 15-char interface names: "mr" + 5-char tag + "p1" fits.
    return Topology(tag=f"{os.getpid() % 100000:05d}")


def tcp_connects(prefix: list[str], ip: str, port: int, timeout_s: float = 3.0) -> bool:
    """Can a NEW TCP connection be opened from inside a namespace?"""
    code = (f"import socket,sys\ntry:\n socket.create_connection(({ip!r},{port}),timeout={timeout_s}).close()\n"
            f"except OSError: sys.exit(1)\n")
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True,
                          timeout=timeout_s + 30).returncode == 0


def _capture(out: str, max_bytes: int) -> None:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
    data = bytearray()
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True
        sock.close()

    signal.signal(signal.SIGTERM, on_term)
    with open(out + ".ready", "w"):
        pass
    while not stop:
        try:
            frame = sock.recv(65536)
        except OSError:
            break
        if len(data) + len(frame) <= max_bytes:
            data += frame
    with open(out, "wb") as f:
        f.write(data)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "capture":
        _capture(sys.argv[2], int(sys.argv[3]))
    else:
        print("usage: python tests/_netns.py capture OUT MAX_BYTES", file=sys.stderr)
        sys.exit(2)
