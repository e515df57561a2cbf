"""The user's side of model roots: ``meshd id --model FILE``, ``--model ROOT`` / ``NAME@ROOT`` in the
config, the upload limits, and what ``meshd status`` shows of holdings and fetches."""
from __future__ import annotations

import subprocess
import sys

import pytest

from meshd.cli.status_view import render_fetch
from meshd.config import DEFAULT_UPLOAD_BYTES_PER_S, load_config
from meshd.errors import ConfigError
from meshd.testing.gguf_models import build_random_gguf
from meshd.testing.procs import child_env
from native.gguf_range import artifact_digest, model_digest
from native.slice import write_user_slice

ROOT = "merkle:" + "0f" * 32


def test_meshd_id_prints_the_root_of_a_file_and_of_its_slice(tmp_path):
    source = build_random_gguf("llama", seed=21)
    part = write_user_slice(source, 1, 3, tmp_path / "p.gguf", progress=None)
    for path in (source, part):
        proc = subprocess.run([sys.executable, "-m", "meshd", "id", "--model", str(path)], env=child_env(1),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == model_digest(source)
        assert artifact_digest(source) in proc.stderr and "meshd join --model merkle:" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "meshd", "id", "--model", str(tmp_path / "nope.gguf")],
                          env=child_env(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_a_root_or_name_at_root_is_a_model_to_fetch(tmp_path):
    cfg = load_config(None, {"data_dir": tmp_path, "model": ROOT, "auto_layers": True, "memory_bytes": 1 << 30})
    assert (cfg.model, cfg.model_root, cfg.model_name, cfg.has_model) == (None, ROOT, None, True)
    cfg = load_config(None, {"data_dir": tmp_path, "model": f"smol-2.q4@{ROOT}", "layers": (0, 4),
                             "upload_bytes_per_s": "16MiB", "upload_busy_bytes_per_s": 0})
    assert (cfg.model_name, cfg.model_root, cfg.upload_bytes_per_s, cfg.upload_busy_bytes_per_s) == \
        ("smol-2.q4", ROOT, 16 << 20, 0)
    assert load_config(None, {"data_dir": tmp_path}).upload_bytes_per_s == DEFAULT_UPLOAD_BYTES_PER_S
    file = tmp_path / ROOT   # a file of that very name is a file, not a root
    file.write_bytes(b"")
    assert load_config(None, {"data_dir": tmp_path, "model": str(file), "layers": (0, 1)}).model == file


@pytest.mark.parametrize("overrides, message", [
    ({"model": ROOT, "client_only": True}, "does not apply"),
    ({"model": ROOT, "layers": (0, 2), "experts": "0-1:E0-E1"}, "does not apply"),
    ({"model": "merkle:abc", "layers": (0, 2)}, None),          # not a root: a (missing) path, checked later
    ({"model_root": "sha256:" + "0" * 64, "layers": (0, 2)}, "merkle"),
    ({"model": ROOT, "layers": (0, 2), "upload_bytes_per_s": -1}, "bytes per second"),
])
def test_roots_are_checked(tmp_path, overrides, message):
    if message is None:
        assert load_config(None, {"data_dir": tmp_path, **overrides}).model_root is None
        return
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"data_dir": tmp_path, **overrides})


def test_status_shows_holdings_the_fetch_and_blame():
    lines = render_fetch({
        "endpoint": "10.0.0.2:4100", "upload_limit_mb_s": 67.1,
        "server": {"bytes_sent": 12_000_000, "connections": 1},
        "holds": [{"root": ROOT, "what": "layers-0-10.gguf", "layers": [0, 10], "fetching": False},
                  {"root": ROOT, "what": "layers-10-20.gguf.part", "layers": None, "fetching": True}],
        "fetching": {"label": "layers 10:20", "bytes_done": 5_000_000, "bytes_total": 20_000_000, "rate_mb_s": 50.0,
                     "eta_s": 0.3, "peers": {"12D3KooWAAAAAAAAAAAAAAAAAAAAAAA": {"bytes": 5_000_000,
                                                                                "state": "fetching"}}},
        "blamed": ["12D3KooWBBBBBBBBBBBBBBBBBBBBBBB"]})
    text = "\n".join(lines)
    assert "holds      layers-0-10.gguf (layers 0:10)" in text and "fetching)" in text
    assert "fetch port 10.0.0.2:4100: 12.0 MB sent" in text
    assert "fetching   layers 10:20: 5.0 of 20.0 MB, 50.0 MB/s, ETA 0 s" in text
    assert "blamed" in text
    assert render_fetch(None) == []
