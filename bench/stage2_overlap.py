"""Stage-2 step time under the bucket size and overlap defaults (issue 20 item 8): DeepSpeed's vs ours.

Usage:
    .venv/bin/python bench/stage2_overlap.py                  # 24 x Linear(2048) (101M params), 2 ranks, ~4 minutes
    .venv/bin/python bench/stage2_overlap.py --layers 16 --width 1024 --world_size 2

One group of fresh ranks (harness/launch.py: gloo, one thread per rank) trains the same stack of Linear+GELU layers
with AdamW at stage 2 under each config in turn, twice in alternating order, and prints the median wall time of an
optimizer step per config (rank 0, after warm-up steps). Configs: DeepSpeed's defaults (reduce_bucket_size 5e8,
overlap_comm false), ours (5e7, true), and 1e7 with overlap. Compare ratios within one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import launch, report


CONFIGS = {
    "deepspeed_defaults (5e8, overlap off)": {"reduce_bucket_size": 500_000_000, "overlap_comm": False},
    "accelerate_zero_defaults (5e7, overlap on)": {},
    "1e7, overlap on": {"reduce_bucket_size": 10_000_000, "overlap_comm": True},
}


def time_configs(layers: int, width: int, batch: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Rank function: every config twice (forward then reversed order); the timed steps' seconds per config."""
    import torch
    from torch import nn

    import accelerate_zero

    names = list(CONFIGS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _, name in launch.interleaved(names, 2):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2, **CONFIGS[name]},
        }
        engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        for step in range(warmup + steps):
            start = time.perf_counter()
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
        engine.destroy()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16, help="micro-batch per rank")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per config and round")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    facts = report.machine_facts()
    kwargs = {k: v for k, v in vars(args).items() if k != "world_size"}
    times = launch.on_ranks(args.world_size, time_configs, kwargs).results[0]
    medians = {name: statistics.median(values) for name, values in times.items()}
    params = args.layers * (args.width * args.width + args.width)
    title = f"stage 2, {args.world_size} ranks, {params / 1e6:.1f}M parameters, median step time (rank 0)"
    base = medians[next(iter(CONFIGS))]
    rows = [(name, f"{seconds:.3f}", f"{seconds / base:.2f}") for name, seconds in medians.items()]
    print(report.header(facts, title) + "\n\n" + report.table(["config", "s", "x DeepSpeed's defaults"], rows))


if __name__ == "__main__":
    main()
