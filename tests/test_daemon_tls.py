"""Certificate pinning of direct gRPC hops (meshd/reach/tls.py) with a real TLS gRPC server."""
from __future__ import annotations

import stat
from concurrent import futures

import grpc
import pytest

from meshd.errors import CertificateMismatch, ConfigError
from meshd.reach.tls import (
    channel_trusting,
    generate_self_signed,
    load_or_create_tls,
    loopback_channel,
    pinned_channel,
    pinned_channel_factory,
    server_credentials,
)

CALL_TIMEOUT_S = 5
ECHO = "/meshd.test.Echo/Say"


def _serve(material):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"echo:" + req)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("meshd.test.Echo", {"Say": handler}),))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(material))
    server.start()
    return server, f"127.0.0.1:{port}"


def _say(channel) -> bytes:
    return channel.unary_unary(ECHO)(b"hi", timeout=CALL_TIMEOUT_S)


def test_material_is_persistent_and_private(tmp_path):
    a = load_or_create_tls(tmp_path, "node-a")
    assert stat.S_IMODE(a.key_path.stat().st_mode) == 0o600
    assert load_or_create_tls(tmp_path, "node-a").sha256 == a.sha256


def test_pinned_certificate_accepted_other_refused(tmp_path):
    node = load_or_create_tls(tmp_path / "node", "node")
    other = load_or_create_tls(tmp_path / "other", "other")
    server, endpoint = _serve(node)
    try:
        with pinned_channel(endpoint, node.sha256) as ch:
            assert _say(ch) == b"echo:hi"
        # the worker presents node's certificate, the record pins another one
        with pytest.raises(CertificateMismatch, match="refusing"):
            pinned_channel(endpoint, other.sha256)
        # a channel that trusts only another certificate fails its own handshake,
        # even if the server swapped certificates after the pin check
        with channel_trusting(endpoint, other.cert_pem) as ch:
            with pytest.raises(grpc.RpcError) as info:
                _say(ch)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # same subject name, different key: still refused
        impostor_pem, _ = generate_self_signed("node")
        with channel_trusting(endpoint, impostor_pem) as ch:
            with pytest.raises(grpc.RpcError):
                _say(ch)
    finally:
        server.stop(None)


def test_plaintext_only_on_loopback():
    loopback_channel("127.0.0.1:1").close()
    with pytest.raises(ConfigError, match="only on loopback"):
        loopback_channel("192.0.2.1:50051")


def test_channel_factory_for_route_driver(tmp_path):
    node = load_or_create_tls(tmp_path / "node", "node")
    server, endpoint = _serve(node)
    try:
        factory = pinned_channel_factory({endpoint: node.sha256})
        with factory(endpoint) as ch:
            assert _say(ch) == b"echo:hi"
        with pytest.raises(CertificateMismatch, match="no pinned certificate"):
            factory("127.0.0.1:1")
    finally:
        server.stop(None)
