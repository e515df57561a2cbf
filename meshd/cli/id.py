"""``meshd id``: print this node's peer id (creating the identity on first use);
``meshd id --model FILE``: print the model's id, the Merkle root of its manifest.

The root names the model on the wire: other nodes join with ``meshd join --model
ROOT`` (or ``NAME@ROOT``) and fetch their range from the peers that hold it. A
slice or a partial directory prints its source's root (after checking its own
bytes against it). The file's SHA-256 -- what ``sha256sum`` prints -- follows as
a field of the manifest.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshd.cli.common import add_config_arguments, fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="print the id (Merkle root) of this .gguf file or model directory")
    add_config_arguments(parser)


def _model(path: Path) -> int:
    from meshd.errors import ModelPathMissing
    from meshd.plan.modelinfo import held_layers, model_digest, model_num_layers

    if not path.exists():
        raise ModelPathMissing(f"model path {path} does not exist")
    num_layers = model_num_layers(path)
    root = model_digest(path, sys.stderr)
    print(root)
    held = held_layers(path)
    if path.is_file():
        from native.gguf_manifest import file_manifest

        manifest = file_manifest(path)
        what = f"a slice holding layers {held[0]}:{held[1]} of {num_layers}" if held else f"{num_layers} layers"
        print(f"  {path.name}: GGUF, {what}; source file sha256:{manifest.files[0].sha256.hex()}", file=sys.stderr)
    else:
        from shard.model.st_manifest import dir_manifest

        manifest = dir_manifest(path)
        what = f"a partial directory holding layers {held[0]}:{held[1]} of {num_layers}" if held else \
            f"{num_layers} layers"
        print(f"  {path.name}: safetensors directory, {what}, {len(manifest.files)} files", file=sys.stderr)
    print(f"  join with: meshd join --model {root} --layers auto --memory SIZE", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    from dht.identity import load_or_create_identity
    from meshd.config import load_config
    from proto.errors import MeshdError

    try:
        if args.model is not None:
            return _model(args.model)
        config = load_config(args.config, {"data_dir": args.data_dir})
        print(load_or_create_identity(config.data_dir).peer_id)
    except MeshdError as exc:
        return fail(str(exc))
    return 0
