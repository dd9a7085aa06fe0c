"""The offloaded host step across the step boundary, measured on the CPU: step time synchronous vs overlapped
(bench/README.md, "The host step across the step boundary, on the CPU").

Usage:
    .venv/bin/python bench/step_overlap.py                      # hidden 1024 x 8 layers, 12 timed steps per mode
    .venv/bin/python bench/step_overlap.py --hidden 2048 --layers 8 --steps 10 --threads 1

One process, stage 3, bf16, a stack of Linear with tanh, each Linear a unit, AdamW, clipping 1.0. Modes: no offload,
optimizer cpu and optimizer + param cpu, each synchronous (`ACCELERATE_ZERO_OVERLAP_STEP=0`) and overlapped ([Note:
the host step across the step boundary] in accelerate_zero/engine/step_in_flight.py). A step is timed from its first
forward to the next step's, median over `--steps` after 2 warm-up steps; the modes run in turn, twice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from harness import launch, report


HERE = Path(__file__).resolve().parent
MODES = ["none", "cpu/sync", "cpu", "cpu+param/sync", "cpu+param"]


def config(mode: str, accumulation: int) -> dict:
    offload = mode.partition("/")[0]
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "cpu+param":
        zero["offload_param"] = {"device": "cpu"}
    return {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": accumulation, "zero_optimization": zero}  # fmt: skip


def run_mode(args: argparse.Namespace, mode: str) -> list[float]:
    import torch
    from torch import nn

    import accelerate_zero
    from accelerate_zero.engine.step_in_flight import OVERLAP_ENV

    os.environ[OVERLAP_ENV] = "0" if mode.endswith("/sync") else "1"
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.Tanh())])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = accelerate_zero.initialize(model, optimizer, config=config(mode, args.accumulation), device="cpu",
                                        unit_classes=[nn.Linear])  # fmt: skip
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
    launch.single_process_env()
    import torch

    torch.set_num_threads(args.threads)
    facts = report.machine_facts()
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(2):
        for mode in MODES:
            medians[mode].append(statistics.median(run_mode(args, mode)))
    seconds = {mode: statistics.median(values) for mode, values in medians.items()}
    numel = args.layers * (args.hidden * args.hidden + args.hidden)
    rows = []
    for mode in MODES:
        offload, _, sync = mode.partition("/")
        schedule = "-" if offload == "none" else ("synchronous" if sync else "overlapped")
        versus = f"{seconds[mode] / seconds[offload + '/sync']:.2f}" if offload != "none" and not sync else "-"
        rows.append((offload, schedule, f"{seconds[mode]:.4f}", f"{seconds[mode] / seconds['none']:.2f}", versus))
    title = (f"step_overlap: stage 3, bf16, {args.layers} x Linear({args.hidden}) ({numel / 1e6:.1f}M parameters), "
             f"accumulation {args.accumulation}, 1 process, {args.threads} thread(s)")  # fmt: skip
    text = report.table(["mode", "schedule", "s/step", "x no offload", "overlapped / synchronous"], rows, "llrrr")
    print(report.header(facts, title) + "\n\n" + text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"args": vars(args) | {"json": str(args.json)}, "medians": medians, "table": text})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
