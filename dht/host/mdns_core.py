"""mDNS discovery without I/O: which announcements are ours, what they say, whom to dial when.

The edge (dht/host/mdns.py) feeds this core three kinds of events and asks
it one question:

* ``seen(name)``: a service instance appeared under libp2p's service type.
  Only a name ``meshd-<our tag>-...`` is resolved further; any other is
  remembered as ignored (another swarm's, or not meshd at all: kubo, other
  libp2p programs) and costs nothing more.
* ``resolved(name, txt, now)``: the instance's TXT record, parsed by
  ``parse_announcement``: every ``dnsaddr`` entry must be
  ``/ip4/A/tcp/P/p2p/<peer id>`` with one peer id throughout; addresses
  outside the networks of the interfaces we run mDNS on are dropped (a LAN
  announcement cannot make us dial the internet); everything is bounded
  (entries, characters, addresses kept).
* ``removed(name)``: the instance said goodbye or expired.
* ``due(now, connected)``: the peers to dial now. A peer we are connected to
  needs nothing; the others are dialed at once when our peer id is the
  smaller, after DIAL_DEFER_S otherwise (both sides see each other at the
  same moment; one connection is enough), again after DIAL_BACKOFF_S steps
  when a dial failed, and REDIAL_AFTER_DROP_S after a connection went away
  (a LAN swarm found by mDNS has no bootstrap list to fall back on).

Discovery finds peers; it grants no trust. The dial runs Noise, which
proves the peer owns the announced id, and everything the peer later says
arrives in signed records the DHT validates as always.

State: the peers found (by peer id, bounded by MAX_PEERS) and the names
ignored (bounded by MAX_IGNORED), owned by one ``MdnsPeers``.
"""
from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Announcement", "Rejected", "FoundPeer", "MdnsPeers", "parse_announcement", "classify_name",
           "MAX_PEERS", "MAX_TXT_ENTRIES", "MAX_PEER_ADDRS"]

# TXT entries read per announcement: libp2p puts one dnsaddr per address; a node has a handful.
MAX_TXT_ENTRIES = 32
# One "/ip4/255.255.255.255/tcp/65535/p2p/<52-char id>" is under 90 characters.
MAX_ADDR_CHARS = 256
# Addresses kept per peer (on the networks we share with it).
MAX_PEER_ADDRS = 8
# Peers found by mDNS and kept: a home LAN has a few machines; 64 bounds a flood of announcements.
MAX_PEERS = 64
# Names of other swarms' and other programs' instances remembered for `meshd status`.
MAX_IGNORED = 256
# The larger peer id waits this long for the smaller one's dial before dialing itself.
DIAL_DEFER_S = 2.0
# Waits after the n-th failed dial of a peer (the last one repeats while it stays announced).
DIAL_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# A connection that went away is redialed after this (the DHT may have closed it as stuck).
REDIAL_AFTER_DROP_S = 5.0
# Peer ids: base58 of a multihash (identity for Ed25519 keys: "12D3KooW...", sha2-256: "Qm...").
MAX_PEER_ID_CHARS = 128
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}
_MULTIHASH_IDENTITY, _MULTIHASH_SHA256 = 0x00, 0x12

OURS, NOT_MESHD, OTHER_SWARM, BAD_NAME = "ours", "not_meshd", "other_swarm", "bad_name"


@dataclass(frozen=True, slots=True)
class Announcement:
    peer_id: str
    addrs: tuple[str, ...]      # "/ip4/A/tcp/P", on a network we share


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str                 # why an announcement is not a peer to dial (shown by `meshd status`)


@dataclass(slots=True)
class FoundPeer:
    peer_id: str
    name: str                   # its mDNS instance name
    addrs: tuple[str, ...]
    state: str = "found"        # found | dialing | connected | failed
    attempts: int = 0           # failed dials in a row
    next_dial: float = 0.0
    last_error: str = ""


def classify_name(name: str, service_type: str, prefix: str) -> str:
    """OURS, OTHER_SWARM (another meshd swarm), NOT_MESHD, or BAD_NAME (not under ``service_type``)."""
    suffix = "." + service_type
    if not isinstance(name, str) or not name.endswith(suffix) or len(name) > 255:
        return BAD_NAME
    instance = name[: -len(suffix)]
    if instance.startswith(prefix) and len(instance) > len(prefix):
        return OURS
    return OTHER_SWARM if instance.startswith("meshd-") else NOT_MESHD


def _b58decode(text: str) -> bytes | None:
    if not 0 < len(text) <= MAX_PEER_ID_CHARS:
        return None
    n = 0
    for c in text:
        digit = _B58_INDEX.get(c)
        if digit is None:
            return None
        n = n * 58 + digit
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\x00" * (len(text) - len(text.lstrip("1"))) + body


def valid_peer_id(text: str) -> bool:
    """A base58 multihash of the identity or sha2-256 kind, its length byte matching."""
    raw = _b58decode(text)
    return (raw is not None and len(raw) >= 3 and raw[0] in (_MULTIHASH_IDENTITY, _MULTIHASH_SHA256)
            and raw[1] == len(raw) - 2)


def _parse_dnsaddr(text: str) -> tuple[str, int, str] | None:
    """(ip, port, peer id) of "/ip4/A/tcp/P/p2p/ID", None for anything else."""
    parts = text.split("/")
    if len(parts) != 7 or parts[0] or parts[1] != "ip4" or parts[3] != "tcp" or parts[5] != "p2p":
        return None
    try:
        ip = ipaddress.IPv4Address(parts[2])
    except ValueError:
        return None
    if not (parts[4].isascii() and parts[4].isdigit() and len(parts[4]) <= 5 and 0 < int(parts[4]) <= 65535):
        return None
    if ip.is_unspecified or ip.is_multicast:
        return None
    return str(ip), int(parts[4]), parts[6]


def parse_announcement(txt: Mapping, *, networks: Sequence[ipaddress.IPv4Network], me: str
                       ) -> Announcement | Rejected:
    """The peer and its dialable addresses in an instance's TXT record (see the module docstring)."""
    if not isinstance(txt, Mapping):
        return Rejected("bad_record")
    peer_id = None
    addrs: list[str] = []
    off_lan = 0
    for i, (key, value) in enumerate(txt.items()):
        if i >= MAX_TXT_ENTRIES:
            break
        if not isinstance(key, bytes) or not key.startswith(b"dnsaddr"):
            continue
        if not isinstance(value, bytes) or len(value) > MAX_ADDR_CHARS or not value.isascii():
            return Rejected("bad_record")
        parsed = _parse_dnsaddr(value.decode("ascii"))
        if parsed is None:
            continue      # another transport (quic, ip6, ...): not one we dial from mDNS
        ip, port, pid = parsed
        if peer_id is None:
            peer_id = pid
        elif pid != peer_id:
            return Rejected("bad_record")       # one instance, one peer
        if not any(ipaddress.IPv4Address(ip) in net for net in networks):
            off_lan += 1
            continue
        addr = f"/ip4/{ip}/tcp/{port}"
        if addr not in addrs and len(addrs) < MAX_PEER_ADDRS:
            addrs.append(addr)
    if peer_id is None or not valid_peer_id(peer_id):
        return Rejected("bad_record")
    if peer_id == me:
        return Rejected("self")
    if not addrs:
        return Rejected("off_lan" if off_lan else "bad_record")
    return Announcement(peer_id, tuple(addrs))


class MdnsPeers:
    """The peers of our swarm found by mDNS, and the names ignored (see the module docstring)."""

    def __init__(self, me: str, prefix: str, service_type: str, *, max_peers: int = MAX_PEERS) -> None:
        self.me, self.prefix, self.service_type = me, prefix, service_type
        self.max_peers = max_peers
        self.peers: dict[str, FoundPeer] = {}
        self.ignored: OrderedDict[str, str] = OrderedDict()    # instance name -> why
        self.found_total = 0                                    # announcements of our swarm accepted

    # ------------------------------------------------------------------ events
    def seen(self, name: str) -> bool:
        """An instance appeared or changed: True when it is one of ours to resolve."""
        kind = classify_name(name, self.service_type, self.prefix)
        if kind == OURS:
            return True
        if kind != BAD_NAME:
            self._ignore(name, kind)
        return False

    def resolved(self, name: str, txt: Mapping, networks: Sequence[ipaddress.IPv4Network],
                 now: float) -> FoundPeer | Rejected:
        """One of our instances' TXT record arrived: a peer to dial, or why not."""
        if classify_name(name, self.service_type, self.prefix) != OURS:
            return Rejected("not_ours")
        got = parse_announcement(txt, networks=networks, me=self.me)
        if isinstance(got, Rejected):
            if got.reason != "self":
                self._ignore(name, got.reason)
            return got
        peer = self.peers.get(got.peer_id)
        if peer is None:
            if len(self.peers) >= self.max_peers:
                self._ignore(name, "table_full")
                return Rejected("table_full")
            first = now if self.me < got.peer_id else now + DIAL_DEFER_S
            peer = self.peers[got.peer_id] = FoundPeer(got.peer_id, name, got.addrs, next_dial=first)
            self.found_total += 1
            return peer
        peer.name, peer.addrs = name, got.addrs      # a restart (new instance) or new addresses
        if peer.state == "failed":
            peer.state, peer.attempts, peer.next_dial = "found", 0, now   # announced afresh: try at once
        return peer

    def removed(self, name: str) -> None:
        """An instance said goodbye (or expired): forget the peer it announced."""
        self.ignored.pop(name, None)
        for peer_id, peer in list(self.peers.items()):
            if peer.name == name:
                del self.peers[peer_id]

    def due(self, now: float, connected: Collection[str]) -> list[FoundPeer]:
        """The peers to dial now (marked dialing); notes connections made and lost."""
        out = []
        for peer in self.peers.values():
            if peer.peer_id in connected:
                if peer.state != "dialing":
                    peer.state, peer.attempts, peer.last_error = "connected", 0, ""
                continue
            if peer.state == "connected":           # it was, and is no longer
                peer.state, peer.next_dial = "found", now + REDIAL_AFTER_DROP_S
            if peer.state != "dialing" and peer.next_dial <= now:
                peer.state = "dialing"
                out.append(peer)
        return out

    def dialed(self, peer_id: str, ok: bool, now: float, error: str = "") -> None:
        """The outcome of a dial ``due`` asked for."""
        peer = self.peers.get(peer_id)
        if peer is None:
            return                                   # its instance went away meanwhile
        if ok:
            peer.state, peer.attempts, peer.last_error = "connected", 0, ""
            return
        peer.attempts += 1
        peer.state, peer.last_error = "failed", error[:200]
        peer.next_dial = now + DIAL_BACKOFF_S[min(peer.attempts, len(DIAL_BACKOFF_S)) - 1]

    def next_due(self) -> float | None:
        """The earliest time a peer not dialing now becomes due (None: nothing waits)."""
        waits = [p.next_dial for p in self.peers.values() if p.state in ("found", "failed")]
        return min(waits) if waits else None

    # ------------------------------------------------------------------ status
    def _ignore(self, name: str, why: str) -> None:
        self.ignored.pop(name, None)
        self.ignored[name] = why
        while len(self.ignored) > MAX_IGNORED:
            self.ignored.popitem(last=False)

    def snapshot(self) -> dict:
        counts: dict[str, int] = {}
        for why in self.ignored.values():
            counts[why] = counts.get(why, 0) + 1
        return {"found": self.found_total,
                "peers": [{"peer_id": p.peer_id, "addrs": list(p.addrs), "state": p.state, "attempts": p.attempts,
                           "last_error": p.last_error} for p in sorted(self.peers.values(), key=lambda p: p.peer_id)],
                "ignored": dict(sorted(counts.items()))}
