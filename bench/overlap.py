"""Communication and its overlap: what gloo does for each collective, stage 2's step under DeepSpeed's bucket
defaults and ours, and the offloaded host step across the step boundary (bench/README.md, "overlap.py").
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

from harness import cli, launch, models, report
from harness.readings import proc_status, reset_peak_rss, ring_factor, wire_bytes


# ------------------------------------------------------------------------------------------- gloo_collectives
def _collectives(numel: int) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (ring-convention kind, the call), each on preallocated buffers as the engine calls it."""
    import torch
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    full, shard_numel = torch.ones(numel), numel // world_size
    shard = full[rank * shard_numel : (rank + 1) * shard_numel]
    slices = [(r, full[r * shard_numel : (r + 1) * shard_numel]) for r in range(world_size)]
    return {
        "all_reduce (in place)": ("all_reduce", lambda: dist.all_reduce(full)),
        "reduce_scatter_single (output = own slice)": ("reduce_scatter", lambda: dist.reduce_scatter_single(shard,
                                                                                                             full)),
        "all_gather_single (input = own slice)": ("all_gather", lambda: dist.all_gather_single(full, shard)),
        "broadcast of each rank's slice (W calls)": ("broadcast", lambda: [dist.broadcast(s, r) for r, s in slices]),
    }  # fmt: skip


def measure_collectives(numel: int, repeats: int) -> list[dict[str, float | str]]:
    """Rank function: every collective once to warm up, then `repeats` times; this rank's medians of the wall time,
    the bytes written to the sockets (wchar) and the peak RSS above the RSS before the call."""
    import torch.distributed as dist

    rows = []
    for name, (kind, call) in _collectives(numel).items():
        call()
        times, wires, peaks = [], [], []
        for _ in range(repeats):
            dist.barrier()
            rss = proc_status()["VmRSS"]
            reset_peak_rss()
            wire, start = wire_bytes(), time.perf_counter()
            call()
            times.append(1000 * (time.perf_counter() - start))
            wires.append((wire_bytes() - wire) / 1e6)
            peaks.append((proc_status()["VmHWM"] - rss) / 1e6)
        medians = {"ms": times, "wire_mb": wires, "peak_mb": peaks}
        rows.append({"name": name, "kind": kind, **{k: statistics.median(v) for k, v in medians.items()}})
    return rows


def gloo_collectives(world_size: int = 4, numel: int = 16_793_600, repeats: int = 7) -> cli.Answer:
    """What gloo really does for each collective the ZeRO engines use: wire bytes, time and transient memory.

    Args:
        world_size: ranks.
        numel: fp32 elements of the buffer (default: engine_bench.py's whole gradient).
        repeats: timed calls per collective (rank 0's median).
    """
    rows = launch.on_ranks(world_size, measure_collectives, {"numel": numel, "repeats": repeats}).results[0]
    buffer_mb, table = numel * 4 / 1e6, []
    for row in rows:
        convention = buffer_mb * ring_factor(row["kind"], world_size)
        table.append((row["name"], f"{row['ms']:.0f}", f"{row['wire_mb']:.1f}", f"{convention:.1f}",
                      f"{row['wire_mb'] / convention:.2f}", f"{row['peak_mb']:.1f}"))  # fmt: skip
    columns = ["collective", "ms", "wire MB", "ring convention MB", "wire / convention", "peak RSS above before (MB)"]
    title = f"gloo, W = {world_size}, buffer {buffer_mb:.1f} MB (rank 0, median of {repeats})"
    return cli.Answer(title, report.table(columns, table), rows)


# ------------------------------------------------------------------------------------------- stage2_overlap
BUCKET_CONFIGS = {
    "deepspeed_defaults (5e8, overlap off)": {"reduce_bucket_size": 500_000_000, "overlap_comm": False},
    "accelerate_zero_defaults (5e7, overlap on)": {},
    "1e7, overlap on": {"reduce_bucket_size": 10_000_000, "overlap_comm": True},
}


def time_bucket_configs(layers: int, width: int, batch: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Rank function: stage 2 under every bucket config twice (forward then reversed order); the timed steps'
    seconds per config."""
    import torch
    from torch import nn

    import accelerate_zero

    times: dict[str, list[float]] = {name: [] for name in BUCKET_CONFIGS}
    for _, name in launch.interleaved(list(BUCKET_CONFIGS), 2):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
        config = {"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 2, **BUCKET_CONFIGS[name]}}
        engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        for step in range(warmup + steps):
            start = time.perf_counter()
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            times[name] += [time.perf_counter() - start] if step >= warmup else []
        engine.destroy()
    return times


def stage2_overlap(
    layers: int = 24, width: int = 2048, batch: int = 16, world_size: int = 2, steps: int = 10, warmup: int = 3
) -> cli.Answer:
    """Stage 2's step time under DeepSpeed's bucket defaults (5e8, no overlap), ours (5e7, overlap) and 1e7.

    Args:
        layers: Linear + GELU layers.
        width: their width.
        batch: micro-batch per rank.
        world_size: ranks.
        steps: timed steps per config and round (rank 0's median).
        warmup: untimed steps first.
    """
    kwargs = dict(layers=layers, width=width, batch=batch, steps=steps, warmup=warmup)
    times = launch.on_ranks(world_size, time_bucket_configs, kwargs).results[0]
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians[next(iter(BUCKET_CONFIGS))]
    rows = [(name, f"{seconds:.3f}", f"{seconds / base:.2f}") for name, seconds in medians.items()]
    title = f"stage 2, {world_size} ranks, {layers * (width + 1) * width / 1e6:.1f}M parameters, median step (rank 0)"
    return cli.Answer(title, report.table(["config", "s", "x DeepSpeed's defaults"], rows), times)


# ------------------------------------------------------------------------------------------- step_overlap
OFFLOAD_MODES = ["none", "cpu/sync", "cpu", "cpu+param/sync", "cpu+param"]


def time_offload_mode(mode: str, hidden: int, layers: int, accumulation: int, steps: int) -> list[float]:
    """One process: stage 3 in bf16 under `mode`, each step timed from its first forward to the next step's."""
    import torch
    from torch import nn

    import accelerate_zero
    from accelerate_zero.engine.step_in_flight import OVERLAP_ENV

    os.environ[OVERLAP_ENV] = "0" if mode.endswith("/sync") else "1"
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **models.offload_zero(mode.partition("/")[0])}
    config = {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 8,
              "gradient_accumulation_steps": accumulation, "zero_optimization": zero}  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.Tanh())])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = accelerate_zero.initialize(model, optimizer, config=config, device="cpu", unit_classes=[nn.Linear])
    x, y, starts = torch.randn(8, hidden, dtype=torch.bfloat16), torch.randn(8, hidden), []
    for _ in range(2 + steps + 1):
        starts.append(time.perf_counter())
        for _ in range(accumulation):
            engine.backward(nn.functional.mse_loss(engine(x).float(), y))
            engine.step()
    engine.destroy()
    return [b - a for a, b in zip(starts[2:], starts[3:], strict=False)]


def step_overlap(
    hidden: int = 1024, layers: int = 8, accumulation: int = 1, steps: int = 12, threads: int = 1
) -> cli.Answer:
    """The offloaded host step synchronous (`ACCELERATE_ZERO_OVERLAP_STEP=0`) against overlapped across the step
    boundary, on a CPU device; every mode twice in turn, the median of `steps` steps after 2 warm-up steps.

    Args:
        hidden: Linear width (a stack of Linear + Tanh, each Linear a unit).
        layers: Linear layers.
        accumulation: micro-steps per step.
        steps: timed steps per mode and round.
        threads: torch threads of the process.
    """
    import torch

    launch.single_process_env()
    torch.set_num_threads(threads)
    medians: dict[str, list[float]] = {mode: [] for mode in OFFLOAD_MODES}
    for _ in range(2):
        for mode in OFFLOAD_MODES:
            medians[mode].append(statistics.median(time_offload_mode(mode, hidden, layers, accumulation, steps)))
    seconds, rows = {mode: statistics.median(values) for mode, values in medians.items()}, []
    for mode in OFFLOAD_MODES:
        offload, _, sync = mode.partition("/")
        schedule = "-" if offload == "none" else ("synchronous" if sync else "overlapped")
        versus = f"{seconds[mode] / seconds[offload + '/sync']:.2f}" if offload != "none" and not sync else "-"
        rows.append((offload, schedule, f"{seconds[mode]:.4f}", f"{seconds[mode] / seconds['none']:.2f}", versus))
    title = (f"step_overlap: stage 3, bf16, {layers} x Linear({hidden}), accumulation {accumulation}, 1 process, "
             f"{threads} thread(s)")  # fmt: skip
    columns = ["mode", "schedule", "s/step", "x no offload", "overlapped / synchronous"]
    return cli.Answer(title, report.table(columns, rows, "llrrr"), medians)


if __name__ == "__main__":
    sys.exit(cli.main(gloo_collectives, stage2_overlap, step_overlap))
