"""`accelerate-zero launch`: `accelerate launch` for ZeRO, without deepspeed installed.

Usage:
    accelerate-zero launch --config_file accelerate_configs/zero2.yaml train.py --lr 3e-4
    accelerate-zero launch --config_file multi_gpu.yaml --deepspeed_config_file ds_config.json train.py
    accelerate-zero launch --num_processes 2 --zero_stage 1 train.py

Takes every flag of `accelerate launch` and the accelerate config files users have (`distributed_type: DEEPSPEED`
with a `deepspeed_config` block or a `deepspeed_config_file`). Exits 2, starting nothing, when the config is
invalid; otherwise with the exit code of the run (non-zero when a rank failed).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from accelerate_zero.config import ZeroConfigError


INVALID_CONFIG_EXIT_CODE = 2


def register(subcommands: Any) -> None:
    """Adds the `launch` subcommand to `subcommands` (the object `add_subparsers()` returns).

    Its flags are those of `accelerate launch` (taken from accelerate's own parser, so they stay in step).
    """
    from accelerate.commands.launch import launch_command_parser

    subcommands.add_parser(
        "launch",
        parents=[launch_command_parser()],
        add_help=False,
        allow_abbrev=False,
        help="launch a training script on every rank with ZeRO (a drop-in for `accelerate launch`)",
        description="Launch a script on every rank with ZeRO configured: the flags and config files of "
        "`accelerate launch` (distributed_type: DEEPSPEED with a deepspeed_config block, or deepspeed_config_file), "
        "without deepspeed installed. The ranks receive the DeepSpeed config in ACCELERATE_ZERO_CONFIG.",
    ).set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Runs `launch`; returns the run's exit code, or 2 (problems on stderr, nothing started) for a bad config."""
    from accelerate_zero.integrations.accelerate.launcher import LaunchError, launch

    try:
        return launch(args)
    except ZeroConfigError as error:
        print("accelerate-zero launch: invalid ZeRO config, nothing was started:", file=sys.stderr)
        for problem in error.problems:
            print(f"  - {problem}", file=sys.stderr)
    except LaunchError as error:
        print(f"accelerate-zero launch: {error}", file=sys.stderr)
    return INVALID_CONFIG_EXIT_CODE
