"""python -m proto.golden [--write | --check]"""
from __future__ import annotations

import argparse
import sys

from proto.golden import GOLDEN_DIR, build_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write or check the golden frames")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    ns = parser.parse_args(argv)
    drift = []
    for name, data in build_all().items():
        path = GOLDEN_DIR / name
        if ns.write:
            path.write_bytes(data)
            print(f"wrote {path.name} ({len(data)} bytes)")
        elif not path.exists() or path.read_bytes() != data:
            drift.append(name)
    if drift:
        print("golden frames differ from the codec: " + ", ".join(drift)
              + "\nif the change is intended: python -m proto.golden --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
