"""What a capability record says about fetching: the fetch port, the layers held, the file's SHA-256.

Signed like every other field; bounded by the validator (a held range beyond the model, a fetch
port without the certificate pin, an over-long endpoint are refused); read into the planner's ad
(``held``: None without a fetch port, else the held span or, unset, the served one) and into the
swarm snapshot's fetch endpoints."""
from __future__ import annotations

from dataclasses import replace

import pytest

from dht.records import validate_capability
from meshd.errors import RecordRejected
from meshd.plan.adverts import ShardAd, Span
from meshd.swarm.view import snapshot_from_records
from proto import shard_runtime_pb2 as pb
from tests._daemon_helpers import NOW_MS, TTL_MS, claim, identity, raw_payload, signed

ROOT = "merkle:" + "ab" * 32


def _record(**fields) -> bytes:
    from dht.records import sign_capability

    ident = identity(3)
    c = replace(claim(0, 4, 8, digest=ROOT), **fields)
    return sign_capability(c, ident.signing_key, peer_id=ident.peer_id, sequence=5, now_ms=NOW_MS, ttl_ms=TTL_MS)


def test_fetch_fields_are_signed_and_read_back():
    raw = _record(fetch_endpoint="127.0.0.1:7000", held_start=0, held_end=8, artifact_sha256="sha256:" + "cd" * 32)
    rec = validate_capability(raw, NOW_MS)
    p = rec.payload
    assert (p.reachability.fetch_endpoint, p.held_start, p.held_end) == ("127.0.0.1:7000", 0, 8)
    ad = ShardAd.from_payload(p)
    assert ad.fetchable and ad.held == Span(0, 8) and ad.span == Span(0, 4)
    snap = snapshot_from_records(ROOT, [rec], NOW_MS)
    assert snap.fetch == {rec.peer_id: "127.0.0.1:7000"}


def test_an_ad_without_a_fetch_port_holds_nothing_for_others_and_an_unset_span_means_its_range():
    assert ShardAd.from_payload(validate_capability(_record(), NOW_MS).payload).held is None
    ad = ShardAd.from_payload(validate_capability(_record(fetch_endpoint="127.0.0.1:1"), NOW_MS).payload)
    assert ad.held == Span(0, 4)


@pytest.mark.parametrize("fields, what", [
    ({"held_start": 2, "held_end": 9}, "held"),
    ({"held_start": 5, "held_end": 5}, "held"),
    ({"fetch_endpoint": "h:" + "9" * 300}, "fetch_endpoint"),
    ({"artifact_sha256": "not a digest!"}, "artifact_sha256"),
])
def test_out_of_bounds_fetch_fields_are_refused(fields, what):
    ident = identity(4)
    payload = raw_payload(ident, digest=ROOT)
    payload.reachability.grpc_endpoint = "127.0.0.1:5000"
    payload.reachability.tls_cert_sha256 = b"\x01" * 32
    for key, value in fields.items():
        if key == "fetch_endpoint":
            payload.reachability.fetch_endpoint = value
        else:
            setattr(payload, key, value)
    with pytest.raises(RecordRejected, match=what):
        validate_capability(signed(payload, ident.signing_key), NOW_MS)


def test_a_fetch_port_needs_the_pin():
    ident = identity(5)
    payload = raw_payload(ident, digest=ROOT)
    payload.reachability.fetch_endpoint = "127.0.0.1:7000"
    with pytest.raises(RecordRejected, match="certificate"):
        validate_capability(signed(payload, ident.signing_key), NOW_MS)
    with pytest.raises(ValueError):
        replace(claim(digest=ROOT), fetch_endpoint="127.0.0.1:7000", tls_cert_sha256=b"")
    assert pb.JoinAsk(prefer_start=2, prefer_end=4).prefer_end == 4
