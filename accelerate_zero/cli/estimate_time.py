"""`accelerate-zero estimate ... --step_seconds S --copy_gbps G --host_rate R`: each offload mode's step time,
predicted from three figures measured on the machine ([Note: the offload step time model] in debug/step_time.py).

Every estimate row gets `"step_seconds"`: the prediction and its parts (`no_offload`, `gradients_to_host`,
`host_step`, `uploads`, `parameter_reads`, `total`, and `hidden_behind_forward`: host work the next forward hides at
stage 3, not in `total`), or null without the three flags and for NVMe, whose file
traffic the model does not count.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from accelerate_zero.debug import estimate as est
from accelerate_zero.debug.step_time import Measured, offload_step_seconds


_FLAGS = ("step_seconds", "copy_gbps", "host_rate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("offload step time (all three, measured on the machine; see --help's epilog)")
    group.add_argument(
        "--step_seconds", type=float, default=None, metavar="S", help="the optimizer step without offload"
    )
    group.add_argument("--copy_gbps", type=float, default=None, metavar="G", help="pinned host<->device GB/s")
    group.add_argument(
        "--host_rate", type=float, default=None, metavar="R", help="elements/s of the fused CPU optimizer step"
    )
    group.add_argument(
        "--accumulation", type=int, default=1, metavar="A", help="micro-steps per optimizer step (default: 1)"
    )


def measured_from(args: argparse.Namespace) -> Measured | None:
    """The figures the flags give; None when none is given.

    Raises:
        ValueError: some of the three flags given without the others, or a figure <= 0.
    """
    given = [name for name in _FLAGS if getattr(args, name, None) is not None]
    if not given:
        return None
    if len(given) < len(_FLAGS):
        missing = ", ".join(f"--{name}" for name in _FLAGS if name not in given)
        raise ValueError(f"the offload step time needs all of --step_seconds, --copy_gbps, --host_rate: add {missing}")
    if args.accumulation < 1:
        raise ValueError(f"--accumulation must be at least 1, got {args.accumulation}")
    return Measured(args.step_seconds, args.copy_gbps, args.host_rate)


def add_step_times(rows: list[dict[str, Any]], shapes: est.ModelShapes, setup: est.TrainingSetup, args: Any) -> None:
    """Adds `"step_seconds"` to every estimate row (see the module docstring)."""
    measured = measured_from(args)
    for row in rows:
        row["step_seconds"] = None
        if measured is None or row["offload"] == "nvme":
            continue
        shards = 1 if row["stage"] == 0 else setup.world_size
        numel = math.ceil(shapes.numel / shards)
        row["step_seconds"] = offload_step_seconds(
            numel, row["stage"], row["offload"], args.accumulation, measured, setup.compute_bytes
        )


def render_lines(report: dict[str, Any]) -> list[str]:
    """One line per row with a predicted step time; nothing when there is none."""
    lines = []
    for row in report["estimates"]:
        parts = row.get("step_seconds")
        if parts is None:
            continue
        detail = ", ".join(f"{key} {value:.3f}" for key, value in parts.items() if key != "total" and value)
        lines.append(f"  stage {row['stage']} {row['offload']:<9} {parts['total']:.3f} s ({detail})")
    return ["predicted step time (s) from the measured figures:", *lines, ""] if lines else []
