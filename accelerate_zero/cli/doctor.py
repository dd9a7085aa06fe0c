"""`accelerate-zero doctor`: what a config file will do under each launcher.

Usage:
    accelerate-zero doctor accelerate_configs/zero3.yaml
    accelerate-zero doctor examples/ds_config.json --num_processes 8

CONFIG is an accelerate config file (as `accelerate config` writes it) or a DeepSpeed JSON/YAML. For each way of
starting a script (`accelerate-zero launch`, `accelerate launch` with and without deepspeed installed, plain
`torchrun`) it prints what happens: which engine trains, with which ZeRO settings, or where it stops and what to run
instead. It starts nothing. Exits 0, or 2 when the config itself is invalid (the problems are printed too).

Every sentence it prints is in `LAUNCHER_TEXT` below: correct them there.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.config.schema import is_auto


INVALID_CONFIG_EXIT_CODE = 2

LAUNCHER_TEXT: dict[str, str] = {
    "ours": "validates the config before starting anything, then starts {processes} with accelerate's own launcher "
    "(torch.distributed.run); every rank receives the DeepSpeed config (`accelerate-zero validate CONFIG` prints "
    "it), which accelerate_zero's Trainer, ZeroAccelerator and ZeroPlugin() read: {summary}.",
    "ours_bad": "stops before starting any process, exit code 2, listing the problems above.",
    "ours_json": "give the file with --deepspeed_config_file: `accelerate-zero launch --num_processes {n} "
    "--deepspeed_config_file {config} train.py`; every rank then trains with {summary}.",
    "accelerate_ds": "accelerate starts its DeepSpeed launcher. In a script that uses accelerate_zero's Trainer or "
    "ZeroAccelerator, they take over the DeepSpeed config accelerate exported and train with accelerate_zero's "
    "engine ({summary}); a script using accelerate's own Accelerator or transformers' Trainer trains with "
    "DeepSpeed itself.",
    "accelerate_no_ds": "accelerate stops at its own `ImportError: DeepSpeed is not installed` before starting the "
    "script: run the same command line with `accelerate-zero launch` instead (it takes the same flags and config).",
    "accelerate_not_ds": "accelerate starts {processes} without ZeRO settings (distributed_type {kind}): "
    "ZeroAccelerator and the Trainer then use their defaults (ZeRO stage 2) unless the script or `--zero_stage` / "
    "`--deepspeed_config_file` on an `accelerate-zero launch` line configures them.",
    "accelerate_json": "`accelerate launch --use_deepspeed --deepspeed_config_file {config} train.py` behaves as "
    "the DeepSpeed rows of an accelerate config: with deepspeed installed accelerate_zero's Trainer / "
    "ZeroAccelerator take the config over; without it accelerate stops at its ImportError "
    "(use `accelerate-zero launch` with the same flags).",
    "torchrun_accel": "torchrun does not read accelerate config files: the ranks get no ZeRO settings from this "
    "file. Pass them in the script (`TrainingArguments(zero_config=...)`, `ZeroAccelerator(ZeroPlugin(config=...))` "
    "or `accelerate_zero.initialize(..., config=...)`), or start it with `accelerate-zero launch`.",
    "torchrun_json": "`torchrun --nproc_per_node N train.py` works when the script passes this file itself: "
    '`accelerate_zero.initialize(model, optimizer, config="{config}")`, `TrainingArguments(zero_config="{config}")` '
    'or `ZeroAccelerator(ZeroPlugin(config="{config}"))`.',
}
"""Every sentence `doctor` prints, by situation; `{...}` fields are filled from the config."""


def register(subcommands: Any) -> None:
    """Adds the `doctor` subcommand to `subcommands` (the object `add_subparsers()` returns)."""
    parser = subcommands.add_parser(
        "doctor",
        help="explain what a config file will do under accelerate-zero launch, accelerate launch and torchrun",
        description="Read CONFIG (an accelerate config file or a DeepSpeed JSON/YAML) and say, for each launcher, "
        "what will happen: which engine trains with which ZeRO settings, or where it stops and what to run "
        "instead. Starts nothing.",
    )
    parser.add_argument("config", metavar="CONFIG", help="path to the config file")
    parser.add_argument(
        "--num_processes",
        type=int,
        default=None,
        metavar="N",
        help="processes to check for (default: the accelerate config's num_processes, else 1)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Runs `doctor`; returns 0, or 2 when the config is invalid."""
    from accelerate_zero.cli.validate import config_from_accelerate_file, is_accelerate_config, notes_printed_here
    from accelerate_zero.integrations.accelerate.launch_checks import resolve_leaving_auto

    accelerate_file = is_accelerate_config(args.config)
    problems: list[str] = []
    notes: list[str] = []
    summary, world_size = "", args.num_processes or 1
    try:
        with notes_printed_here():
            if accelerate_file:
                config, world_size = config_from_accelerate_file(args.config, args.num_processes)
            else:
                config = ZeroConfig.from_any(args.config)
        resolve_leaving_auto(config, world_size)
        summary, notes = describe(config), list(config.notes)
    except ZeroConfigError as error:
        problems = list(error.problems)
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    kind = _distributed_type(args.config) if accelerate_file else None
    fill = {
        "config": args.config,
        "summary": summary,
        "n": args.num_processes or (world_size if accelerate_file else "N"),
        "processes": f"{world_size} process{'es' if world_size != 1 else ''}",
        "kind": kind,
    }
    print(f"{args.config}: {'an accelerate config file' if accelerate_file else 'a DeepSpeed config'}")
    for problem in problems:
        print(f"  problem: {problem}")
    for note in notes:  # keys DeepSpeed ignores too, disabled blocks: accepted, no effect
        print(f"  note: {note}")
    for launcher, key in _rows(accelerate_file, kind, bool(problems), has_deepspeed):
        print(f"\n{launcher}:\n  {LAUNCHER_TEXT[key].format(**fill)}")
    return INVALID_CONFIG_EXIT_CODE if problems else 0


def describe(config: ZeroConfig) -> str:
    """One line: stage, offload and precision of `config`, e.g. "ZeRO stage 3, optimizer offload cpu, fp32"."""
    zero = config.zero_optimization
    parts = [f"ZeRO stage {zero.stage}"]
    for name in ("offload_optimizer", "offload_param"):
        offload = getattr(zero, name)
        if offload is not None and offload.device not in ("none", None):
            where = f" ({offload.nvme_path})" if offload.device == "nvme" else ""
            parts.append(f"{name.removeprefix('offload_')} offload to {offload.device}{where}")
    threshold = zero.stage3_param_persistence_threshold
    if zero.stage == 3:
        parts.append(
            f"parameters below {threshold} elements kept whole on every rank"
            if is_auto(threshold) or threshold > 0
            else "every parameter sharded"
        )
    if is_auto(config.bf16.enabled) or is_auto(config.fp16.enabled):
        parts.append("fp16/bf16 as the Trainer's arguments or accelerate's mixed_precision say")
    else:
        parts.append("bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "fp32")
    return ", ".join(parts)


def _rows(accelerate_file: bool, kind: str | None, invalid: bool, has_deepspeed: bool) -> list[tuple[str, str]]:
    here = " (this machine)"
    with_ds, without_ds = ("", here) if not has_deepspeed else (here, "")
    if not accelerate_file:
        return [
            ("accelerate-zero launch", "ours_bad" if invalid else "ours_json"),
            ("accelerate launch", "accelerate_json"),
            ("torchrun", "torchrun_json"),
        ]
    deepspeed = kind == "DEEPSPEED"
    return [
        ("accelerate-zero launch --config_file CONFIG train.py", "ours_bad" if invalid else "ours"),
        (
            f"accelerate launch --config_file CONFIG train.py, deepspeed installed{with_ds}",
            "accelerate_ds" if deepspeed else "accelerate_not_ds",
        ),
        (
            f"accelerate launch --config_file CONFIG train.py, deepspeed not installed{without_ds}",
            "accelerate_no_ds" if deepspeed else "accelerate_not_ds",
        ),
        ("torchrun --nproc_per_node N train.py", "torchrun_accel"),
    ]


def _distributed_type(path: str) -> str | None:
    from accelerate.commands.config import load_config_from_file

    try:
        return str(load_config_from_file(path).distributed_type.value)
    except Exception:  # accelerate's own reading errors are reported by the launch row's problems
        return None
