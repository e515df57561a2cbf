"""`meshd join/status/id` as a user runs them: real subprocesses, one clear line per error."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests._daemon_helpers import REPO_ROOT, identity, subprocess_env

CLI_TIMEOUT_S = 60


def meshd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd", *args], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


@pytest.fixture
def model_dir(tmp_path):
    """Enough of an artifact for the pre-flight checks (they read only config.json)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_error_line(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("meshd: error:")]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr
    assert "WARNING" not in result.stderr


def test_id_is_stable(tmp_path):
    first = meshd("id", "--data-dir", str(tmp_path))
    again = meshd("id", "--data-dir", str(tmp_path))
    assert first.returncode == 0 and first.stdout == again.stdout
    assert first.stdout.strip().startswith("12D3KooW")


def test_missing_model_path(tmp_path):
    r = meshd("join", "--model", str(tmp_path / "nope"), "--layers", "0:2", "--data-dir", str(tmp_path / "d"))
    _one_error_line(r, f"model path {tmp_path / 'nope'} does not exist")


def test_range_beyond_model(tmp_path, model_dir):
    r = meshd("join", "--model", str(model_dir), "--layers", "2:9", "--data-dir", str(tmp_path / "d"))
    _one_error_line(r, "layers 2:9 are beyond the model: it has 4 layers")


def test_bad_layers_syntax(tmp_path, model_dir):
    r = meshd("join", "--model", str(model_dir), "--layers", "3", "--data-dir", str(tmp_path / "d"))
    _one_error_line(r, "layers must look like A:B")


def test_port_in_use(tmp_path, model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = meshd("join", "--model", str(model_dir), "--layers", "0:2", "--data-dir", str(tmp_path / "d"),
                  "--listen", f"/ip4/127.0.0.1/tcp/{port}")
    _one_error_line(r, f"port {port} on 127.0.0.1 is already in use")


def test_unreachable_bootstrap(tmp_path, model_dir):
    dead = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{identity(61).peer_id}"
    r = meshd("join", "--model", str(model_dir), "--layers", "0:2", "--data-dir", str(tmp_path / "d"),
              "--listen", "/ip4/127.0.0.1/tcp/0", "--bootstrap", dead)
    _one_error_line(r, "no bootstrap peer answered")


def test_a_swarm_name_we_cannot_use(tmp_path, model_dir):
    r = meshd("join", "--model", str(model_dir), "--layers", "0:2", "--data-dir", str(tmp_path / "d"),
              "--swarm", "the smiths")
    _one_error_line(r, "swarm name 'the smiths': use 1 to 64 letters, digits")


def test_status_without_daemon(tmp_path):
    _one_error_line(meshd("status", "--data-dir", str(tmp_path)), "no meshd daemon is running")


def test_api_beyond_loopback_needs_a_bearer_key(tmp_path, model_dir):
    base = ("join", "--model", str(model_dir), "--layers", "0:2", "--data-dir", str(tmp_path / "d"))
    _one_error_line(meshd(*base, "--api-listen", "0.0.0.0:0"), "beyond loopback: that needs a bearer key")
    _one_error_line(meshd(*base, "--api-listen", "0.0.0.0:0", "--api-key", "short"), "at least 16 characters")
    _one_error_line(meshd(*base, "--api-listen", "example.com:80"), "must be an IP address or localhost")


def test_api_port_in_use_when_given_explicitly(tmp_path, model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = meshd("join", "--model", str(model_dir), "--layers", "0:2", "--data-dir", str(tmp_path / "d"),
                  "--listen", "/ip4/127.0.0.1/tcp/0", "--api-listen", f"127.0.0.1:{port}")
    _one_error_line(r, f"the API cannot listen on 127.0.0.1:{port}")


def test_join_layers_none_checks(tmp_path, model_dir):
    """``--layers none`` (a client-only node) needs the model and refuses what only a holder uses."""
    d = ("--data-dir", str(tmp_path / "d"))
    _one_error_line(meshd("join", "--layers", "none", *d), "needs --model")
    _one_error_line(meshd("join", "--model", str(model_dir), "--layers", "none", "--memory", "1GiB", *d),
                    "--memory does not apply")
    _one_error_line(meshd("join", "--model", str(tmp_path / "nope"), "--layers", "none", *d), "does not exist")
