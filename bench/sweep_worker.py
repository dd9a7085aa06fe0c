"""Memory per rank of accelerate_zero stages 0-3 at one world size; started by run_report.py under torchrun.

Usage (what run_report.py runs, once per world size 1..4):
    torchrun --standalone --nproc_per_node 2 bench/sweep_worker.py --stages 0 1 2 3 --steps 1 --out sweep_w2.json

In one process group, for each stage in turn: build the benchmark model (bench_common.build_model, its size from
AZ_BENCH_HIDDEN / AZ_BENCH_LAYERS), wrap it with `accelerate_zero.initialize` and the config bench_worker.py uses,
take `--steps` optimizer steps (so that Adam's states exist), then read `engine.memory_breakdown()`, the bytes of
every live tensor (bench_common.live_tensor_bytes, each storage once) and RSS, all minus the same readings taken
before the model was built; then destroy the engine and free everything before the next stage. A run on a tiny model comes first, so
that one-time costs (code pages, allocator arenas) do not land in the first stage's RSS. Nothing is timed.
"""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

import torch
import torch.distributed as dist
from bench_common import HIDDEN, LAYERS, LR, build_model, live_tensor_bytes, make_batch, proc_status
from bench_worker import engine_config
from torch import nn


def measure_stage(stage: int, steps: int, hidden: int = HIDDEN, layers: int = LAYERS) -> dict[str, Any]:
    """One stage: what this rank holds after `steps` steps, above what it held before the model existed."""
    import accelerate_zero

    gc.collect()
    dist.barrier()
    live_before, status_before = live_tensor_bytes(), proc_status()
    model = build_model(hidden, layers)
    x, y = make_batch(dist.get_rank(), hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = accelerate_zero.initialize(model, optimizer, config=engine_config(stage, None))
    for _ in range(steps):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    del loss
    gc.collect()
    dist.barrier()
    status = proc_status()
    reading = {
        "memory_breakdown": engine.memory_breakdown(),
        "live_tensor_bytes": live_tensor_bytes() - live_before,
        "rss_bytes": status["VmRSS"] - status_before["VmRSS"],
        "anon_rss_bytes": status["RssAnon"] - status_before["RssAnon"],
    }
    engine.destroy()
    del engine, optimizer, model, x, y
    gc.collect()
    # What the stage left behind (should be ~0): a leak would inflate the next stage's baseline silently.
    reading["live_tensor_bytes_left"] = live_tensor_bytes() - live_before
    return reading


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps before reading (default 1)")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes every rank's readings to")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    params = sum(p.numel() for p in build_model().parameters())
    # A throwaway run on a small model first: the first engine in a process also maps code pages and allocator
    # arenas, which would otherwise count in the first stage's RSS.
    measure_stage(args.stages[0], 1, hidden=64, layers=2)
    record = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "params": params,
        "stages": {str(stage): measure_stage(stage, args.steps) for stage in args.stages},
    }
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        with open(args.out, "w") as out:
            json.dump(records, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
