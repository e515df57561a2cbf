"""The API key never has to be on a command line: ``--api-key-file`` and ``MESHD_API_KEY``.

The report: ``meshd join --api-key VALUE`` shows the key to every local user
(``ps``, /proc/PID/cmdline). A real client-only daemon (``--layers none``: no
worker, seconds to start) is started with the key in a file: the key is not in
its argv, the API needs it. ``--api-key`` still works but warns; a key file
that others may read, or an empty one, is refused with one clear line.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from meshd.cli.join import API_KEY_ON_COMMAND_LINE
from meshd.config import ConfigError, load_config
from meshd.testing.models import build_random_llama
from meshd.testing.procs import stop_process
from tests._daemon_helpers import REPO_ROOT, subprocess_env

KEY = "a-secret-key-of-32-characters-xx"
START_TIMEOUT_S = 90


def _key_file(tmp_path: Path, text: str = KEY + "\n", mode: int = 0o600) -> Path:
    path = tmp_path / "api-key"
    path.write_text(text)
    path.chmod(mode)
    return path


def _client_only(tmp_path: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    log = open(tmp_path / "daemon.log", "w")
    args = [sys.executable, "-m", "meshd", "join", "--model", str(build_random_llama(seed=5)), "--layers", "none",
            "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(tmp_path / "d"), "--api-listen", "127.0.0.1:0",
            *extra]
    return subprocess.Popen(args, cwd=REPO_ROOT, env={**subprocess_env(), **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT)


def _api_url(tmp_path: Path, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        m = re.search(r"api: serving (http://\S+)", (tmp_path / "daemon.log").read_text())
        if m:
            return m.group(1)
        assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
        time.sleep(0.1)
    raise AssertionError("the daemon did not start its API: " + (tmp_path / "daemon.log").read_text())


def test_a_key_from_a_file_is_required_and_never_on_the_command_line(tmp_path):
    proc = _client_only(tmp_path, "--api-key-file", str(_key_file(tmp_path)))
    try:
        url = _api_url(tmp_path, proc)
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert KEY.encode() not in argv
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert "warning" not in (tmp_path / "daemon.log").read_text()
    finally:
        stop_process(proc)


def test_a_key_from_the_environment_is_required(tmp_path):
    proc = _client_only(tmp_path, env={"MESHD_API_KEY": KEY})
    try:
        url = _api_url(tmp_path, proc)
        assert KEY.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        stop_process(proc)


def test_a_key_on_the_command_line_warns_that_local_users_see_it(tmp_path):
    proc = _client_only(tmp_path, "--api-key", KEY)
    try:
        _api_url(tmp_path, proc)
        assert API_KEY_ON_COMMAND_LINE in (tmp_path / "daemon.log").read_text()
    finally:
        stop_process(proc)


def test_key_files_others_may_read_or_empty_ones_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="chmod 600"):
        load_config(None, {"api.key_file": str(_key_file(tmp_path, mode=0o644))})
    with pytest.raises(ConfigError, match="is empty"):
        load_config(None, {"api.key_file": str(_key_file(tmp_path, "\n\n"))})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, {"api.key_file": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, {"api.key_file": str(_key_file(tmp_path)), "api.key": KEY})
    assert load_config(None, {"api.key_file": str(_key_file(tmp_path, KEY + "\nignored"))}).api.key == KEY
