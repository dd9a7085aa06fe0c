"""`accelerate-zero validate`: load and resolve a ZeRO config, print the resolved values.

Usage:
    accelerate-zero validate ds_config.json --world_size 8

Prints the resolved config as JSON and exits 0, or prints every problem to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from accelerate_zero.config import ZeroConfig, ZeroConfigError, resolve_config


INVALID_CONFIG_EXIT_CODE = 2


def register(subcommands: Any) -> None:
    """Adds the `validate` subcommand to `subcommands` (the object `add_subparsers()` returns)."""
    parser = subcommands.add_parser(
        "validate",
        help="check a DeepSpeed-format ZeRO config and print its resolved values",
        description="Load CONFIG (.json, .yaml or .yml), resolve it for --world_size ranks and print it as JSON. "
        'Values still "auto" are reported: the Trainer/accelerate integration fills them at run time.',
    )
    parser.add_argument("config", metavar="CONFIG", help="path to the config file")
    parser.add_argument(
        "--world_size", type=int, default=1, metavar="N", help="data-parallel world size to resolve for (default: 1)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Runs `validate`; returns 0 for a valid config, 2 (problems on stderr) otherwise."""
    try:
        resolved = resolve_config(ZeroConfig.from_any(args.config), world_size=args.world_size)
    except ZeroConfigError as error:
        print(f"accelerate-zero: invalid ZeRO config {args.config}:", file=sys.stderr)
        for problem in error.problems:
            print(f"  - {problem}", file=sys.stderr)
        return INVALID_CONFIG_EXIT_CODE
    print(json.dumps(resolved.to_dict(), indent=2))
    return 0
