"""Step receipts on the wire: workers sign every answer, the entry checks and chains them.

Shards in memory (tests/_swarm_helpers.py) whose services carry a ReceiptSigner
certified by a per-peer node key; the entry binds peer ids to those keys.
"""
from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshd.generate.driver import collect
from meshd.generate.receipt_check import ReceiptCheck, peer_id_binds
from proto import fastpath
from proto import shard_runtime_pb2 as pb
from proto.receipts import MAX_RECEIPT_BYTES, ReceiptSigner, rows_digest
from proto.records import public_key_bytes
from tests._swarm_helpers import MemorySwarm, whole_tokens
from tests._swarm_helpers import request as make_request

NEW_TOKENS = 8
NOW_MS = 1_800_000_000_000
NODE_KEYS = {p: Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32)
             for i, p in enumerate(("peer-a", "peer-b", "peer-c"))}


def binds(peer_id: str, key: bytes) -> bool:
    node = NODE_KEYS.get(peer_id)
    return node is not None and public_key_bytes(node) == key


CHECK = ReceiptCheck(binds=binds, now_ms=lambda: NOW_MS, required=True)


class WrongOutputSigner(ReceiptSigner):
    """Signs a receipt whose output digest is not the rows it sends (a hop lying in its receipt)."""

    def sign(self, session_id, epoch, start, end, first_position, count, input_sha256, output_sha256, history):
        return super().sign(session_id, epoch, start, end, first_position, count, input_sha256, b"\x00" * 32,
                            history)


@pytest.fixture
def swarm():
    swarm = MemorySwarm()
    for peer, (start, end, cost) in {"peer-a": (0, 3, 1.0), "peer-b": (3, 6, 1.0), "peer-c": (2, 6, 5.0)}.items():
        shard = swarm.start(peer, start, end, cost=cost)
        shard.service.receipts = ReceiptSigner.fresh(peer, NODE_KEYS[peer], NOW_MS)
    return swarm


def test_every_answer_carries_a_receipt_and_the_digests_chain(swarm):
    driver = swarm.driver(receipts=CHECK)
    tokens, chained = [], 0
    for token in driver.generate(make_request(NEW_TOKENS)):
        tokens.append(token.id)
        head, tail = driver._links
        # hop 0's output digest is hop 1's input digest, chunk by chunk and step by step
        assert head.receipts and len(head.receipts) == len(tail.receipts)
        for out, into in zip(head.receipts, tail.receipts):
            assert out.receipt.output_sha256 == into.receipt.input_sha256
            assert out.receipt.positions == into.receipt.positions
            chained += 1
    assert tokens == whole_tokens(NEW_TOKENS)
    assert chained == 3 + NEW_TOKENS - 1       # the prompt's 3 chunks, then every decode step
    assert not driver.stats.failovers


def test_a_head_whose_receipt_misstates_its_output_fails_over():
    swarm = MemorySwarm()
    for peer, (start, end, cost) in {"peer-a": (0, 3, 1.0), "peer-c": (0, 3, 5.0), "peer-b": (3, 6, 1.0)}.items():
        shard = swarm.start(peer, start, end, cost=cost)
        shard.service.receipts = ReceiptSigner.fresh(peer, NODE_KEYS[peer], NOW_MS)
    honest = swarm["peer-a"].service.receipts
    assert honest is not None
    swarm["peer-a"].service.receipts = WrongOutputSigner("peer-a", honest._key, honest.delegation)
    driver = swarm.driver(receipts=CHECK)
    assert collect(driver, make_request(NEW_TOKENS)) == whole_tokens(NEW_TOKENS)
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-a" and "output digest" in event.detail
    assert driver.stats.routes[-1].peers == ("peer-c", "peer-b")


def test_a_key_certified_by_another_node_or_missing_is_refused(swarm):
    b = swarm["peer-b"].service
    b.receipts = ReceiptSigner.fresh("peer-b", Ed25519PrivateKey.generate(), NOW_MS)   # not peer-b's node key
    driver = swarm.driver(receipts=CHECK)
    assert collect(driver, make_request(NEW_TOKENS)) == whole_tokens(NEW_TOKENS)
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and "receipt key" in event.detail
    swarm["peer-c"].service.receipts = None        # now no replica signs: with receipts required...
    b.receipts = None
    driver = swarm.driver(receipts=CHECK, replan_wait_s=0.0)
    with pytest.raises(Exception, match="signs no step receipts"):
        collect(driver, make_request(NEW_TOKENS))
    # ...while an entry that does not require them accepts unsigned hops
    lenient = swarm.driver(receipts=ReceiptCheck(binds=binds, now_ms=lambda: NOW_MS))
    assert collect(lenient, make_request(NEW_TOKENS)) == whole_tokens(NEW_TOKENS)


def test_the_fast_writer_and_reader_carry_the_receipt_canonically():
    receipt = b"\x0a\x03abc" * 20
    rows = np.arange(8, dtype=np.float32).reshape(1, 8)
    body = fastpath.decode_response_bytes(3, 41, False, 1234, tensors={"h": rows}, legs=2, receipt=receipt)
    assert body is not None
    view, tensors = fastpath.read_decode_response(body)
    assert view.receipt == receipt and np.array_equal(tensors["h"], rows)
    parsed = pb.SessionResponse.FromString(body)
    assert parsed.decode.receipt == receipt and parsed.decode.legs == 2
    assert body == parsed.SerializeToString()       # canonical: protobuf writes the same bytes
    token = fastpath.decode_response_bytes(3, 41, False, 0, token_id=7, receipt=receipt)
    assert fastpath.read_decode_response(token)[0].receipt == receipt
    plain = fastpath.decode_response_bytes(3, 41, False, 0, token_id=7)
    assert fastpath.read_decode_response(plain)[0].receipt == b""
    big = fastpath.decode_response_bytes(3, 41, False, 0, token_id=7, receipt=b"x" * (MAX_RECEIPT_BYTES + 1))
    assert fastpath.read_decode_response(big) is None          # protobuf reads it; the receipt parser refuses it
    assert fastpath._MAX_RECEIPT == MAX_RECEIPT_BYTES


def test_libp2p_peer_ids_bind_their_own_key_only():
    from dht.identity import peer_id_from_public_key

    key = public_key_bytes(NODE_KEYS["peer-a"])
    assert peer_id_binds(peer_id_from_public_key(key), key)
    assert not peer_id_binds(peer_id_from_public_key(key), public_key_bytes(NODE_KEYS["peer-b"]))
    assert not peer_id_binds("peer-a", b"short")
    assert rows_digest(np.zeros(1)) != rows_digest(np.zeros(2))


def test_a_real_worker_signs_with_the_key_its_daemon_handed_it(tmp_path, model):
    """``meshd worker --receipt-key FILE`` in its own process, over loopback gRPC: every answer
    carries a receipt under the key the daemon's WorkerSpec certified; the file is gone once read."""
    from meshd.daemon.worker_process import WorkerSpec
    from meshd.generate.driver import GenerationRequest, SwarmDriver
    from meshd.generate.routes import PeerConnector, discover_fingerprint, fixed_route
    from meshd.reach.tls import TlsMaterial
    from meshd.testing.procs import spawn_worker

    node = NODE_KEYS["peer-a"]
    spec = WorkerSpec(model=model, layers=(0, 6), run_dir=tmp_path, node_key=node,
                      tls=TlsMaterial(tmp_path / "c.pem", tmp_path / "k.pem", b"", bytes(32)))
    key_file = spec.write_receipt_key(time_ms())
    assert key_file is not None
    worker = spawn_worker(model, "0:6", threads=1, extra=["--receipt-key", str(key_file)])
    try:
        assert not key_file.exists()
        source = fixed_route([(worker.endpoint, 0, 6)], 6)
        connector = PeerConnector(insecure_loopback=True)
        check = ReceiptCheck(binds=lambda peer, key: key == public_key_bytes(node), required=True)
        driver = SwarmDriver(source, connector, fingerprint=discover_fingerprint(connector, source.route),
                             receipts=check)
        tokens = []
        for token in driver.generate(GenerationRequest(tuple(range(5, 45)), 4, chunk_tokens=16)):
            tokens.append(token.id)
            (link,) = driver._links
            assert link.receipts and link.delegation is not None
        assert tokens == whole_tokens(4)
    finally:
        worker.stop()


def time_ms() -> int:
    import time

    return time.time_ns() // 1_000_000


def test_each_receipt_pins_the_whole_input_history(swarm):
    """A hop's receipt chains every input digest of its session: the entry recomputes the chain."""
    from proto.receipts import HISTORY_START, chain_history

    driver = swarm.driver(receipts=CHECK)
    chains: list[bytes] = []
    history = HISTORY_START
    for _ in driver.generate(make_request(NEW_TOKENS)):
        tail = driver._links[1]
        for signed in tail.receipts:
            history = chain_history(history, signed.receipt.input_sha256)
            assert signed.receipt.history_sha256 == history
            chains.append(history)
    assert len(set(chains)) == len(chains) == 3 + NEW_TOKENS - 1


class ForgetfulSigner(ReceiptSigner):
    """Signs each step as if its session had no history (a hop hiding what its KV holds)."""

    def sign(self, session_id, epoch, start, end, first_position, count, input_sha256, output_sha256, history):
        from proto.receipts import HISTORY_START, chain_history

        return super().sign(session_id, epoch, start, end, first_position, count, input_sha256, output_sha256,
                            chain_history(HISTORY_START, input_sha256))


def test_a_receipt_that_misstates_the_input_history_fails_over(swarm):
    b = swarm["peer-b"].service
    assert b.receipts is not None
    b.receipts = ForgetfulSigner("peer-b", b.receipts._key, b.receipts.delegation)
    driver = swarm.driver(receipts=CHECK)
    assert collect(driver, make_request(NEW_TOKENS)) == whole_tokens(NEW_TOKENS)
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and "history" in event.detail
