"""The manifest core (shard/model/manifest.py), sans-I/O: the Merkle root, its encoding, chunk checks.

Properties: a manifest survives encode/decode and keeps its root; any change to its bytes either
fails to decode with a typed error or names another root; any change to a chunk's bytes fails its
check; a stream hashed in any pieces gives the same leaves; arbitrary bytes never decode into
anything but a manifest or a typed error."""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.errors import LimitExceeded, LocalError, PayloadCorrupt
from shard.model import manifest as M
from shard.model.manifest import BLOB, TENSOR, Entry, EntryHasher, FileInfo, Manifest, chunk_leaf, merkle

CHUNK = 1024


def _rfc6962(hashes: list[bytes]) -> bytes:
    """RFC 6962's recursive definition, as written there (the reference for ``merkle``)."""
    if not hashes:
        return hashlib.sha256(b"").digest()
    if len(hashes) == 1:
        return hashes[0]
    k = 1
    while k * 2 < len(hashes):
        k *= 2
    return hashlib.sha256(b"\x01" + _rfc6962(hashes[:k]) + _rfc6962(hashes[k:])).digest()


@st.composite
def manifests(draw) -> tuple[Manifest, list[bytes]]:
    n = draw(st.integers(1, 5))
    datas = [draw(st.binary(max_size=3 * CHUNK + 7)) for _ in range(n)]
    entries = []
    for i, data in enumerate(datas):
        kind = draw(st.sampled_from([BLOB, TENSOR]))
        entries.append(M.entry_of(kind, f"t{i}.weight", data, dtype="F16" if kind == TENSOR else "",
                                  shape=(len(data),) if kind == TENSOR else (), chunk_bytes=CHUNK))
    files = (FileInfo("model.gguf", sum(len(d) for d in datas), hashlib.sha256(b"".join(datas)).digest()),)
    return Manifest(M.KIND_GGUF, CHUNK, files, tuple(entries)), datas


@given(st.lists(st.binary(min_size=32, max_size=32), max_size=40))
def test_merkle_is_rfc6962s_tree(leaves):
    assert merkle(leaves) == _rfc6962(leaves)


@given(manifests())
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip_keeps_the_root(case):
    manifest, _ = case
    data = manifest.encode()
    back = Manifest.decode(data, root=manifest.root)
    assert back == manifest and back.root == manifest.root and M.is_root(back.root)


@given(manifests(), st.data())
@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
def test_any_corrupted_manifest_byte_is_refused_or_names_another_root(case, data):
    manifest, _ = case
    raw = bytearray(manifest.encode())
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises((PayloadCorrupt, LimitExceeded)):
        Manifest.decode(bytes(raw), root=manifest.root)


@given(manifests(), st.data())
@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
def test_any_corrupted_chunk_fails_its_check(case, data):
    manifest, datas = case
    candidates = [(i, c) for i, e in enumerate(manifest.entries) for c in range(len(e.chunks))]
    if not candidates:
        return
    i, c = data.draw(st.sampled_from(candidates))
    off, length = manifest.chunk_span(i, c)
    chunk = bytearray(datas[i][off:off + length])
    assert manifest.chunk_ok(i, c, chunk)
    how = data.draw(st.sampled_from(["flip", "short", "long"]))
    if how == "flip":
        chunk[data.draw(st.integers(0, length - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "short":
        chunk = chunk[:-1]
    else:
        chunk += b"\0"
    assert not manifest.chunk_ok(i, c, chunk)


@given(st.binary(max_size=5 * CHUNK), st.lists(st.integers(0, 5 * CHUNK), max_size=8))
def test_hashing_in_any_pieces_gives_the_same_leaves(data, cuts):
    hasher = EntryHasher(CHUNK)
    points = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    for a, b in zip(points, points[1:]):
        hasher.update(data[a:b])
    assert hasher.finish() == tuple(chunk_leaf(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK))
    assert hasher.size == len(data)


@given(st.binary(max_size=400))
@settings(max_examples=300)
def test_arbitrary_bytes_decode_or_fail_typed(raw):
    for data in (raw, M.MAGIC + raw, M.MAGIC + b"\x01\x01\x00\x04\x00\x00\x00\x00" + raw):
        try:
            Manifest.decode(data)
        except (PayloadCorrupt, LimitExceeded):
            pass


def test_every_field_is_under_the_root():
    base = M.entry_of(TENSOR, "a", b"x" * 3000, dtype="F16", shape=(1500,), chunk_bytes=CHUNK)
    files = (FileInfo("model.gguf", 3000, b"\1" * 32),)
    root = Manifest(M.KIND_GGUF, CHUNK, files, (base,)).root
    variants = [
        Manifest(M.KIND_SAFETENSORS, CHUNK, files, (base,)),
        Manifest(M.KIND_GGUF, CHUNK, (FileInfo("model.gguf", 3000, b"\2" * 32),), (base,)),
        Manifest(M.KIND_GGUF, CHUNK, (FileInfo("other.gguf", 3000, b"\1" * 32),), (base,)),
        Manifest(M.KIND_GGUF, CHUNK, files, (Entry(TENSOR, "b", 0, "F16", (1500,), 3000, base.chunks),)),
        Manifest(M.KIND_GGUF, CHUNK, files, (Entry(TENSOR, "a", 0, "F32", (1500,), 3000, base.chunks),)),
        Manifest(M.KIND_GGUF, CHUNK, files, (Entry(TENSOR, "a", 0, "F16", (750, 2), 3000, base.chunks),)),
        Manifest(M.KIND_GGUF, CHUNK, files, (Entry(BLOB, "a", 0, "F16", (1500,), 3000, base.chunks),)),
        Manifest(M.KIND_GGUF, CHUNK, files, (base, M.entry_of(BLOB, "m", b"", chunk_bytes=CHUNK))),
        Manifest(M.KIND_GGUF, 2 * CHUNK, files,
                 (M.entry_of(TENSOR, "a", b"x" * 3000, dtype="F16", shape=(1500,), chunk_bytes=2 * CHUNK),)),
    ]
    roots = {v.root for v in variants}
    assert root not in roots and len(roots) == len(variants)


def test_bounds_are_checked_before_use():
    with pytest.raises(LimitExceeded):
        Manifest.decode(b"\0" * (M.MAX_MANIFEST_BYTES + 1))
    claim = M.MAGIC + bytes([1, 1]) + CHUNK.to_bytes(4, "little") + (0).to_bytes(2, "little")
    with pytest.raises(PayloadCorrupt, match="truncated"):
        Manifest.decode(claim + (1 << 19).to_bytes(4, "little"))   # half a million entries, no bytes
    with pytest.raises(LocalError):
        Manifest(M.KIND_GGUF, 1000, (), ())          # not a power of two
    with pytest.raises(LocalError):
        FileInfo("../etc/passwd", 1, b"\0" * 32)
    with pytest.raises(LocalError):
        M.parse_root("sha256:" + "0" * 64)
    assert M.parse_root("merkle:" + "ab" * 32) == b"\xab" * 32
