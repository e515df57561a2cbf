"""A relay announces itself in the DHT: sign, publish, republish (``meshd relay``).

    announce_relay(identity, addrs_fn, publish, ttl_s, wall_ms, wake)
      every ttl/3, and when ``wake()`` fires (a peer connected to us; at most
      once per ANNOUNCE_MIN_GAP_S):
                    RelayPayload{peer id, public addrs, issued, expires, sequence}
                    -> sign (dht/relay_records.py) -> publish (DhtNode.publish_relay)

Publishing when a peer connects puts our record in that peer's store at
once: a node that bootstraps through us, or through a peer that did, finds
us in its first relay read instead of at our next republish (up to ttl/3,
40 s by default, which a cold-starting home node would otherwise wait between
its "private" verdict and its first reservation).

Sequence numbers are ``max(last + 1, wall ms)`` like capability records
(meshd/daemon/advertiser.py): strictly increasing within a run and across restarts.
A publish that fails is retried after ``RETRY_S``; a stalled one is cut at
the interval so the record never lapses from our own store. The relay's
public addresses are its listen addresses minus unspecified ones
(``public_addrs``); a relay listening on 0.0.0.0 needs ``advertise_host``.

State: the last sequence number, owned by the loop.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

import trio

from dht.identity import Identity
from dht.relay_records import MAX_RELAY_ADDRS, RelayRecord, sign_relay, validate_relay

log = logging.getLogger(__name__)

__all__ = ["announce_relay", "public_addrs", "RETRY_S", "ANNOUNCE_MIN_GAP_S"]

# A failed publish is retried this soon, not a whole interval later.
RETRY_S = 2.0
# Connections arriving together (a swarm starting) make one publish per this gap.
ANNOUNCE_MIN_GAP_S = 1.0

Publish = Callable[[RelayRecord], Awaitable[int]]


def public_addrs(listen_addrs: Iterable[str], peer_id: str, advertise_host: str | None = None) -> tuple[str, ...]:
    """Dialable relay addresses, each ending in /p2p/<peer id> (at most MAX_RELAY_ADDRS)."""
    out: list[str] = []
    for text in listen_addrs:
        base = text.split("/p2p/")[0]
        parts = base.split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            continue
        if parts[2] in ("0.0.0.0", "::"):
            if not advertise_host:
                continue
            parts[1], parts[2] = ("ip6" if ":" in advertise_host else "ip4"), advertise_host
        addr = "/".join(parts) + f"/p2p/{peer_id}"
        if addr not in out:
            out.append(addr)
    return tuple(out[:MAX_RELAY_ADDRS])


async def announce_relay(identity: Identity, addrs: Callable[[], Sequence[str]], publish: Publish, *,
                         ttl_s: float, wall_ms: Callable[[], int],
                         on_published: Callable[[RelayRecord, int], None] = lambda record, acks: None,
                         wake: Callable[[], trio.Event] | None = None,
                         task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Publish our relay record now, every ``ttl_s / 3`` and whenever the event ``wake()``
    returns (a fresh one, asked for before each publish) is set (not sooner than
    ANNOUNCE_MIN_GAP_S after the last), until cancelled;
    ``on_published(record, acks)`` after each publish that completed."""
    interval = ttl_s / 3.0
    ttl_ms = int(ttl_s * 1000)
    key = identity.signing_key
    last = 0
    started = False
    while True:
        delay = interval
        armed = wake() if wake is not None else None   # armed before publishing: no arrival is missed
        current = tuple(addrs())
        if current:
            last = max(last + 1, wall_ms())
            record = validate_relay(sign_relay(current, key, peer_id=identity.peer_id, sequence=last,
                                               now_ms=wall_ms(), ttl_ms=ttl_ms), wall_ms())
            with trio.move_on_after(interval) as scope:
                try:
                    acked = await publish(record)
                    log.info("relay record %d published (%d acks)", last, acked)
                    on_published(record, acked)
                except Exception as exc:  # noqa: BLE001 - DHT errors of every kind: retry soon
                    log.warning("publishing the relay record failed: %s", exc)
                    delay = RETRY_S
            if scope.cancelled_caught:
                delay = 0.0
        else:
            log.warning("no public address to announce (listening on 0.0.0.0 needs advertise_host)")
        if not started:
            started = True
            task_status.started()
        if armed is None:
            await trio.sleep(delay)
            continue
        with trio.move_on_after(delay):
            await trio.sleep(min(delay, ANNOUNCE_MIN_GAP_S))
            await armed.wait()
