"""What the generate core sees of its node: a typed view of the swarm, implemented by the daemon.

generate/ sits below the daemon (the import rules), so it never reaches into
the daemon's parts; the daemon's swarm part (meshd/daemon/swarm_part.py
``Swarm``) implements ``EntryView`` and hands itself to ``service.generate``
and ``service.embed``. Exactly what a generation needs:

    identity      ``peer_id`` (routes plan from here; our own worker is a hop like any other)
    the model     ``digest`` (None while it is read), ``num_layers``, ``context_tokens``,
                  ``tokenizer`` (loaded once, kept here), ``config`` (model path, client-only,
                  route topology, refill wait, backend)
    the swarm     ``snapshot`` (latest, replaced whole by the refresh loop: safe to read from
                  the driver's thread), ``fresh_snapshot()`` (a DHT read, in trio),
                  ``pins``/``frames`` from the signed records, ``load`` (our generations' sessions
                  per peer)
    our worker    ``own_worker()`` (None until it serves a validated range), ``own_dialable``
                  (peers can dial it: a loop's head), ``relay_dialer`` (circuits to relayed peers)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from meshd.config import DaemonConfig
from meshd.generate.routes import LoadBook
from meshd.plan.adverts import ShardAd
from proto import shard_runtime_pb2 as pb

__all__ = ["EntryView", "AdsView", "OwnWorker"]


class AdsView(Protocol):
    """A snapshot of the model's live records (meshd/swarm/view.py SwarmSnapshot)."""

    @property
    def ads(self) -> Sequence[ShardAd]: ...

    @property
    def relayed(self) -> Mapping[str, Sequence[str]]:
        """Peer id -> its p2p-circuit addresses (peers behind NAT)."""
        ...


@dataclass(frozen=True, slots=True)
class OwnWorker:
    """This node's worker once it serves: the fingerprint it validated and how the entry reaches it."""

    fingerprint: pb.Fingerprint
    endpoint: str = ""       # loopback plaintext gRPC
    unix: str = ""           # its private frame socket (unix:/path), preferred


class EntryView(Protocol):
    """The node as its generate core sees it (see the module doc)."""

    config: DaemonConfig
    digest: str | None
    num_layers: int
    context_tokens: int
    tokenizer: object | None
    pins: Mapping[str, bytes]
    frames: Mapping[str, str]
    load: LoadBook

    @property
    def peer_id(self) -> str: ...

    @property
    def snapshot(self) -> AdsView | None: ...

    async def fresh_snapshot(self) -> AdsView: ...

    def own_worker(self) -> OwnWorker | None:
        """Our worker, when it serves a validated range (None: still loading, or none at all)."""
        ...

    @property
    def own_dialable(self) -> bool:
        """Peers can dial this node's worker (it may head a pushed loop): not a private node."""
        ...

    @property
    def relay_dialer(self):
        """meshd/reach/relay_dial.py RelayDialer, or None."""
        ...
