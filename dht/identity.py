"""Persistent node identity: one Ed25519 key in the data directory.

Data flow: ``load_or_create_identity(data_dir)`` reads ``<data_dir>/identity.key``
(the raw 32-byte Ed25519 seed, file mode 0600) or creates it atomically on
first start. The same seed yields the libp2p key pair (host identity, Noise
static-key signature), the ``cryptography`` private key that signs DHT records
(proto.records.sign_record) and therefore the same peer id on every start.

State: the key file is the only state; it is owned by this module. A key file
that is readable by group/others, or not exactly 32 bytes, is refused rather
than silently used or replaced.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dht.errors import IdentityError

KEY_FILE_NAME = "identity.key"
# An Ed25519 private key is its 32-byte seed (RFC 8032).
ED25519_SEED_BYTES = 32
# Owner read/write only: the key is the node's identity.
KEY_FILE_MODE = 0o600


@dataclass(frozen=True, slots=True)
class Identity:
    """The node's key material; ``peer_id`` is the base58 libp2p peer id."""

    seed: bytes = field(repr=False)
    peer_id: str

    def __post_init__(self) -> None:
        if len(self.seed) != ED25519_SEED_BYTES:
            raise IdentityError(f"an Ed25519 seed has {ED25519_SEED_BYTES} bytes, got {len(self.seed)}")

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        return cls(seed=seed, peer_id=peer_id_from_public_key(_public_bytes(seed)))

    @property
    def signing_key(self) -> Ed25519PrivateKey:
        """The key that signs DHT records (same key as the libp2p identity)."""
        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @property
    def public_key(self) -> bytes:
        return _public_bytes(self.seed)

    @property
    def peer_id_bytes(self) -> bytes:
        """The peer id as libp2p's ``ID.to_bytes()`` (what the DHT's keyspace hashes)."""
        return peer_id_bytes(self.public_key)

    def libp2p_key_pair(self):  # -> libp2p.crypto.keys.KeyPair
        from libp2p.crypto.ed25519 import create_new_key_pair

        return create_new_key_pair(self.seed)


def _public_bytes(seed: bytes) -> bytes:
    key = Ed25519PrivateKey.from_private_bytes(seed)
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# libp2p PublicKey protobuf of an Ed25519 key: field 1 (KeyType) = 1 (Ed25519),
# field 2 (Data) = 32 bytes. Keys of at most 42 bytes are embedded in the peer
# id with the identity multihash (code 0x00, then the length), not hashed.
_ED25519_PUBKEY_PROTO_PREFIX = b"\x08\x01\x12\x20"
_IDENTITY_MULTIHASH_PREFIX = b"\x00\x24"
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, rem = divmod(n, 58)
        out.append(_B58_ALPHABET[rem])
    pad = len(data) - len(data.lstrip(b"\x00"))
    return "1" * pad + "".join(reversed(out))


def peer_id_bytes(public_key: bytes) -> bytes:
    """The libp2p peer id bytes (identity multihash) of a raw Ed25519 public key."""
    if len(public_key) != 32:
        raise IdentityError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    return _IDENTITY_MULTIHASH_PREFIX + _ED25519_PUBKEY_PROTO_PREFIX + public_key


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (identity multihash, base58) of a raw Ed25519 public key.

    Computed here rather than through libp2p.peer.id (same bytes, checked by a
    test) so that record validation and ``meshd id`` do not import libp2p.
    """
    return _b58encode(peer_id_bytes(public_key))


def load_or_create_identity(data_dir: Path) -> Identity:
    """Load ``<data_dir>/identity.key``, creating it (mode 0600) on first start."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = data_dir / KEY_FILE_NAME
    if not path.exists():
        _create_key_file(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise IdentityError(
            f"{path} is accessible by other users (mode {mode:o}); run: chmod 600 {path}")
    seed = path.read_bytes()
    if len(seed) != ED25519_SEED_BYTES:
        raise IdentityError(
            f"{path} is not a meshd identity key ({len(seed)} bytes, expected {ED25519_SEED_BYTES}); "
            "move it away to create a new identity")
    return Identity.from_seed(seed)


def _create_key_file(path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
    try:
        os.write(fd, seed)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        # link() fails when another process created the key first: theirs wins.
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
