"""Private names stay private: no module of ours imports another module's ``_name``.

A name with a leading underscore is a module's own business; another module
that needs it gets a public name (or a small public surface) instead. The
check reads every product module's imports (ast): ``from pkg.mod import _x``
and ``mod._x`` on a module imported from our folders are refused. Tests may
reach into internals (monkeypatching, white-box checks); the product may not.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("proto", "shard", "native", "dht", "relay", "meshd")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(root: Path = ROOT) -> list[str]:
    found = []
    for top in OURS:
        for path in sorted((root / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            modules: dict[str, str] = {}      # local name -> our module it stands for
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
                    for alias in node.names:
                        if _private(alias.name):
                            found.append(f"{path.relative_to(root)}:{node.lineno} imports {node.module}.{alias.name}")
                        if (root / node.module.replace(".", "/") / f"{alias.name}.py").exists():
                            modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.split(".")[0] in OURS and alias.asname:
                            modules[alias.asname] = alias.name
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in modules and _private(node.attr)):
                    found.append(f"{path.relative_to(root)}:{node.lineno} uses {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    assert private_uses() == []


def test_the_check_sees_both_spellings(tmp_path):
    for top in OURS:
        (tmp_path / top).mkdir()
    (tmp_path / "shard" / "a.py").write_text("_hidden = 1\n")
    (tmp_path / "meshd" / "b.py").write_text("from shard.a import _hidden\n")
    (tmp_path / "meshd" / "c.py").write_text("from shard import a as m\nx = m._hidden\n")
    (tmp_path / "meshd" / "d.py").write_text("from shard.a import __doc__\n")   # dunders are not private
    assert private_uses(tmp_path) == ["meshd/b.py:1 imports shard.a._hidden", "meshd/c.py:2 uses shard.a._hidden"]
