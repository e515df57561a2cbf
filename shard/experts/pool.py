"""ExpertRouter: the shard holder's view of the expert peers, and failover between them.

Data flow of one delegated layer step (``run``, called by shard/experts/dispatch.py's
MoeDispatch inside the forward):

    items (expert, row indices into the batch)      from the router, local order
      -> assign each expert to the first usable peer that serves (layer, expert)
      -> per peer: the batch rows any of its items names, ONCE (ascending),
         each item's indices remapped into them; one request, one reply
      -> a peer whose exchange fails: its link is dropped (never read again),
         the peer cools down for ``COOLDOWN_S``, its experts go to the next
         peer serving them, and so on; experts no peer can serve are handed
         back (MoeDispatch computes those it holds, else the forward fails)

State: the placements (which peer serves which (layer, expert), at which
endpoint, with which certificate pin) -- replaced wholesale by
``set_placements`` or ``load_file`` (the daemon writes the file from the
signed expert records it reads in the DHT) -- one open ExpertConnection per
peer, per-peer cool-down times, and counters: bytes sent/received, requests,
failovers, and the positions the backend ran (so bytes per position can be
reported). One lock guards all of it; ``run`` holds it for the whole step.

Preference: peers in the order of (recent failures, peer id); ``prefer_remote``
sends held experts to peers too (offloading), keeping local compute as the
fallback.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from proto import moe as W
from proto.moe.link import LinkFailed, PeerRefused
from shard.experts.spec import ExpertSpec
from shard.experts.transport import ExpertConnection

__all__ = ["Placement", "ExpertRouter", "placements_from_json", "placements_to_json", "COOLDOWN_S",
           "MAX_PLACEMENT_FILE_BYTES", "MAX_PEERS"]

# A peer whose link failed is not tried again for this long (then a new connection).
COOLDOWN_S = 5.0
# The daemon's placement file: a few hundred bytes per peer.
MAX_PLACEMENT_FILE_BYTES = 4 * 1024 * 1024
MAX_PEERS = 256


@dataclass(frozen=True, slots=True)
class Placement:
    """One expert peer: where it listens, its certificate pin, and the experts it serves."""

    peer_id: str
    host: str
    port: int
    pin: bytes | None
    experts: ExpertSpec

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536 or not self.host or len(self.host) > 255:
            raise ValueError(f"bad expert peer endpoint {self.host}:{self.port}")
        if self.pin is not None and len(self.pin) != 32:
            raise ValueError("an expert peer's pin is the 32-byte SHA-256 of its certificate")


def placements_to_json(placements: list[Placement]) -> str:
    return json.dumps({"peers": [{"peer_id": p.peer_id, "endpoint": f"{p.host}:{p.port}",
                                  "cert_sha256": p.pin.hex() if p.pin else None, "experts": str(p.experts)}
                                 for p in placements]}, sort_keys=True)


def placements_from_json(text: str) -> list[Placement]:
    """Parse the daemon's placement file; ValueError for anything malformed."""
    if len(text) > MAX_PLACEMENT_FILE_BYTES:
        raise ValueError(f"expert placement file over {MAX_PLACEMENT_FILE_BYTES} bytes")
    data = json.loads(text)
    peers = data.get("peers", []) if isinstance(data, dict) else None
    if not isinstance(peers, list) or len(peers) > MAX_PEERS:
        raise ValueError(f"expert placement file needs a list of at most {MAX_PEERS} peers")
    out = []
    try:
        for p in peers:
            host, _, port = str(p["endpoint"]).rpartition(":")
            pin = bytes.fromhex(p["cert_sha256"]) if p.get("cert_sha256") else None
            out.append(Placement(str(p["peer_id"]), host.strip("[]"), int(port), pin,
                                 ExpertSpec.parse(str(p["experts"]))))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed expert placement entry: {exc}") from exc
    return out


Connect = Callable[[Placement], ExpertConnection]


class ExpertRouter:
    def __init__(self, *, artifact: str, recipe: str, act: int = W.ACT_F32, version: int = W.VERSION_ROWS_ONCE,
                 prefer_remote: bool = False, connect: Connect | None = None,
                 clock: Callable[[], float] = time.monotonic, cooldown_s: float = COOLDOWN_S) -> None:
        if version == W.VERSION_COPIES and act != W.ACT_F32:
            raise ValueError("version 1 (row copies) carries float32 rows only")
        self.artifact, self.recipe = artifact, recipe
        self.act, self.version = act, version
        self.prefer_remote = prefer_remote
        self._connect = connect or self._open
        self._clock = clock
        self.cooldown_s = cooldown_s
        self._lock = threading.RLock()
        self._placements: list[Placement] = []
        self._conns: dict[str, ExpertConnection] = {}
        self._cool_until: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        # Peers that refused our hello (version / act / recipe): not tried again until their placement changes.
        self._refused: dict[str, tuple[Placement, str]] = {}
        self._file_stamp: tuple | None = None
        self.bytes_sent = 0        # of links already closed; live links add theirs in stats()
        self.bytes_received = 0
        self.requests = 0
        self.failovers = 0
        self.positions = 0
        self.last_failure = ""

    # ------------------------------------------------------------------ placements
    def _open(self, p: Placement) -> ExpertConnection:
        return ExpertConnection.open(p.peer_id, p.host, p.port, p.pin, version=self.version, act=self.act,
                                     artifact=self.artifact, recipe=self.recipe)

    def set_placements(self, placements: list[Placement]) -> None:
        with self._lock:
            self._placements = sorted(placements, key=lambda p: p.peer_id)[:MAX_PEERS]
            live = {p.peer_id: p for p in self._placements}
            for peer in [peer for peer in self._conns if peer not in live]:
                self._drop(peer)
            self._refused = {peer: (p, why) for peer, (p, why) in self._refused.items() if live.get(peer) == p}

    def load_file(self, path: str | os.PathLike) -> bool:
        """Reload the daemon's placement file when it changed; True when it did."""
        path = Path(path)
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._file_stamp:
            return False
        if st.st_size > MAX_PLACEMENT_FILE_BYTES:
            raise ValueError(f"{path} is over {MAX_PLACEMENT_FILE_BYTES} bytes")
        self.set_placements(placements_from_json(path.read_text()))
        self._file_stamp = stamp
        return True

    def placements(self) -> list[Placement]:
        with self._lock:
            return list(self._placements)

    def can_serve(self, layer: int, expert: int) -> bool:
        with self._lock:
            return any((layer, expert) in p.experts.pairs for p in self._placements)

    def uncovered(self, needed: ExpertSpec) -> ExpertSpec:
        """The pairs of ``needed`` that no known peer (that did not refuse us) serves."""
        with self._lock:
            usable = [p for p in self._placements if p.peer_id not in self._refused]
            served = set().union(*(p.experts.pairs for p in usable)) if usable else set()
        return ExpertSpec(frozenset(needed.pairs - served))

    def probe(self) -> dict[str, str]:
        """Say hello to every peer not connected yet; {peer: why} for those that failed or refused.

        Run before the first token, so a peer that speaks neither our version nor our act is
        refused by name and version up front rather than in the middle of a generation."""
        failed: dict[str, str] = {}
        with self._lock:
            for p in self._placements:
                if p.peer_id in self._conns or p.peer_id in self._refused or not self._usable(p.peer_id):
                    continue
                try:
                    self._connection(p)
                except LinkFailed as exc:
                    self._failed(p.peer_id, exc, counted=False)
                    failed[p.peer_id] = str(exc)
            failed.update({peer: why for peer, (_, why) in self._refused.items()})
        return failed

    def note_positions(self, count: int) -> None:
        with self._lock:
            self.positions += count

    def stats(self) -> dict:
        with self._lock:
            sent = self.bytes_sent + sum(c.link.bytes_sent for c in self._conns.values())
            received = self.bytes_received + sum(c.link.bytes_received for c in self._conns.values())
            return {"peers": len(self._placements), "connected": len(self._conns), "bytes_sent": sent,
                    "bytes_received": received, "requests": self.requests, "failovers": self.failovers,
                    "positions": self.positions, "act": W.act_name(self.act), "version": self.version,
                    "last_failure": self.last_failure}

    # ------------------------------------------------------------------ links
    def _drop(self, peer: str) -> None:
        conn = self._conns.pop(peer, None)
        if conn is not None:
            self.bytes_sent += conn.link.bytes_sent
            self.bytes_received += conn.link.bytes_received
            conn.close()

    def _usable(self, peer: str) -> bool:
        return self._cool_until.get(peer, 0.0) <= self._clock()

    def _candidates(self, layer: int, expert: int, tried: set[str]) -> list[Placement]:
        if expert == W.SHARED and self.version == W.VERSION_COPIES:
            return []   # version 1 has no shared-expert item: the holder runs it
        found = [p for p in self._placements if (layer, expert) in p.experts.pairs
                 and p.peer_id not in tried and p.peer_id not in self._refused and self._usable(p.peer_id)]
        return sorted(found, key=lambda p: (self._failures.get(p.peer_id, 0), p.peer_id))

    def _connection(self, p: Placement) -> ExpertConnection:
        conn = self._conns.get(p.peer_id)
        if conn is None or conn.link.failed:
            if conn is not None:
                self._drop(p.peer_id)
            conn = self._connect(p)
            self._conns[p.peer_id] = conn
        return conn

    def _failed(self, peer: str, exc: LinkFailed, *, counted: bool = True) -> None:
        self._drop(peer)
        self._cool_until[peer] = self._clock() + self.cooldown_s
        self._failures[peer] = self._failures.get(peer, 0) + 1
        self.failovers += counted
        self.last_failure = str(exc)[:300]
        if isinstance(exc, PeerRefused):
            placement = next((p for p in self._placements if p.peer_id == peer), None)
            if placement is not None:
                self._refused[peer] = (placement, str(exc)[:300])

    # ------------------------------------------------------------------ one layer step
    def run(self, layer: int, rows: np.ndarray,
            items: list[tuple[int, np.ndarray]]) -> tuple[dict[int, np.ndarray], list[int]]:
        """Outputs of ``items`` (expert -> float32 [len(index), hidden]) and the experts nobody served."""
        todo = {int(e): np.asarray(idx, dtype=np.int64) for e, idx in items}
        out: dict[int, np.ndarray] = {}
        tried: set[str] = set()
        with self._lock:
            while todo:
                groups: dict[str, tuple[Placement, list[int]]] = {}
                for expert in todo:
                    found = self._candidates(layer, expert, tried)
                    if found:
                        groups.setdefault(found[0].peer_id, (found[0], []))[1].append(expert)
                if not groups:
                    break
                for peer, (placement, experts) in groups.items():
                    try:
                        conn = self._connection(placement)
                        got = self._exchange(conn, layer, rows, [(e, todo[e]) for e in experts])
                    except LinkFailed as exc:
                        self._failed(peer, exc)
                        tried.add(peer)
                        continue
                    self.requests += 1
                    for expert in experts:
                        out[expert] = got[expert]
                        del todo[expert]
        return out, sorted(todo)

    def _exchange(self, conn: ExpertConnection, layer: int, rows: np.ndarray,
                  items: list[tuple[int, np.ndarray]]) -> dict[int, np.ndarray]:
        if self.version == W.VERSION_COPIES:
            reply = conn.exchange(layer, rows, [W.Item(e, idx) for e, idx in items])
        else:
            sent = np.unique(np.concatenate([idx for _, idx in items]))   # each row once, ascending
            sub = rows[sent] if sent.size != rows.shape[0] else rows
            reply = conn.exchange(layer, np.ascontiguousarray(sub, dtype=np.float32),
                                  [W.Item(e, np.searchsorted(sent, idx)) for e, idx in items])
        return {expert: y for expert, y in reply.outputs}
