"""Dependencies point down: every module's imports (ast, including imports inside
functions) are checked against the layer rules of ARCHITECTURE.md / README.

Top-level folders: ``proto`` <- ``shard`` <- ``native``; ``proto`` <- ``dht`` <-
``relay``; ``meshd`` on top of all. Inside ``meshd/`` the rooms form layers, top
first; a room imports only rooms below it (or itself):

    cli                      the entry point and one module per command
    benchmarks               ``meshd bench``, local-swarm and relay harnesses
    daemon                   node composition root, control socket, supervisor, relay mode
    api                      OpenAI-compatible HTTP, metrics, dashboard (the daemon serves it)
    swarm                    tracker duty, swarm view, join/directive wire
    generate                 the route driver, hop links, routes, tokenizer
    plan | reach             pure planners | reachability, relays, TLS (not each other)
    config, errors, sizes    the ground floor

``meshd.testing`` (seeded random models, worker subprocesses) is imported only
by tests and benchmarks.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("proto", "shard", "native", "dht", "relay", "meshd")
ALLOWED_TOP = {
    "proto": {"proto"},
    "shard": {"proto", "shard"},
    "native": {"proto", "shard", "native"},
    "dht": {"proto", "dht"},
    "relay": {"proto", "dht", "relay"},
    "meshd": set(OURS),
}
GROUND = {"config", "errors", "sizes", "__init__"}
RANK = {"__main__": 9, "cli": 8, "benchmarks": 7, "daemon": 6, "api": 5, "swarm": 4, "generate": 3,
        "plan": 2, "reach": 2, "testing": 2}
TESTING_USERS = {"benchmarks", "testing"}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _rank(room: str) -> int:
    return 0 if room in GROUND else RANK[room]


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            # "from meshd import testing" names a module too
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                    if (root / node.module.replace(".", "/") / a.name).is_dir()
                    or (root / node.module.replace(".", "/") / f"{a.name}.py").is_file()]
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.append((node.lineno, "<relative>"))
    return out


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for top in OURS:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            module = ".".join(rel.with_suffix("").parts)
            for line, target in _imports(path, root):
                where = f"{rel}:{line} imports {target}"
                if target == "<relative>":
                    found.append(f"{where}: use absolute imports")
                    continue
                head = target.split(".")[0]
                if head not in OURS:
                    continue
                if head not in ALLOWED_TOP[top]:
                    found.append(f"{where}: {top}/ may import only {sorted(ALLOWED_TOP[top])}")
                    continue
                if top == "meshd" and head == "meshd":
                    src, dst = _room(module), _room(target)
                    if dst == "testing" and src not in TESTING_USERS:
                        found.append(f"{where}: only tests and benchmarks import meshd.testing")
                    elif src != dst and _rank(dst) >= _rank(src) and dst not in GROUND:
                        found.append(f"{where}: room {src} may not import room {dst} (same or higher layer)")
    return found


def test_every_top_level_folder_and_room_imports_only_downwards():
    assert violations() == []


def test_nothing_below_meshd_imports_meshd():
    bad = [v for v in violations() if not v.startswith("meshd")]
    assert bad == []


def test_the_checker_sees_upward_imports(tmp_path):
    # the rules are live: a small fake tree with one upward import of each kind is reported
    for rel, src in {
        "shard/a.py": "import meshd.config\n",
        "dht/b.py": "from relay import host\n",
        "meshd/plan/c.py": "from meshd.generate import driver\n",
        "meshd/daemon/d.py": "from meshd import testing\n",
        "meshd/testing/__init__.py": "",
        "meshd/generate/driver.py": "from meshd.plan import c\nimport proto\n",
        "relay/host.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    found = violations(tmp_path)
    assert {v.split(":")[0] for v in found} == {"shard/a.py", "dht/b.py", "meshd/plan/c.py", "meshd/daemon/d.py"}, found


def test_repo_root_constants_point_at_the_checkout():
    # children get PYTHONPATH=REPO_ROOT: after a module moves, its REPO_ROOT must still be the checkout
    from meshd.benchmarks import recipes, relay_harness
    from meshd.daemon import local_swarm, worker_process
    from meshd.testing import procs

    for module in (local_swarm, recipes, relay_harness, worker_process, procs):
        assert module.REPO_ROOT == ROOT, module.__name__
