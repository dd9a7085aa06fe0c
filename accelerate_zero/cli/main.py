"""`accelerate-zero` console entry point: subcommand dispatch only.

Usage:
    accelerate-zero --help
    accelerate-zero validate CONFIG [--world_size N]
    accelerate-zero estimate --params 7e9 --num_gpus 8 --gpu_memory 80GB
    accelerate-zero launch --config_file accelerate_configs/zero2.yaml script.py
    accelerate-zero doctor accelerate_configs/zero3.yaml
    accelerate-zero consolidate out/checkpoint-500 out/consolidated
    accelerate-zero deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json
"""

from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accelerate-zero",
        description="ZeRO (stages 0-3, offload) in pure PyTorch for Accelerate and the transformers Trainer.",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    from accelerate_zero.cli import consolidate, deepspeed, doctor, estimate, launch, validate

    validate.register(subcommands)
    estimate.register(subcommands)
    launch.register(subcommands)
    consolidate.register(subcommands)
    doctor.register(subcommands)
    deepspeed.register(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses `argv` and runs the chosen subcommand; returns the process exit code."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
