"""`accelerate-zero validate`: load and resolve a ZeRO config, print the resolved values.

Usage:
    accelerate-zero validate ds_config.json --world_size 8
    accelerate-zero validate accelerate_configs/zero3.yaml

CONFIG is a DeepSpeed config (.json, or .yaml/.yml with the same structure) or an accelerate config file (a YAML or
JSON with `distributed_type`, as `accelerate config` writes it), which is read as `accelerate-zero launch` reads it:
the DeepSpeed config it builds is checked at its `num_processes`. Prints the resolved config as JSON on stdout
("auto" values kept) and, on stderr, the "auto" values and what fills them at run time, the notes (keys accepted
without effect: DeepSpeed ignores them too, or they are off) and the launch warnings; exits 0. Or prints every
problem to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.config.blocks import KeyPolicy
from accelerate_zero.config.deepspeed_keys import NOTED_ENV
from accelerate_zero.config.fields import is_block_type, split_optional, type_hints
from accelerate_zero.config.hidden_size import HIDDEN_SIZE_DESCRIPTIONS


INVALID_CONFIG_EXIT_CODE = 2

# What fills each "auto" at run time: the Trainer (transformers' rules, integrations/transformers/auto_values.py)
# or `ZeroAccelerator.prepare` (integrations/accelerate/auto_fill.py). Keys not listed get the generic sentence.
_FILLED_BY = {
    "train_batch_size": "world size / sequence_parallel_size x per_device_train_batch_size x gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size (Trainer) or the dataloader's batch size",
    "gradient_accumulation_steps": "gradient_accumulation_steps (TrainingArguments or ZeroAccelerator)",
    "gradient_clipping": "max_grad_norm (Trainer); 1.0 under ZeroAccelerator",
    "fp16.enabled": "fp16 / fp16_full_eval (Trainer) or mixed_precision (accelerate)",
    "bf16.enabled": "bf16 / bf16_full_eval (Trainer) or mixed_precision (accelerate)",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "[adam_beta1, adam_beta2]",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_min_lr": "0",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": "the Trainer's warmup steps, when training starts",
    "scheduler.params.total_num_steps": "the number of training steps, when training starts",
    **HIDDEN_SIZE_DESCRIPTIONS,
}


def register(subcommands: Any) -> None:
    """Adds the `validate` subcommand to `subcommands` (the object `add_subparsers()` returns)."""
    parser = subcommands.add_parser(
        "validate",
        help="check a DeepSpeed-format ZeRO config (or an accelerate config file) and print its resolved values",
        description="Load CONFIG (a DeepSpeed .json/.yaml, or an accelerate config file, read as `accelerate-zero "
        'launch` reads it), resolve it for --world_size ranks and print it as JSON. Values still "auto" are '
        "kept and listed with what fills them: the Trainer or ZeroAccelerator.prepare, when the run starts.",
    )
    parser.add_argument("config", metavar="CONFIG", help="path to the config file")
    parser.add_argument(
        "--world_size",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel world size to resolve for (default: an accelerate config's num_processes, else 1)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Runs `validate`; returns 0 for a valid config, 2 (problems on stderr) otherwise."""
    from accelerate_zero.integrations.accelerate.launch_checks import node_span_warnings, resolve_leaving_auto

    warnings: list[str] = []
    try:
        with notes_printed_here():
            if is_accelerate_config(args.config):
                label = f"accelerate config {args.config}"
                config, world_size, machines = _accelerate_file(args.config, args.world_size)
                warnings = node_span_warnings(config, world_size, machines)
            else:
                label = f"ZeRO config {args.config}"
                config, world_size = ZeroConfig.from_any(args.config), args.world_size or 1
            resolved = resolve_leaving_auto(config, world_size)
    except ZeroConfigError as error:
        print(f"accelerate-zero: invalid {label}:", file=sys.stderr)
        for problem in error.problems:
            print(f"  - {problem}", file=sys.stderr)
        return INVALID_CONFIG_EXIT_CODE
    print(json.dumps(resolved.config, indent=2))
    print(f"accelerate-zero: {label} is valid for world size {world_size}.", file=sys.stderr)
    if resolved.auto_keys:
        print('"auto" values, filled when the run starts:', file=sys.stderr)
        for key in resolved.auto_keys:
            print(f"  {key:<55} <- {_FILLED_BY.get(key, _unfilled(key))}", file=sys.stderr)
    for title, lines in (("notes (accepted, no effect)", config.notes), ("warnings", warnings)):
        if lines:
            print(f"{title}:", file=sys.stderr)
            for line in lines:
                print(f"  - {line}", file=sys.stderr)
    return 0


def _unfilled(key: str) -> str:
    """What an "auto" no integration fills becomes: DeepSpeed's pydantic blocks drop it (the default)."""
    block, _ = split_optional(type_hints(ZeroConfig).get(key.split(".")[0]))
    if is_block_type(block) and block._KEYS is KeyPolicy.DEEPSPEED_MODEL:
        return "the default, when nothing fills it (as in DeepSpeed)"
    return "filled by the Trainer or ZeroAccelerator.prepare"


@contextlib.contextmanager
def notes_printed_here() -> Iterator[None]:
    """`validate` and `doctor` print the config's notes themselves: they are not logged as well."""
    saved = os.environ.get(NOTED_ENV)
    os.environ[NOTED_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[NOTED_ENV]
        else:
            os.environ[NOTED_ENV] = saved


def is_accelerate_config(path: str) -> bool:
    """True for an accelerate config file (a mapping with `distributed_type` or `compute_environment`)."""
    try:
        text = Path(path).read_text()
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return False  # ZeroConfig.from_any reports the unreadable file
    return isinstance(data, dict) and ("distributed_type" in data or "compute_environment" in data)


def config_from_accelerate_file(path: str, world_size: int | None = None) -> tuple[ZeroConfig, int]:
    """The DeepSpeed config `accelerate-zero launch --config_file path` would hand the ranks, and its world size.

    Raises:
        ZeroConfigError: the problems the launcher would report before starting anything.
    """
    config, size, _ = _accelerate_file(path, world_size)
    return config, size


def _accelerate_file(path: str, world_size: int | None) -> tuple[ZeroConfig, int, int]:
    """`config_from_accelerate_file`, and the number of machines."""
    from accelerate.commands.launch import launch_command_parser

    from accelerate_zero.integrations.accelerate.launcher import LaunchError, prepare_launch

    args = launch_command_parser().parse_args(["--config_file", path, "script.py"])
    if world_size is not None:
        args.num_processes = world_size
    try:
        prepared = prepare_launch(args)
    except LaunchError as error:
        raise ZeroConfigError([str(error)]) from None
    return prepared.built.zero_config, prepared.num_processes, prepared.num_machines
