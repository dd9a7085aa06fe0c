"""Stage-2 step time under the bucket size and overlap defaults (issue 20 item 8): DeepSpeed's vs ours.

Usage:
    .venv/bin/python bench/stage2_overlap.py                  # 24 x Linear(2048) (101M params), 2 ranks, ~4 minutes
    .venv/bin/python bench/stage2_overlap.py --layers 16 --width 1024 --world_size 2

Runs one `torchrun --standalone` group (gloo, one thread per rank) that trains the same stack of Linear+GELU layers
with AdamW at stage 2 under each config in turn, twice in alternating order, and prints the median wall time of an
optimizer step per config (rank 0, after warm-up steps). Configs: DeepSpeed's defaults (reduce_bucket_size 5e8,
overlap_comm false), ours (5e7, true), and 1e7 with overlap. Compare ratios within one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


CONFIGS = {
    "deepspeed_defaults (5e8, overlap off)": {"reduce_bucket_size": 500_000_000, "overlap_comm": False},
    "accelerate_zero_defaults (5e7, overlap on)": {},
    "1e7, overlap on": {"reduce_bucket_size": 10_000_000, "overlap_comm": True},
}


def _worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import accelerate_zero

    torch.set_num_threads(1)
    names = list(CONFIGS)
    order = names + names[::-1]
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in order:
        torch.manual_seed(0)
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.layers)]
        )
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2, **CONFIGS[name]},
        }
        engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
        x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
        engine.destroy()
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({name: statistics.median(values) for name, values in times.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16, help="micro-batch per rank")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per config and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world_size}"]
    forwarded = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("worker", "world_size")]
    output = subprocess.run([*command, __file__, "--worker", *forwarded], check=True, capture_output=True, text=True)
    medians = json.loads(output.stdout.strip().splitlines()[-1])
    params = args.layers * (args.width * args.width + args.width)
    print(f"stage 2, {args.world_size} ranks, {params / 1e6:.1f}M parameters, median step time (rank 0):")
    base = medians[next(iter(CONFIGS))]
    for name, seconds in medians.items():
        print(f"  {name:<45} {seconds:7.3f} s  x{seconds / base:.2f}")


if __name__ == "__main__":
    main()
