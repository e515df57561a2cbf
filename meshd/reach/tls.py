"""Per-node TLS material and certificate-pinned gRPC channels.

Each node owns a P-256 key and a self-signed certificate in its data
directory (``tls.key`` mode 0600, ``tls.crt``). Its worker serves the
ShardRuntime over TLS with them; the SHA-256 of the certificate's DER goes
into the node's signed capability record (Reachability.tls_cert_sha256).

A dialing peer knows only that hash. ``pinned_channel(endpoint, sha256)``:

1. fetches the certificate the endpoint presents and compares the SHA-256
   of its DER with the pin (``CertificateMismatch`` when it differs);
2. opens a gRPC channel whose *only* trust root is that very certificate,
   with ``ssl_target_name_override`` set to the fixed name in it -- so the
   channel's own handshake fails if the server presents anything that does
   not chain to the pinned certificate (e.g. it swaps certificates after
   step 1).

Plaintext gRPC exists only between a daemon and its own worker on loopback
(``loopback_channel`` refuses any other host).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshd.errors import CertificateMismatch, ConfigError

# The name every meshd certificate carries; dialers override the target name
# with it, since peers are addressed by IP and identified by the pinned hash.
PEER_TLS_NAME = "meshd-peer"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
# Long enough never to expire under a running node; a new one is minted when it does.
CERT_VALIDITY = dt.timedelta(days=365)
# Bound on fetching the peer's certificate before the real handshake.
CERT_FETCH_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    cert_path: Path
    key_path: Path
    cert_pem: bytes
    sha256: bytes

    def __post_init__(self) -> None:
        if len(self.sha256) != 32:
            raise ValueError("sha256 must be 32 bytes")


def cert_sha256(cert_pem: bytes) -> bytes:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


def generate_self_signed(common_name: str, now: dt.datetime | None = None) -> tuple[bytes, bytes]:
    """(cert PEM, key PEM) of a fresh P-256 key and self-signed certificate."""
    now = now or dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + CERT_VALIDITY)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(PEER_TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def load_or_create_tls(data_dir: Path, common_name: str) -> TlsMaterial:
    """The node's TLS key and certificate, created on first start (key mode 0600)."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert_path, key_path = data_dir / CERT_FILE, data_dir / KEY_FILE
    if cert_path.exists() and key_path.exists():
        pem = cert_path.read_bytes()
        cert = x509.load_pem_x509_certificate(pem)
        if cert.not_valid_after_utc > dt.datetime.now(dt.UTC) + dt.timedelta(days=1):
            return TlsMaterial(cert_path, key_path, pem, cert_sha256(pem))
    cert_pem, key_pem = generate_self_signed(common_name)
    _write_private(key_path, key_pem)
    tmp = cert_path.with_name(f".{CERT_FILE}.{os.getpid()}.tmp")
    tmp.write_bytes(cert_pem)
    os.replace(tmp, cert_path)
    return TlsMaterial(cert_path, key_path, cert_pem, cert_sha256(cert_pem))


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"endpoint must be HOST:PORT, not {endpoint!r}")
    return host.strip("[]"), int(port)


def fetch_presented_certificate(endpoint: str, timeout_s: float = CERT_FETCH_TIMEOUT_S) -> bytes:
    """PEM of the certificate ``endpoint`` presents (no trust decision here)."""
    host, port = split_endpoint(endpoint)
    try:
        return ssl.get_server_certificate((host, port), timeout=timeout_s).encode()
    except (OSError, ssl.SSLError) as exc:
        raise CertificateMismatch(f"could not read the certificate of {endpoint}: {exc}") from exc


def pinned_channel(endpoint: str, sha256: bytes, options: list | None = None) -> grpc.Channel:
    """A gRPC channel to ``endpoint`` that trusts only the certificate hashing to ``sha256``."""
    if len(sha256) != 32:
        raise CertificateMismatch("a pin is a 32-byte SHA-256")
    presented = fetch_presented_certificate(endpoint)
    if cert_sha256(presented) != sha256:
        raise CertificateMismatch(
            f"{endpoint} presented certificate {cert_sha256(presented).hex()[:16]}..., "
            f"its record pins {sha256.hex()[:16]}...; refusing to talk to it")
    return channel_trusting(endpoint, presented, options)


def channel_trusting(endpoint: str, cert_pem: bytes, options: list | None = None) -> grpc.Channel:
    """A TLS channel whose only root of trust is ``cert_pem`` (step 2 of pinning)."""
    creds = grpc.ssl_channel_credentials(root_certificates=cert_pem)
    opts = list(options or []) + [("grpc.ssl_target_name_override", PEER_TLS_NAME)]
    return grpc.secure_channel(endpoint, creds, options=opts)


def pinned_channel_factory(pins: Mapping[str, bytes], options: list | None = None) -> Callable[[str], grpc.Channel]:
    """A ``channel_factory(endpoint)`` (tests, e.g. a connector over it): each hop's endpoint is
    dialed through ``pinned_channel`` with the pin from that peer's signed record;
    an endpoint without a pin is refused (never a plaintext or unpinned fallback)."""
    frozen = dict(pins)

    def factory(endpoint: str) -> grpc.Channel:
        pin = frozen.get(endpoint)
        if pin is None:
            raise CertificateMismatch(f"no pinned certificate for {endpoint}; refusing an unpinned channel")
        return pinned_channel(endpoint, pin, options)

    return factory


def server_credentials(material: TlsMaterial) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(material.key_path.read_bytes(), material.cert_pem)])


def loopback_channel(endpoint: str, options: list | None = None) -> grpc.Channel:
    """Plaintext gRPC, allowed only to a loopback address (daemon <-> own worker)."""
    host, _ = split_endpoint(endpoint)
    try:
        is_loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = host == "localhost"
    if not is_loopback:
        raise ConfigError(f"plaintext gRPC only on loopback, not to {endpoint}")
    return grpc.insecure_channel(endpoint, options=options or [])
