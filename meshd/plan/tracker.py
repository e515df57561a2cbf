"""Tracker duty that rotates without consensus.

Every daemon runs the same pure function over its own view of the DHT and
gets the same answer, so no election protocol is needed:

    key(model, epoch)  = sha256(TRACKER_DOMAIN || model || 0x00 || epoch:u64be)
    distance(peer)     = int(key) XOR int(sha256(peer_id))     (big-endian)
    candidates         = live ads of the model whose peer others can DIAL
                         DIRECTLY (``ShardAd.dialable and not relayed``: the
                         signed record lists direct addresses; a node behind
                         NAT lists only relayed ones). Joiners and the nodes
                         the tracker directs dial it, and a relayed tracker
                         would stall every ``--layers auto`` join until duty
                         rotated (up to an epoch). The rule reads only signed
                         record fields every node sees, so every node still
                         computes the same tracker.
    eligible           = candidates that serve layer 0 (the seeds'
                         "tracker-as-first-layer node": the entry point for
                         prompts is also the one that plans for the model)
    ranking            = eligible peers by (distance, peer_id)
    tracker            = ranking[0]; when it disappears (its ad expires or the
                         daemon excludes it as unreachable) ranking[1] takes over
                         at the next refresh, with nothing to hand over:
                         assignment is recomputed from the DHT.

If no candidate serves layer 0 (the swarm lost its head, or its heads are
all behind NAT), every candidate is eligible, so somebody can still direct a
joiner to fill layer 0. With no candidate at all (no live node, or every node
relayed) there is no tracker: a joining node then plans its own range with
the same pure assignment function (assignment.py) instead of waiting.

The epoch is the daemon's choice of input. ``epoch_at(now_ms)`` gives the
default, wall-clock epochs of ``TRACKER_EPOCH_MS``: duty moves between
eligible nodes now and then (spreading the load) but stays put for long
enough that clock skew between nodes only matters near a boundary, which
the directive rules tolerate (directives.py accepts the epochs of
``now - skew`` .. ``now + skew``).

State: none. Inputs are ads plus ``now_ms``; nothing reads a clock.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

from meshd.plan.adverts import ShardAd, live_adverts
from meshd.plan.errors import PlanInputError

# Domain separation: a tracker key is never equal to any other hash we use.
TRACKER_DOMAIN = b"meshd-tracker-v1\x00"
# Default epoch length. Long against a DHT refresh period (tens of seconds)
# so duty rarely moves while its holder is alive, short enough that duty is
# shared among the layer-0 nodes over a day.
TRACKER_EPOCH_MS = 60 * 60 * 1000
# Epochs are carried as uint64 in RebalanceDirective.epoch.
MAX_EPOCH = 2**64 - 1


def epoch_at(now_ms: int, epoch_ms: int = TRACKER_EPOCH_MS) -> int:
    """The tracker epoch containing wall-clock ``now_ms``."""
    if epoch_ms <= 0:
        raise PlanInputError(f"epoch_ms must be positive, got {epoch_ms}")
    if now_ms < 0:
        raise PlanInputError(f"now_ms must be >= 0, got {now_ms}")
    return now_ms // epoch_ms


def tracker_key(model_digest: str, epoch: int) -> int:
    """The point in hash space that peers' ids are measured against."""
    if not 0 <= epoch <= MAX_EPOCH:
        raise PlanInputError(f"epoch {epoch} outside uint64")
    digest = hashlib.sha256(TRACKER_DOMAIN + model_digest.encode() + b"\x00"
                            + epoch.to_bytes(8, "big")).digest()
    return int.from_bytes(digest, "big")


def peer_distance(key: int, peer_id: str) -> int:
    """XOR distance between a tracker key and a peer id's hash."""
    return key ^ int.from_bytes(hashlib.sha256(peer_id.encode()).digest(), "big")


def eligible_peers(ads: Iterable[ShardAd], *, model_digest: str, now_ms: int,
                   exclude: Iterable[str] = ()) -> frozenset[str]:
    """Live peers that may hold tracker duty for a model (see module docstring)."""
    gone = frozenset(exclude)
    live = [ad for ad in live_adverts(ads, model_digest=model_digest, now_ms=now_ms)
            if ad.peer_id not in gone and ad.dialable and not ad.relayed]
    heads = frozenset(ad.peer_id for ad in live if ad.start == 0)
    return heads or frozenset(ad.peer_id for ad in live)


def rank_trackers(ads: Iterable[ShardAd], *, model_digest: str, epoch: int, now_ms: int,
                  exclude: Iterable[str] = ()) -> tuple[str, ...]:
    """Every eligible live peer, best tracker first; the same for any input order.

    ``exclude`` lets the daemon drop peers it knows are dead before their
    records expire (so the next one takes over within a refresh period).
    """
    key = tracker_key(model_digest, epoch)
    peers = eligible_peers(ads, model_digest=model_digest, now_ms=now_ms, exclude=exclude)
    return tuple(sorted(peers, key=lambda p: (peer_distance(key, p), p)))


def current_tracker(ads: Iterable[ShardAd], *, model_digest: str, epoch: int, now_ms: int,
                    exclude: Iterable[str] = ()) -> str | None:
    """The peer on tracker duty, or None when no live peer serves the model."""
    ranking = rank_trackers(ads, model_digest=model_digest, epoch=epoch, now_ms=now_ms,
                            exclude=exclude)
    return ranking[0] if ranking else None
