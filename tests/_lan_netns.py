"""Network-namespace topology for LAN tests: N machines on one Ethernet bridge (a home LAN).

    node1 (10.214.0.11) ──veth──┐
    node2 (10.214.0.12) ──veth──┤ br0 in the hub namespace (a switch: multicast is flooded)
    ...                         │
    nodeN (10.214.0.1N) ──veth──┘

No default route and no NAT: the nodes see each other and nothing else, and
mDNS (multicast to 224.0.0.251, link-local) reaches every node through the
bridge. Names carry the test process id so parallel runs never collide;
``down()`` removes everything and runs in ``finally`` blocks. The subnet
10.214.0.0/24 exists only inside these namespaces.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from tests._netns import NetnsUnavailable, _run

SUBNET = "10.214.0"
PREFIX_LEN = 24
BRIDGE = "br0"


@dataclass
class Lan:
    tag: str
    size: int

    @property
    def hub(self) -> str:
        return f"ml{self.tag}-hub"

    def node(self, i: int) -> str:
        """The namespace of machine i (1-based)."""
        return f"ml{self.tag}-n{i}"

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on machine i."""
        return ["ip", "netns", "exec", self.node(i)]

    def up(self) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (CI runs these tests as root)")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("`ip` is not installed (apt-get install -y iproute2)")
        _run("ip", "netns", "add", self.hub)
        _run("ip", "-n", self.hub, "link", "set", "lo", "up")
        _run("ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", BRIDGE, "up")
        for i in range(1, self.size + 1):
            ns, a, b = self.node(i), f"ml{self.tag}a{i}", f"ml{self.tag}b{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _run("ip", "link", "set", a, "netns", self.hub)
            _run("ip", "link", "set", b, "netns", ns)
            _run("ip", "-n", self.hub, "link", "set", a, "master", BRIDGE)
            _run("ip", "-n", self.hub, "link", "set", a, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/{PREFIX_LEN}", "dev", b)
            _run("ip", "-n", ns, "link", "set", b, "up")

    def down(self) -> None:
        import subprocess

        for ns in (*(self.node(i) for i in range(1, self.size + 1)), self.hub):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def new_lan(size: int) -> Lan:
    # 15-char interface names: "ml" + 5-char tag + "a9" fits.
    return Lan(tag=f"{os.getpid() % 100000:05d}", size=size)
