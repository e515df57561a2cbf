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

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives import serialization

from meshd.errors import IdentityError

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
    def from_seed(cls, seed: bytes) -> "Identity":
        return cls(seed=seed, peer_id=peer_id_from_public_key(_public_bytes(seed)))

    @property
    def signing_key(self) -> Ed25519PrivateKey:
        """The key that signs DHT records (same key as the libp2p identity)."""
        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @property
    def public_key(self) -> bytes:
        return _public_bytes(self.seed)

    def libp2p_key_pair(self):  # -> libp2p.crypto.keys.KeyPair
        from libp2p.crypto.ed25519 import create_new_key_pair

        return create_new_key_pair(self.seed)


def _public_bytes(seed: bytes) -> bytes:
    key = Ed25519PrivateKey.from_private_bytes(seed)
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (identity multihash, base58) of a raw Ed25519 public key."""
    from libp2p.crypto.ed25519 import Ed25519PublicKey
    from libp2p.peer.id import ID

    if len(public_key) != 32:
        raise IdentityError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    return ID.from_pubkey(Ed25519PublicKey.from_bytes(public_key)).to_base58()


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
