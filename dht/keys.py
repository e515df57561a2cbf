"""DHT key names (pure). All keys live in the ``/meshd/`` namespace, so
py-libp2p's NamespacedValidator routes them to ``dht.validator.MeshdValidator``.

    /meshd/peer/<peer id>                    the peer's latest record (one record)
    /meshd/model/<artifact digest>           index: a record set, one record per peer
    /meshd/span/<artifact digest>/<A>-<B>    index: the peers serving exactly [A, B)
    /meshd/relays/v1                         index: relay records (dht/relay_records.py)
    /meshd/experts/<artifact digest>         index: expert placement records (dht/expert_records.py)

Keys stay under 128 bytes: py-libp2p refuses longer GET_VALUE keys.
"""
from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "meshd"
MAX_KEY_BYTES = 128


@dataclass(frozen=True, slots=True)
class ParsedKey:
    kind: str  # "peer" | "model" | "span" | "relays" | "experts"
    subject: str  # peer id or artifact digest
    span: tuple[int, int] | None = None


def peer_key(peer_id: str) -> str:
    return _checked(f"/{NAMESPACE}/peer/{peer_id}")


def model_key(digest: str) -> str:
    return _checked(f"/{NAMESPACE}/model/{digest}")


def span_key(digest: str, start: int, end: int) -> str:
    return _checked(f"/{NAMESPACE}/span/{digest}/{start}-{end}")


RELAYS_VERSION = "v1"


def experts_key(digest: str) -> str:
    """The index key of every expert peer's placement record for one model."""
    return _checked(f"/{NAMESPACE}/experts/{digest}")


def relays_key() -> str:
    """The one index key under which every relay's signed record lives."""
    return _checked(f"/{NAMESPACE}/relays/{RELAYS_VERSION}")


def keys_for(peer_id: str, digest: str, span: tuple[int, int] | None) -> list[str]:
    """Every key one capability record is published under (no span key for a withdrawal)."""
    keys = [peer_key(peer_id), model_key(digest)]
    if span is not None:
        keys.append(span_key(digest, *span))
    return keys


def _checked(key: str) -> str:
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"DHT key over {MAX_KEY_BYTES} bytes: {key[:40]}...")
    return key


def parse_key(key: str) -> ParsedKey:
    """Parse a /meshd/ key; ValueError for anything else."""
    parts = key.split("/")
    if len(key.encode()) > MAX_KEY_BYTES or len(parts) < 4 or parts[0] or parts[1] != NAMESPACE:
        raise ValueError(f"not a meshd key: {key[:60]!r}")
    kind = parts[2]
    if kind in ("peer", "model", "experts") and len(parts) == 4 and parts[3]:
        return ParsedKey(kind, parts[3])
    if kind == "relays" and len(parts) == 4 and parts[3] == RELAYS_VERSION:
        return ParsedKey(kind, parts[3])
    if kind == "span" and len(parts) == 5 and parts[3]:
        bounds = parts[4].split("-")
        if len(bounds) == 2 and all(b.isdigit() and len(b) <= 6 for b in bounds):
            start, end = int(bounds[0]), int(bounds[1])
            if start < end:
                return ParsedKey(kind, parts[3], (start, end))
    raise ValueError(f"not a meshd key: {key[:60]!r}")
