"""What gloo really does for each collective the ZeRO engines use: wire bytes, time and transient memory per call.

Usage:
    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 \
        bench/gloo_collectives.py --numel 16793600

Each collective runs on a buffer of `--numel` fp32 elements (the full model's gradient for engine_bench.py's
model), as the engine calls it; the table gives rank 0's median over `--repeats` calls of the wall time, the
bytes written to the sockets (wchar, see bench_common.py) and the peak RSS above the RSS before the call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from bench_common import proc_status, reset_peak_rss, ring_factor, wire_bytes


def collectives(numel: int) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (ring-convention kind, the call), each on preallocated buffers."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    full, shard_numel = torch.ones(numel), numel // world_size
    shard = full[rank * shard_numel : (rank + 1) * shard_numel]
    return {
        "all_reduce (in place)": ("all_reduce", lambda: dist.all_reduce(full)),
        "reduce_scatter_single (output = own slice)": (
            "reduce_scatter",
            lambda: dist.reduce_scatter_single(shard, full),
        ),
        "all_gather_single (input = own slice)": ("all_gather", lambda: dist.all_gather_single(full, shard)),
        "broadcast of each rank's slice (W calls)": (
            "broadcast",
            lambda: [dist.broadcast(full[r * shard_numel : (r + 1) * shard_numel], r) for r in range(world_size)],
        ),
    }


def measure(call: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """Median wall ms, wire MB and peak-RSS MB over `repeats` calls."""
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
    return statistics.median(times), statistics.median(wires), statistics.median(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=16_793_600)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world_size, buffer_mb = dist.get_world_size(), args.numel * 4 / 1e6
    rows = []
    for name, (kind, call) in collectives(args.numel).items():
        call()  # warm-up
        ms, wire, peak = measure(call, args.repeats)
        convention = buffer_mb * ring_factor(kind, world_size)
        rows.append(f"| {name} | {ms:.0f} | {wire:.1f} | {convention:.1f} | {wire / convention:.2f} | {peak:.1f} |")
    if dist.get_rank() == 0:
        print(f"gloo, W = {world_size}, buffer {buffer_mb:.1f} MB (rank 0, median of {args.repeats})\n")
        print("| collective | ms | wire MB | ring convention MB | wire / convention | peak RSS above before (MB) |")
        print("|---|--:|--:|--:|--:|--:|")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
