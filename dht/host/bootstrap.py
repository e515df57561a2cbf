"""Dialing a node's bootstrap peers, in a few rounds, each dial under a timeout.

``connect_bootstrap`` dials the configured peers concurrently, each under a
timeout, in up to BOOTSTRAP_ROUNDS rounds (a peer whose door was shut for a
moment -- a flood of idle connections, a restart -- gets another try), and
raises ``BootstrapUnreachable`` when none answered in any round. A retry
round is a deliberate redial: py-libp2p 0.8.1 refuses to redial a peer whose
dial failed in the last 60 s (its negative cache in the swarm; no upstream
issue found), so the round lifts that block first.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from dht.host.errors import BootstrapUnreachable

log = logging.getLogger(__name__)

__all__ = ["connect_bootstrap", "BOOTSTRAP_ROUNDS", "BOOTSTRAP_RETRY_PAUSES_S"]

# Rounds of bootstrap dials before giving up, and the pause before each retry round.
BOOTSTRAP_ROUNDS = 3
BOOTSTRAP_RETRY_PAUSES_S = (1.0, 3.0)


async def connect_bootstrap(host, bootstrap: Sequence[str], timeout_s: float, *,
                            rounds: int = BOOTSTRAP_ROUNDS) -> list[str]:
    """Dial every bootstrap peer (concurrently, each under ``timeout_s``), in up to ``rounds``
    rounds until one answered (pauses BOOTSTRAP_RETRY_PAUSES_S between rounds).

    Returns the peer ids reached; raises BootstrapUnreachable when the list was
    non-empty and none answered in any round. Partial failures are logged, not fatal.
    """
    import multiaddr
    from libp2p.peer.peerinfo import info_from_p2p_addr

    if not bootstrap:
        return []
    reached: list[str] = []
    failures: list[str] = []
    attempt = 0

    async def dial(text: str) -> None:
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(text))
        except Exception as exc:  # noqa: BLE001 - library raises assorted types for a bad address
            failures.append(f"{text}: {exc}")
            return
        if info.peer_id == host.get_id():
            return
        if attempt:
            # py-libp2p 0.8.1 refuses to redial a peer whose dial failed in the last 60 s
            # (its negative cache); a retry round is a deliberate redial
            unblock = getattr(host.get_network(), "unblock_peer", None)
            if unblock is not None:
                unblock(info.peer_id)
        with trio.move_on_after(timeout_s) as scope:
            try:
                await host.connect(info)
            except Exception as exc:  # noqa: BLE001 - dial errors: refused, negotiation failed, ...
                failures.append(f"{text}: {type(exc).__name__}")
                return
        if scope.cancelled_caught:
            failures.append(f"{text}: no answer within {timeout_s:g} s")
            return
        reached.append(info.peer_id.to_base58())

    for attempt in range(max(1, rounds)):
        if attempt:
            pause = BOOTSTRAP_RETRY_PAUSES_S[min(attempt, len(BOOTSTRAP_RETRY_PAUSES_S)) - 1]
            log.info("no bootstrap peer answered (%s); trying again in %g s", failures[0], pause)
            await trio.sleep(pause)
        failures = []
        async with trio.open_nursery() as nursery:
            for text in bootstrap:
                nursery.start_soon(dial, text)
        if reached or not failures:
            break
    if not reached and failures:
        raise BootstrapUnreachable(
            f"no bootstrap peer answered ({failures[0]}); check the address and that the peer is running")
    for failure in failures:
        log.warning("bootstrap peer unreachable: %s", failure)
    return reached
