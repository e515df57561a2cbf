"""The swarm a node belongs to: a name, and what the name scopes (pure).

Two households on one LAN both run meshd; with mDNS each would find the
other and their views would merge. A swarm name (``--swarm NAME``, config
``swarm = "NAME"``, ``default`` when not given) keeps them apart in two
places, both derived from one tag, the first TAG_BYTES of
SHA-256(TAG_DOMAIN || name):

* **mDNS** (dht/host/mdns.py): our service instance is named
  ``meshd-<tag>-<random>`` under libp2p's service type ``_p2p._udp.local.``;
  an instance of another tag (or none: any other libp2p program) is never
  resolved nor dialed. The name is read before any other record of the
  instance is asked for, so other swarms cost us one PTR record each.
* **The DHT protocol id**: the Kademlia RPCs run on
  ``/meshd/kad/<tag>/1.0.0`` (dht/node.py, dht/rpc.py) instead of the
  library's ``/ipfs/kad/1.0.0``. A peer of another swarm that gets connected
  anyway (a mistaken ``--bootstrap``, a relay both use) cannot open our DHT
  protocol: it never answers a lookup, never takes a PUT, never enters our
  routing table (DhtNode checks a connected peer speaks our protocol before
  adding it), so no record of its swarm reaches ours. Everything a node
  believes about the swarm -- coverage, tracker duty, routes -- is computed
  from DHT records, so the views stay apart. The same id keeps meshd out of
  the IPFS DHT, whose peers (kubo finds them by mDNS too) speak
  ``/ipfs/kad/1.0.0``.

Why not the name inside the signed records: a name scopes, it does not
guard. It is no secret (mDNS shows its tag to the LAN, and a short name is
guessed from its tag in seconds), so a record bound to it would stop no
one who wants in; it would only cost a schema change. Records stay signed
and validated as before: discovery and scoping find peers, they grant no
trust. Why the tag and not the name on the wire: the LAN need not read a
household's chosen name, and the tag has a fixed size that fits a DNS label.

Names are case-insensitive (lower-cased before hashing): "Smith" and
"smith" are one swarm.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from dht.host.errors import SwarmNameInvalid

__all__ = ["SwarmScope", "DEFAULT_SWARM_NAME", "DEFAULT_SCOPE", "MAX_SWARM_NAME_CHARS", "MDNS_INSTANCE_PREFIX"]

DEFAULT_SWARM_NAME = "default"
# A name a person types and reads back in `meshd status`; 64 characters is plenty for that.
MAX_SWARM_NAME_CHARS = 64
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# Domain separation of the tag hash: the tag of a swarm name is no other hash of it.
TAG_DOMAIN = b"meshd-swarm-v1\x00"
# 8 bytes (16 hex digits): two households' names collide with probability ~2^-64.
TAG_BYTES = 8
# Every meshd mDNS instance name starts with this, then the tag, "-", and random characters.
MDNS_INSTANCE_PREFIX = "meshd-"


@dataclass(frozen=True, slots=True)
class SwarmScope:
    """A validated swarm name and the identifiers it scopes (see the module docstring)."""

    name: str = DEFAULT_SWARM_NAME
    tag: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise SwarmNameInvalid(f"the swarm name must be text, not {type(self.name).__name__}")
        name = self.name.strip().lower()
        if not 0 < len(name) <= MAX_SWARM_NAME_CHARS or not name.isascii() or not _NAME_RE.match(name):
            raise SwarmNameInvalid(
                f"swarm name {self.name[:80]!r}: use 1 to {MAX_SWARM_NAME_CHARS} letters, digits, '.', '_' "
                "or '-', starting with a letter or digit (e.g. --swarm smith-house)")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "tag", hashlib.sha256(TAG_DOMAIN + name.encode()).digest()[:TAG_BYTES].hex())

    @property
    def dht_protocol(self) -> str:
        """The Kademlia protocol id of this swarm's DHT."""
        return f"/meshd/kad/{self.tag}/1.0.0"

    @property
    def mdns_prefix(self) -> str:
        """What every mDNS instance name of this swarm starts with."""
        return f"{MDNS_INSTANCE_PREFIX}{self.tag}-"

    def status(self) -> dict:
        return {"name": self.name, "tag": self.tag, "dht_protocol": self.dht_protocol}


DEFAULT_SCOPE = SwarmScope()
