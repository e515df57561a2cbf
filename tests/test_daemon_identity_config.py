"""Identity persistence, configuration layering, and host listening errors."""
from __future__ import annotations

import os
import socket
import stat

import pytest
import trio

from dht.host.build import running_host
from dht.identity import KEY_FILE_NAME, load_or_create_identity
from meshd.config import DaemonConfig, load_config, parse_layers
from meshd.errors import ConfigError, IdentityError, PortInUse
from tests._daemon_helpers import identity


def test_identity_created_once_with_mode_0600_and_stable(tmp_path):
    first = load_or_create_identity(tmp_path / "d")
    path = tmp_path / "d" / KEY_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_identity(tmp_path / "d")
    assert again.peer_id == first.peer_id and again.peer_id.startswith("12D3KooW")
    assert first.libp2p_key_pair().public_key.to_bytes() == first.public_key
    assert load_or_create_identity(tmp_path / "other").peer_id != first.peer_id


def test_identity_refuses_open_permissions_and_bad_files(tmp_path):
    load_or_create_identity(tmp_path)
    path = tmp_path / KEY_FILE_NAME
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(tmp_path)
    os.chmod(path, 0o600)
    path.write_bytes(b"short")
    with pytest.raises(IdentityError, match="not a meshd identity key"):
        load_or_create_identity(tmp_path)


def test_config_toml_then_flags(tmp_path):
    cfg_file = tmp_path / "meshd.toml"
    cfg_file.write_text(f'''
data_dir = "{tmp_path / 'data'}"
listen = ["/ip4/127.0.0.1/tcp/4555"]
layers = "0:4"
model = "/models/x"
record_ttl_s = 30
[worker]
dtype = "bfloat16"
''')
    cfg = load_config(cfg_file, {"layers": (2, 6), "bootstrap": None, "worker.backend": "torch"})
    assert cfg.layers == (2, 6) and cfg.listen == ("/ip4/127.0.0.1/tcp/4555",)
    assert cfg.worker.dtype == "bfloat16" and cfg.record_ttl_s == 30 and cfg.republish_interval_s == 10
    assert cfg.control_socket == (tmp_path / "data" / "control.sock").resolve()
    with pytest.raises(AttributeError):
        cfg.layers = (0, 1)  # frozen


@pytest.mark.parametrize("text, match", [
    ('bogus = 1', "unknown config keys"),
    ('record_ttl_s = 0.1', "record_ttl_s"),
    ('listen = "/ip4/127.0.0.1/tcp/1"', "list of multiaddr"),
    ('bootstrap = ["/ip4/127.0.0.1/tcp/1"]', "peer id"),
    ('[worker]\ndtype = "fp8"', "worker.dtype"),
    ('listen = [', "not valid TOML"),
    ('[worker]\nthreads = 0', "threads must be an integer"),
    ('[worker]\nthreads = 1000', "threads must be an integer"),
    ('[worker]\nthreads = "4"', "threads must be an integer"),
    ('[worker]\nthreads = 2\ntorch_threads = 2', "not both"),
])
def test_config_errors(tmp_path, text, match):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_worker_threads_default_to_the_cores_and_follow_file_and_flag(tmp_path):
    import os

    assert load_config(None).worker.torch_threads == len(os.sched_getaffinity(0))
    path = tmp_path / "c.toml"
    path.write_text("[worker]\nthreads = 3\n")
    assert load_config(path).worker.torch_threads == 3
    path.write_text("[worker]\ntorch_threads = 5\n")
    assert load_config(path).worker.torch_threads == 5
    assert load_config(path, {"worker.torch_threads": 1}).worker.torch_threads == 1   # --threads wins


def test_join_threads_flag_reaches_the_worker_command(tmp_path):
    import argparse

    from meshd.cli import join
    from meshd.daemon.worker_process import WorkerSpec
    from meshd.reach.tls import TlsMaterial

    parser = argparse.ArgumentParser()
    join.add_arguments(parser)
    assert parser.parse_args(["--threads", "2"]).threads == 2 and parser.parse_args([]).threads is None
    tls = TlsMaterial(tmp_path / "c.pem", tmp_path / "k.pem", b"", bytes(32))
    spec = WorkerSpec(model=tmp_path, layers=(0, 2), run_dir=tmp_path, tls=tls, torch_threads=2)
    cmd = spec.command(tmp_path / "ready")
    assert cmd[cmd.index("--threads") + 1] == "2" and spec.env()["OMP_NUM_THREADS"] == "2"


def test_parse_layers():
    assert parse_layers("0:12") == (0, 12)
    for bad in ("3:3", "a:b", "5", "-1:3"):
        with pytest.raises(ConfigError):
            parse_layers(bad)
    with pytest.raises(ConfigError, match="go together"):
        DaemonConfig(layers=(0, 2))


def test_port_in_use_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def main():
            async with running_host(identity(41), [f"/ip4/127.0.0.1/tcp/{port}"]):
                pass

        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is already in use"):
            trio.run(main)


def test_peer_id_matches_libp2p():
    from libp2p.crypto.ed25519 import Ed25519PublicKey
    from libp2p.peer.id import ID

    from dht.identity import peer_id_from_public_key

    for seed in range(1, 40):
        ident = identity(seed)
        expected = ID.from_pubkey(Ed25519PublicKey.from_bytes(ident.public_key)).to_base58()
        assert peer_id_from_public_key(ident.public_key) == expected == ident.peer_id
        assert ID.from_base58(ident.peer_id).to_bytes()[:2] == b"\x00\x24"


def test_client_only_config_from_toml_and_flags(tmp_path):
    """``layers = "none"`` (or ``client_only = true``, or ``--layers none``): a client-only node."""
    path = tmp_path / "c.toml"
    path.write_text('model = "/models/x"\nlayers = "none"\n')
    cfg = load_config(path)
    assert cfg.client_only and cfg.layers is None and not cfg.auto_layers and cfg.role == "client"
    path.write_text('model = "/models/x"\nclient_only = true\n')
    assert load_config(path).role == "client"
    assert load_config(None, {"model": "/m", "client_only": True}).role == "client"
    assert load_config(None, {"model": "/m", "layers": (0, 2)}).role == "shard"
    assert load_config(None, {"model": "/m", "layers": "auto", "memory_bytes": 1 << 30}).role == "auto"
    assert load_config(None, {}).role == "dht"


@pytest.mark.parametrize("text, match", [
    ('layers = "none"', "needs --model"),
    ('model = "/m"\nlayers = "none"\nclient_only = false', "contradicts"),
    ('model = "/m"\nclient_only = true\nlayers = "0:2"', "instead of --layers A:B or auto"),
    ('model = "/m"\nclient_only = true\nlayers = "auto"\nmemory_bytes = "1GiB"', "instead of --layers A:B or auto"),
    ('model = "/m"\nlayers = "none"\nmemory_bytes = "1GiB"', "--memory does not apply"),
    ('model = "/m"\nlayers = "none"\nexperts = "0-1:E0-E1"', "--experts / offload_experts do not apply"),
    ('model = "/m"\nclient_only = "yes"', "client_only must be true or false"),
])
def test_client_only_config_errors(tmp_path, text, match):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)
