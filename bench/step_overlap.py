"""The offloaded host step across the step boundary, measured on the CPU: step time synchronous vs overlapped.

Usage:
    .venv/bin/python bench/step_overlap.py                      # hidden 1024 x 8 layers, 12 timed steps per mode
    .venv/bin/python bench/step_overlap.py --hidden 2048 --layers 8 --steps 10 --threads 1

One process (gloo, world size 1), stage 3, bf16, a stack of `--layers` x Linear(--hidden, --hidden) with tanh, each
Linear a unit (`stage3_param_persistence_threshold: 0`), AdamW, gradient clipping 1.0, `--accumulation` micro-steps
of 8 samples per step, `--threads` intra-op threads (1: what torchrun sets). Modes: no offload, optimizer cpu and
optimizer + param cpu, each synchronous (`ACCELERATE_ZERO_OVERLAP_STEP=0`) and overlapped ([Note: the host step across
the step boundary] in accelerate_zero/engine/step_in_flight.py). A step is timed from its first forward to the first
forward of the next step (a step's host work runs into the next forward when overlapped), as the median over
`--steps` steps after 2 warm-up steps; the modes run in turn, twice (the median of both rounds' medians), so that
drift from other load on the machine is shared. On the CPU the "device" and the host are the same cores: what the
overlap buys is the host step running on a core the forward leaves idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

MODES = ["none", "cpu/sync", "cpu", "cpu+param/sync", "cpu+param"]


def config(mode: str, accumulation: int) -> dict:
    offload = mode.partition("/")[0]
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "cpu+param":
        zero["offload_param"] = {"device": "cpu"}
    return {
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero,
    }


def run_mode(args: argparse.Namespace, mode: str) -> list[float]:
    import torch
    from torch import nn

    import accelerate_zero
    from accelerate_zero.engine.step_in_flight import OVERLAP_ENV

    os.environ[OVERLAP_ENV] = "0" if mode.endswith("/sync") else "1"
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.Tanh())])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = accelerate_zero.initialize(
        model, optimizer, config=config(mode, args.accumulation), device="cpu", unit_classes=[nn.Linear]
    )
    x, y = torch.randn(8, args.hidden, dtype=torch.bfloat16), torch.randn(8, args.hidden)
    starts = []
    for _ in range(2 + args.steps + 1):
        starts.append(time.perf_counter())
        for _ in range(args.accumulation):
            engine.backward(nn.functional.mse_loss(engine(x).float(), y))
            engine.step()
    engine.destroy()
    return [b - a for a, b in zip(starts[2:], starts[3:], strict=False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=HERE / "out" / "step_overlap.json")
    args = parser.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    import torch

    torch.set_num_threads(args.threads)
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(2):
        for mode in MODES:
            medians[mode].append(statistics.median(run_mode(args, mode)))
    seconds = {mode: statistics.median(values) for mode, values in medians.items()}
    numel = args.layers * (args.hidden * args.hidden + args.hidden)
    lines = [
        f"stage 3, bf16, {args.layers} x Linear({args.hidden}) ({numel / 1e6:.1f}M parameters), accumulation "
        f"{args.accumulation}, 1 process, {args.threads} thread(s), {os.cpu_count()} cores",
        "",
        "| mode | schedule | s/step | x no offload | overlapped / synchronous |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        offload, _, sync = mode.partition("/")
        schedule = "-" if offload == "none" else ("synchronous" if sync else "overlapped")
        versus = f"{seconds[mode] / seconds[offload + '/sync']:.2f}" if offload != "none" and not sync else "-"
        lines.append(
            f"| {offload} | {schedule} | {seconds[mode]:.4f} | {seconds[mode] / seconds['none']:.2f} | {versus} |"
        )
    text = "\n".join(lines)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"args": vars(args) | {"json": str(args.json)}, "medians": medians, "table": text})
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
