"""One concurrency rule per process, checked on the source (ast): the rules stay true as code moves.

- Every thread of the product starts through ``proto.threads.ThreadGroup`` (its owner stops and
  joins it): no ``threading.Thread`` / ``Timer`` / ``ThreadPoolExecutor`` / ``start_new_thread``
  call anywhere else. The benchmark and test harnesses (meshd/benchmarks, meshd/testing) are
  programs of their own and are not held to it.
- No process of the product leaves through ``os._exit``: the worker and the expert worker stop
  their servers, join their threads and return from main.
- A plain thread reaches a trio loop only through relay/portal.py: ``trio.from_thread`` and
  ``TrioToken.run_sync_soon`` appear nowhere else -- but in dht/host/mdns.py, whose callers are
  zeroconf's own asyncio thread (not one of ours) and which sits below relay/ in the layering:
  it only posts (``run_sync_soon``, never blocking that thread), as ``Portal.post`` does.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("proto", "shard", "native", "dht", "relay", "meshd")
HARNESSES = ("meshd/benchmarks", "meshd/testing")
THREAD_STARTERS = {"Thread", "Timer", "ThreadPoolExecutor", "start_new_thread"}
THREAD_HOME = "proto/threads.py"
PORTAL_HOME = "relay/portal.py"
# Posts only (run_sync_soon) from a library's thread, below relay/ (module docstring).
LIBRARY_THREAD_POSTS = {"dht/host/mdns.py": {"run_sync_soon"}}


def product_files(root: Path = ROOT) -> list[tuple[str, ast.AST]]:
    out = []
    for top in PRODUCT:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith(HARNESSES):
                out.append((rel, ast.parse(path.read_text(), rel)))
    return out


def _called_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def thread_starts(files) -> list[str]:
    return [f"{rel}:{node.lineno}" for rel, tree in files if rel != THREAD_HOME
            for node in ast.walk(tree) if isinstance(node, ast.Call) and _called_name(node) in THREAD_STARTERS]


def hard_exits(files) -> list[str]:
    return [f"{rel}:{node.lineno}" for rel, tree in files
            for node in ast.walk(tree) if isinstance(node, ast.Call) and _called_name(node) == "_exit"]


def loop_bridges(files) -> list[str]:
    found = []
    for rel, tree in files:
        if rel == PORTAL_HOME:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("from_thread", "run_sync_soon"):
                if node.attr in LIBRARY_THREAD_POSTS.get(rel, ()):
                    continue
                found.append(f"{rel}:{node.lineno} {node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trio.from_thread"):
                found.append(f"{rel}:{node.lineno} {node.module}")
    return found


def test_every_thread_of_the_product_starts_in_a_thread_group():
    assert thread_starts(product_files()) == []


def test_no_process_of_the_product_leaves_through_os_exit():
    assert hard_exits(product_files()) == []


def test_threads_reach_a_trio_loop_only_through_the_portal_module():
    assert loop_bridges(product_files()) == []


def test_the_rules_see_what_they_forbid(tmp_path):
    # a fake product tree with one breach of each rule, next to what is allowed
    for rel, src in {
        "shard/edges/x.py": "import threading\nthreading.Thread(target=print).start()\n",
        "meshd/cli/w.py": "import os\nos._exit(0)\n",
        "meshd/generate/s.py": "import trio\ntrio.from_thread.run_sync(print)\n",
        "relay/t.py": "def f(token):\n    token.run_sync_soon(print)\n",
        "proto/threads.py": "import threading\nthreading.Thread(target=print)\n",          # the home
        "relay/portal.py": "import trio\ntrio.from_thread.run(print)\n",                     # the home
        "meshd/benchmarks/b.py": "import os, threading\nthreading.Thread(target=print)\nos._exit(0)\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    for top in PRODUCT:
        (tmp_path / top).mkdir(exist_ok=True)
    files = product_files(tmp_path)
    assert thread_starts(files) == ["shard/edges/x.py:2"]
    assert hard_exits(files) == ["meshd/cli/w.py:2"]
    assert sorted(loop_bridges(files)) == ["meshd/generate/s.py:2 from_thread", "relay/t.py:2 run_sync_soon"]
