"""The daemon's reachability part: can peers dial us, and if not, which relays carry us.

    Relaying.run (a child of the daemon's nursery)
    ├── decide: mode public/private, or (auto) the dial-back probe through
    │   connected peers (relay/reachability.py) -> Verdict; UNKNOWN (nobody
    │   answered) counts as public and is probed again every REPROBE_S, a
    │   decided verdict every RECHECK_S; a change starts or stops the relaying
    └── while PRIVATE:
        ├── STOP service (relay/client.py): circuits addressed to us arrive
        ├── relay list: live relay records from the DHT (/meshd/relays/v1),
        │   refreshed every RELAY_REFRESH_S (RELAY_REFRESH_EMPTY_S while a slot
        │   holds nothing); fallback: our bootstrap peers (a bootstrap peer
        │   that is no relay refuses the reservation); a changed list wakes
        │   the empty slots at once
        └── MAX_RELAY_SLOTS reservation keepers (keep_reserved), started
            together. Each CLAIMS a relay (synchronously, right before its
            RESERVE) and skips relays another slot claims, so two slots never
            sit on one relay while more than one is known. A slot's relay
            connection closing (dht/host/conn_watch.py) withdraws that slot's
            addresses at once (logged) and the slot reserves elsewhere; the
            relayed addrs of all slots, deduplicated, are ``relayed_addrs``,
            and every change calls ``on_change`` (the advertiser republishes)

Sessions arriving over circuits reach our worker through
``RelayedSessionServer`` (relay/transport.py); ``serve_worker(endpoint)``
points it at the worker's current loopback endpoint (a restarted worker
has a new port) and is called by the daemon for every ready worker. The
handler is registered on every node, whatever the verdict: only peers with
a Noise-authenticated connection reach it, as they would reach the worker's
TLS port, and a node whose verdict changes needs nothing re-attached.

State owned here: the verdict, the relay candidates, each slot's claimed
relay and relayed addresses, the count of relay losses and the current
session server. The daemon's Node reads
``decided`` / ``private`` / ``relayed_addrs`` to build its capability claim.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import multiaddr
import trio
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from dht.host.conn_watch import ConnectionWatch
from relay.client import stop_service
from relay.reachability import Verdict, keep_reserved, probe
from relay.transport import RelayedSessionServer

log = logging.getLogger(__name__)

__all__ = ["Relaying", "MAX_RELAY_SLOTS", "relay_candidates"]

# Reservations held at once: a second relay keeps us reachable while the
# first one dies, so a relayed hop can fail over to the same node.
MAX_RELAY_SLOTS = 2
# Relays join and leave slowly; their records live for minutes.
RELAY_REFRESH_S = 15.0
# While a slot holds nothing the list is read this often (a relay record
# reaching the DHT, a relay coming back): one small DHT read per period.
RELAY_REFRESH_EMPTY_S = 2.0
# Peers asked for a dial-back per probe (each answer takes up to 3 s).
MAX_PROBE_HELPERS = 3
# With no answer (no peers yet), probe again this often.
REPROBE_S = 30.0
# A decided verdict (auto mode) is checked again this often: a home network
# changes (new router, port forward added or gone) without telling us.
RECHECK_S = 600.0
# Relay candidates considered (records beyond this are ignored).
MAX_RELAY_CANDIDATES = 16


def relay_candidates(records: Sequence, bootstrap: Sequence[str], own_peer_id: str) -> list[PeerInfo]:
    """DHT relay records first (newest first), then bootstrap peers; never ourselves; deduplicated."""
    out: dict[str, PeerInfo] = {}
    texts = [a for r in sorted(records, key=lambda r: -r.sequence) for a in r.addrs[:1]] + list(bootstrap)
    for text in texts:
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(text))
        except Exception:  # a malformed bootstrap address was refused by the config already
            continue
        pid = info.peer_id.to_base58()
        if pid != own_peer_id and pid not in out:
            out[pid] = info
    return list(out.values())[:MAX_RELAY_CANDIDATES]


class Relaying:
    def __init__(self, host, dht, *, mode: str, bootstrap: Sequence[str], on_change: Callable[[], None],
                 progress: Callable[[str], None] = lambda line: None,
                 own_addrs: Callable[[], Sequence[str]] | None = None) -> None:
        self.host, self.dht, self.mode = host, dht, mode
        # the addresses helpers are asked to dial back: the daemon's dialable ones (a wildcard
        # listener's /ip4/0.0.0.0 rewritten to the address it offers peers); default: the host's
        self.own_addrs = own_addrs or (lambda: [str(a) for a in host.get_addrs()])
        self.bootstrap = tuple(bootstrap)
        self.on_change = on_change
        self.progress = progress
        self.verdict: Verdict | None = None
        self.candidates: list[PeerInfo] = []
        self._slots: list[tuple[str, ...]] = [() for _ in range(MAX_RELAY_SLOTS)]
        self._claims: list[str | None] = [None] * MAX_RELAY_SLOTS   # the relay each slot holds or tries
        self._candidates_changed = trio.Event()
        self._watch: ConnectionWatch | None = None
        self.relay_losses = 0
        self._server: RelayedSessionServer | None = None
        self._own = host.get_id().to_base58()

    # ------------------------------------------------------------------ read by the daemon
    @property
    def decided(self) -> bool:
        return self.verdict is not None

    @property
    def private(self) -> bool:
        return self.verdict is Verdict.PRIVATE

    @property
    def relayed_addrs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a for slot in self._slots for a in slot))

    def status(self) -> dict:
        return {"mode": self.mode, "verdict": self.verdict.value if self.verdict else "probing",
                "relayed_addrs": list(self.relayed_addrs),
                "relays_known": [c.peer_id.to_base58() for c in self.candidates],
                "relays_held": [c for c, addrs in zip(self._claims, self._slots) if c and addrs],
                "relay_losses": self.relay_losses,
                "relayed_sessions": self._server.snapshot() if self._server else None}

    # ------------------------------------------------------------------ worker
    def serve_worker(self, endpoint: str) -> None:
        """Relayed sessions go to the worker at ``endpoint`` from now on: its frame socket
        (``unix:/path``, forwarded inside trio) or its loopback plaintext gRPC port."""
        old, self._server = self._server, RelayedSessionServer(endpoint)
        self._server.attach(self.host)
        if old is not None:
            old.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # ------------------------------------------------------------------ tasks
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Decide the verdict; while PRIVATE hold reservations; in auto mode keep probing
        (every REPROBE_S while UNKNOWN, every RECHECK_S once decided) and follow a change."""
        task_status.started()   # the probe takes seconds: the daemon does not wait for it
        try:
            await self._decide()
            self.on_change()
            while True:
                if self.private:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._relay_forever)
                        await self._until_private_is(False)
                        nursery.cancel_scope.cancel()
                    self._slots = [() for _ in range(MAX_RELAY_SLOTS)]
                    self._claims = [None] * MAX_RELAY_SLOTS
                    self.progress("reachability: no longer relayed")
                else:
                    await self._until_private_is(True)
                self.on_change()
        finally:
            self.close()

    async def _until_private_is(self, private: bool) -> None:
        """Probe again and again (auto mode only) until the verdict's private-ness is ``private``."""
        if self.mode != "auto":
            await trio.sleep_forever()
        while True:
            await trio.sleep(REPROBE_S if self.verdict is Verdict.UNKNOWN else RECHECK_S)
            before = self.verdict
            await self._decide()
            if self.private == private:
                return
            if self.verdict is not before:
                self.on_change()    # UNKNOWN -> PUBLIC: the same role, a settled verdict

    async def _decide(self) -> None:
        if self.mode == "public":
            self.verdict = Verdict.PUBLIC
        elif self.mode == "private":
            self.verdict = Verdict.PRIVATE
        else:
            helpers = list(self.host.get_connected_peers())[:MAX_PROBE_HELPERS]
            own = [str(a).split("/p2p/")[0] for a in self.own_addrs()]
            self.verdict = await probe(self.host, helpers, own) if helpers else Verdict.UNKNOWN
        self.progress(f"reachability: {self.verdict.value}"
                      + (" (mode auto: dial-back probe)" if self.mode == "auto" else f" (mode {self.mode})"))

    async def _relay_forever(self) -> None:
        if self._watch is None:
            self._watch = ConnectionWatch(self.host)
        async with stop_service(self.host):
            async with trio.open_nursery() as nursery:
                await nursery.start(self._refresh_relays)
                for slot in range(MAX_RELAY_SLOTS):
                    # all slots at once: the claims keep them on distinct relays
                    nursery.start_soon(functools.partial(
                        keep_reserved, self.host, functools.partial(self._relays_for, slot),
                        functools.partial(self._on_addrs, slot), wall=time.time,
                        claim=functools.partial(self._claim, slot), watch=self._watch,
                        wake=lambda: self._candidates_changed))

    async def _refresh_relays(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        while True:
            records: list = []
            try:
                with trio.move_on_after(RELAY_REFRESH_S):
                    records = await self.dht.fetch_relays()
            except Exception as exc:  # noqa: BLE001 - a failed DHT read: keep the last list
                log.info("reading relay records failed: %s", exc)
            fresh = relay_candidates(records, self.bootstrap, self._own)
            if [c.peer_id for c in fresh] != [c.peer_id for c in self.candidates]:
                self.candidates = fresh
                self._candidates_changed.set()
                self._candidates_changed = trio.Event()
            task_status.started()
            task_status = trio.TASK_STATUS_IGNORED
            empty = any(not addrs for addrs in self._slots)
            await trio.sleep(RELAY_REFRESH_EMPTY_S if empty else RELAY_REFRESH_S)

    def _claim(self, slot: int, relay: str | None) -> bool:
        """Slot ``slot`` takes ``relay`` (False if another slot has it) or, with None, lets go."""
        if relay is not None and any(c == relay for i, c in enumerate(self._claims) if i != slot):
            return False
        self._claims[slot] = relay
        return True

    def _relays_for(self, slot: int) -> list[PeerInfo]:
        others = {c for i, c in enumerate(self._claims) if i != slot and c}
        return [c for c in self.candidates if c.peer_id.to_base58() not in others]

    def _on_addrs(self, slot: int, addrs: tuple[str, ...]) -> None:
        if addrs == self._slots[slot]:
            return
        if self._slots[slot] and not addrs:
            self.relay_losses += 1
        self._slots[slot] = addrs
        self.progress(f"relay slot {slot}: " + (", ".join(addrs) if addrs else "no reservation"))
        self.on_change()
