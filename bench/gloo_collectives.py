"""What gloo really does for each collective the ZeRO engines use: wire bytes, time and transient memory per call.

Usage:
    .venv/bin/python bench/gloo_collectives.py --world_size 4 --numel 16793600

Each collective runs on a buffer of `--numel` fp32 elements (the full model's gradient for engine_bench.py's
model), as the engine calls it, on `--world_size` fresh ranks (harness/launch.py); the table gives rank 0's
median over `--repeats` calls of the wall time, the bytes written to the sockets (wchar: [Note: how the benchmark
measures] in harness/readings.py) and the peak RSS above the RSS before the call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from harness import launch, report
from harness.readings import proc_status, reset_peak_rss, ring_factor, wire_bytes


def collectives(numel: int) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (ring-convention kind, the call), each on preallocated buffers."""
    import torch
    import torch.distributed as dist

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


def measure(numel: int, repeats: int) -> list[dict[str, float | str]]:
    """Rank function: every collective once to warm up, then `repeats` times; the medians of this rank."""
    import torch.distributed as dist

    rows = []
    for name, (kind, call) in collectives(numel).items():
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=4)
    parser.add_argument("--numel", type=int, default=16_793_600)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    facts = report.machine_facts()
    rows = launch.on_ranks(args.world_size, measure, {"numel": args.numel, "repeats": args.repeats}).results[0]
    buffer_mb = args.numel * 4 / 1e6
    table = []
    for row in rows:
        convention = buffer_mb * ring_factor(row["kind"], args.world_size)
        wire = row["wire_mb"]
        table.append((row["name"], f"{row['ms']:.0f}", f"{wire:.1f}", f"{convention:.1f}", f"{wire / convention:.2f}",
                      f"{row['peak_mb']:.1f}"))  # fmt: skip
    print(
        report.header(
            facts, f"gloo, W = {args.world_size}, buffer {buffer_mb:.1f} MB (rank 0, median of {args.repeats})"
        )
    )
    columns = ["collective", "ms", "wire MB", "ring convention MB", "wire / convention", "peak RSS above before (MB)"]
    print("\n" + report.table(columns, table))


if __name__ == "__main__":
    main()
