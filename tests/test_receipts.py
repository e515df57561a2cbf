"""Step receipts (proto/receipts.py): signing, certificates, digests, bounded and fuzzed parsing.

Invariant (h11's fuzz rule): whatever bytes a peer sends as a receipt or a key
certificate, the parser returns a valid value or raises a ProtocolError.
"""
from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolError, ProtocolViolation
from proto.receipts import (
    MAX_RECEIPT_BYTES,
    Receipt,
    ReceiptSigner,
    certify,
    parse_delegation,
    parse_signed_receipt,
    rows_digest,
    sign_receipt,
    tail_digest,
    verify_delegation,
    verify_receipt,
)
from proto.records import public_key_bytes

NOW_MS = 1_800_000_000_000
NODE = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
D_IN, D_OUT = rows_digest(np.zeros((2, 4), np.float32)), rows_digest(np.ones((2, 4), np.float32))


def receipt(**kw) -> Receipt:
    fields = dict(session_id="s" * 32, epoch=1, start=3, end=6, first_position=40, count=2,
                  input_sha256=D_IN, output_sha256=D_OUT, peer_id="peer-b", history_sha256=D_IN)
    fields.update(kw)
    return Receipt(**fields)  # type: ignore[arg-type]


def test_a_signed_receipt_verifies_under_its_certified_key():
    signer = ReceiptSigner.fresh("peer-b", NODE, NOW_MS)
    verify_delegation(signer.delegation, NOW_MS, public_key_bytes(NODE))
    data = signer.sign("s" * 32, 1, 3, 6, 40, 2, D_IN, D_OUT, D_IN)
    assert len(data) < 260   # the per-step cost on the wire
    got = verify_receipt(parse_signed_receipt(data), signer.delegation)
    assert got == receipt()
    assert got.positions == range(40, 42)
    # the certificate travels as a message and as bytes
    again = parse_delegation(signer.delegation.to_pb().SerializeToString())
    assert again == signer.delegation == parse_delegation(signer.delegation.to_pb())


def test_a_receipt_under_another_key_or_altered_is_refused():
    signer = ReceiptSigner.fresh("peer-b", NODE, NOW_MS)
    other = ReceiptSigner.fresh("peer-b", NODE, NOW_MS)
    data = signer.sign("s" * 32, 1, 3, 6, 40, 2, D_IN, D_OUT, D_IN)
    with pytest.raises(PayloadCorrupt, match="signature"):
        verify_receipt(parse_signed_receipt(data), other.delegation)
    outer = pb.SignedReceipt.FromString(data)
    forged = pb.StepReceipt.FromString(outer.body)
    forged.output_sha256 = D_IN
    outer.body = forged.SerializeToString()
    with pytest.raises(PayloadCorrupt, match="signature"):
        verify_receipt(parse_signed_receipt(outer.SerializeToString()), signer.delegation)


def test_a_certificate_is_bound_to_its_node_and_expires():
    signer = ReceiptSigner.fresh("peer-b", NODE, NOW_MS, ttl_ms=1000)
    verify_delegation(signer.delegation, NOW_MS + 1000)
    with pytest.raises(ProtocolViolation, match="expired"):
        verify_delegation(signer.delegation, NOW_MS + 1001)
    stranger = Ed25519PrivateKey.generate()
    with pytest.raises(PayloadCorrupt, match="another node"):
        verify_delegation(signer.delegation, NOW_MS, public_key_bytes(stranger))
    # a certificate whose delegate key was swapped no longer verifies
    d = signer.delegation.to_pb()
    d.delegate_public_key = public_key_bytes(stranger)
    with pytest.raises(PayloadCorrupt, match="does not verify"):
        verify_delegation(parse_delegation(d), NOW_MS)
    # a key can only sign for the certificate that names it
    with pytest.raises(LocalError):
        ReceiptSigner("peer-b", stranger, signer.delegation)
    with pytest.raises(LocalError):
        certify(NODE, b"short", NOW_MS)


@pytest.mark.parametrize("bad", [dict(session_id=""), dict(peer_id="x" * 129), dict(start=6, end=6),
                                 dict(count=0), dict(first_position=-1), dict(input_sha256=b"x"),
                                 dict(epoch=-1), dict(end=1 << 17)])
def test_a_receipt_outside_its_bounds_is_refused(bad):
    with pytest.raises(ProtocolViolation):
        receipt(**bad)


def test_oversized_and_garbage_receipts_are_typed_errors():
    with pytest.raises(LimitExceeded):
        parse_signed_receipt(b"\x0a" + b"\x00" * MAX_RECEIPT_BYTES)
    with pytest.raises(PayloadCorrupt):
        parse_signed_receipt(b"\xff\xff\xff")
    with pytest.raises(PayloadCorrupt, match="signature must be"):
        parse_signed_receipt(pb.SignedReceipt(body=receipt().to_pb().SerializeToString(),
                                              signature=b"x").SerializeToString())


def test_rows_digest_covers_dtype_shape_and_values_not_byte_order():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert rows_digest(a) == rows_digest(a.copy()) == rows_digest(a.astype(">f4"))
    assert rows_digest(a) != rows_digest(a.reshape(4, 3))
    assert rows_digest(a) != rows_digest(a.astype(np.float64))
    b = a.copy()
    b[2, 3] = np.nextafter(b[2, 3], np.float32(100))
    assert rows_digest(a) != rows_digest(b)
    assert rows_digest(a[:, ::2]) == rows_digest(np.ascontiguousarray(a[:, ::2]))
    assert tail_digest(7, a) != tail_digest(8, a) != tail_digest(None, a)
    assert tail_digest(7, None) != tail_digest(7, a)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2 * MAX_RECEIPT_BYTES))
def test_fuzz_signed_receipt_bytes(data):
    try:
        parse_signed_receipt(data)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_delegation_bytes(data):
    try:
        d = parse_delegation(data)
        verify_delegation(d, NOW_MS)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**33), st.integers(0, 2**33), st.text(max_size=140), st.binary(max_size=40))
def test_fuzz_receipt_fields(epoch, start, end, first, count, peer, digest):
    """Any field values in a well-formed message: a valid Receipt or a ProtocolError."""
    m = pb.StepReceipt(route_session_id="s", route_epoch=epoch, start_layer=start, end_layer=end,
                       first_position=first, count=min(count, 2**32 - 1), input_sha256=digest,
                       output_sha256=D_OUT, peer_id=peer, history_sha256=D_IN)
    data = pb.SignedReceipt(body=m.SerializeToString(), signature=b"\x00" * 64).SerializeToString()
    try:
        got = parse_signed_receipt(data).receipt
    except ProtocolError:
        return
    assert got.end <= 1 << 16 and len(got.input_sha256) == 32 and got.count > 0


def test_signing_a_receipt_needs_an_ed25519_key():
    with pytest.raises(LocalError):
        sign_receipt(receipt(), object())  # type: ignore[arg-type]


# -- the worker's key: from the daemon to its worker (meshd/daemon/worker_process.py, meshd/cli/worker.py) --
def _spec(tmp_path, node_key=NODE):
    from meshd.daemon.worker_process import WorkerSpec
    from meshd.reach.tls import TlsMaterial

    tls = TlsMaterial(tmp_path / "c.pem", tmp_path / "k.pem", b"", bytes(32))
    return WorkerSpec(model=tmp_path, layers=(0, 2), run_dir=tmp_path, tls=tls, node_key=node_key)


def test_the_worker_key_travels_in_a_0600_file_read_once(tmp_path):
    import os
    import stat

    from dht.identity import peer_id_from_public_key
    from meshd.cli.worker import read_receipt_key

    spec = _spec(tmp_path)
    path = spec.write_receipt_key(NOW_MS)
    assert path is not None and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    cmd, env = spec.command(tmp_path / "ready", path), spec.env()
    secret = path.read_bytes()
    assert cmd[cmd.index("--receipt-key") + 1] == str(path)
    seed_hex = secret[len(b"meshd-receipt-key-v1\n"):][:32].hex()
    assert not any(seed_hex in part for part in cmd) and not any(seed_hex in v for v in env.values())
    signer = read_receipt_key(path)
    assert not path.exists()                                 # read once, then gone
    node_pub = public_key_bytes(NODE)
    verify_delegation(signer.delegation, NOW_MS, node_pub)
    assert signer.peer_id == peer_id_from_public_key(node_pub)
    data = signer.sign("s" * 32, 0, 0, 2, 0, 1, D_IN, D_OUT, D_IN)
    assert verify_receipt(parse_signed_receipt(data), signer.delegation).peer_id == signer.peer_id
    # each run gets a fresh key
    again = read_receipt_key(spec.write_receipt_key(NOW_MS))
    assert again.delegation.delegate_public_key != signer.delegation.delegate_public_key
    assert _spec(tmp_path, node_key=None).write_receipt_key(NOW_MS) is None
    assert "--receipt-key" not in _spec(tmp_path, node_key=None).command(tmp_path / "ready")


def test_a_key_file_others_can_read_or_a_foreign_one_is_refused(tmp_path):
    import os

    from meshd.cli.worker import read_receipt_key

    path = _spec(tmp_path).write_receipt_key(NOW_MS)
    assert path is not None
    os.chmod(path, 0o644)
    with pytest.raises(OSError, match="0600"):
        read_receipt_key(path)
    assert not path.exists()                                 # refused and removed all the same
    bad = tmp_path / "bad.key"
    fd = os.open(bad, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"meshd-receipt-key-v1\n" + b"\x00" * 40)
    os.close(fd)
    with pytest.raises(ProtocolError):
        read_receipt_key(bad)
