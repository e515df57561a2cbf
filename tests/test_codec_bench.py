"""``meshd bench codec --quick --json`` runs as a subprocess and reports every key.

Timings are printed, never asserted (they depend on the machine's load); the
size and accuracy properties are exact and asserted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_codec_quick_json():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-m", "meshd", "bench", "codec", "--quick", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout)
    print(json.dumps(result, sort_keys=True))
    assert result["raw"]["ratio_vs_memcpy"] > 0 and result["zstd"]["mb_s"] > 0
    assert result["q8"]["bytes_per_value"] <= 1.07
    assert result["q8"]["max_error_in_half_scales"] <= 1.0
    assert result["decode_step_overhead_bytes"] <= 64
    assert result["raw"]["payload_bytes"] == 1 << 20
