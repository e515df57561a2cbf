"""``meshd slice``: cut a self-describing layer-range slice out of a GGUF model.

    meshd slice FILE.gguf --layers A:B -o OUT.gguf

OUT holds the blocks of layers [A, B) (plus the embedding for the head and
the output tensors for the tail), every metadata pair of FILE (tokenizer and
chat template included) and ``meshd.slice.*`` naming the source's digest and
the range (native/slice.py ``write_user_slice``). ``meshd join --model OUT``
then serves ranges inside [A, B) only, as the same model artifact as FILE:
slices and whole files of one source route together. FILE may itself be a
slice (the range must lie inside it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshd.cli.common import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="the GGUF model file (or a slice of one)")
    parser.add_argument("--layers", required=True, help="layer range A:B to keep (half-open)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="where to write the slice")


def run(args: argparse.Namespace) -> int:
    from meshd.config import parse_layers
    from meshd.errors import ConfigError
    from proto.errors import MeshdError

    try:
        if args.model.suffix != ".gguf" or not args.model.is_file():
            raise ConfigError(f"{args.model} is not a .gguf file")
        if args.output.resolve() == args.model.resolve():
            raise ConfigError("the slice must not overwrite its source")
        start, end = parse_layers(args.layers)
        from native.slice import write_user_slice

        out = write_user_slice(args.model, start, end, args.output, progress=sys.stderr)
    except MeshdError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot write {args.output}: {exc}")
    size = out.stat().st_size
    print(f"{out}: layers {start}:{end} ({size / 1e6:.1f} MB)")
    return 0
