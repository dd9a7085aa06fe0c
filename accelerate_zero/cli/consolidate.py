"""`accelerate-zero consolidate`: a sharded checkpoint -> a folder `from_pretrained` loads (DeepSpeed's zero_to_fp32).

Usage:
    accelerate-zero consolidate out/checkpoint-500 out/consolidated [--dtype fp32|bf16|fp16]
    accelerate-zero consolidate out/checkpoint-500 out/ds --format deepspeed   # a folder zero_to_fp32.py reads

Runs offline in one process (no process group, any machine); prints the output folder and exits 0, or prints the
problem and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from accelerate_zero.checkpoint.consolidate import DTYPES


BAD_CHECKPOINT_EXIT_CODE = 2


def register(subcommands: Any) -> None:
    """Adds the `consolidate` subcommand to `subcommands`."""
    parser = subcommands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint into full weights from_pretrained loads",
        description="Assemble every parameter of CHECKPOINT_DIR (a Trainer checkpoint-N folder, a save_state folder, "
        "or an engine save_checkpoint folder) from its rank files, and write OUTPUT_DIR with model.safetensors plus "
        "the config and tokenizer files found in CHECKPOINT_DIR. Needs neither the job's world size nor a process "
        "group; trained parameters come from the fp32 master weights.",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    parser.add_argument("output", metavar="OUTPUT_DIR")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the written weights (default: fp32)"
    )
    parser.add_argument(
        "--format",
        choices=("safetensors", "deepspeed"),
        default="safetensors",
        help="safetensors (default): a from_pretrained folder; deepspeed: a DeepSpeed ZeRO folder (latest + "
        "global_stepN/) whose weights DeepSpeed's zero_to_fp32.py reads (fp32; no optimizer state)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from accelerate_zero.checkpoint.consolidate import consolidate

    try:
        if args.format == "deepspeed":
            from accelerate_zero.checkpoint.deepspeed_write import write_deepspeed_folder

            if args.dtype != "fp32":
                raise ValueError(f"--dtype {args.dtype}: DeepSpeed's folders hold fp32 weights; leave --dtype out")
            out = write_deepspeed_folder(args.checkpoint, args.output)
        else:
            out = consolidate(args.checkpoint, args.output, args.dtype)
    except (FileNotFoundError, ValueError) as error:
        print(f"accelerate-zero consolidate: {error}", file=sys.stderr)
        return BAD_CHECKPOINT_EXIT_CODE
    print(out)
    return 0
