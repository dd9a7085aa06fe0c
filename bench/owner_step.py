"""Whole-tensor ("owner") stepping against flat AdamW: bytes moved per step, step time and what each rank holds.

Usage:
    .venv/bin/python bench/owner_step.py                                  # 2 and 3 ranks, hidden 512 x 8 layers
    .venv/bin/python bench/owner_step.py --world_sizes 2 4 --hidden 1024 --layers 8 --steps 8

W gloo ranks on this machine train bench_common's stack of `--layers` x Linear(--hidden, --hidden) in bf16 at stages
2 and 3 (every Linear a unit), gradient clipping 1.0, with: AdamW (flat shards), torch's Adafactor and Muon on the
matrices + AdamW on the biases (whole parameters on owners, engine/owned_step.py). Per step, from the engine's own
count (`comm_stats()`, ring volumes): the gradient bytes each rank sends (the reduce-scatter, plus the pieces sent to
owners) beside DeepSpeed 0.19.8's Muon, which needs `reduce_scatter: false` and all-reduces every fp32 gradient
(2 N (W-1)/W x 4 bytes per rank); the value bytes (the owners' pieces back, the all-gather); the median step time of
`--steps` timed steps after 2 warm-up steps (the optimizers run in turn, twice, so that other load is shared); and
`memory_breakdown()`'s master weights and optimizer states. Bytes and memory are the largest over the ranks (the
pieces of a parameter across a shard boundary are sent by the rank that does not own it).
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

OPTIMIZERS = ("adamw", "adafactor", "muon")
GRADIENT_KINDS = ("reduce_scatter", "all_reduce", "owner_gradients")
VALUE_KINDS = ("all_gather", "owner_values", "broadcast")


def _optimizer(name: str, model: object) -> object:
    import torch

    from accelerate_zero.optim.chain import OptimizerChain

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-4)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return OptimizerChain(torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-4))


def _run(rank: int, world_size: int, args: argparse.Namespace, port: int, queue: object) -> None:
    import torch
    import torch.distributed as dist

    import accelerate_zero
    from bench.bench_common import build_model, make_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    x, y = make_batch(rank, args.hidden)
    results: dict = {}
    for round_ in range(2):
        for stage in (2, 3):
            for name in OPTIMIZERS:
                model = build_model(args.hidden, args.layers)
                numel = sum(p.numel() for p in model.parameters())
                zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
                config = {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": zero}
                engine = accelerate_zero.initialize(model, _optimizer(name, model), config=config)
                times = []
                for step in range(2 + args.steps):
                    if step == 2:
                        engine.reset_comm_stats()
                    dist.barrier()
                    start = time.perf_counter()
                    engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
                    engine.step()
                    times.append(time.perf_counter() - start)
                stats = engine.comm_stats()
                held = engine.memory_breakdown()
                engine.destroy()
                slowest = [0.0] * len(times)
                for i, seconds in enumerate(times):
                    t = torch.tensor([seconds])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    slowest[i] = t.item()

                def per_step(kinds: tuple[str, ...]) -> float:
                    return sum(stats.get(kind, {}).get("bytes_per_rank", 0) for kind in kinds) / args.steps

                entry = results.setdefault(f"stage{stage} {name}", {"step_ms": [], "numel": numel})
                entry["step_ms"].append(statistics.median(slowest[2:]) * 1e3)
                entry["gradient_bytes_per_step"] = per_step(GRADIENT_KINDS)
                entry["value_bytes_per_step"] = per_step(VALUE_KINDS)
                entry["deepspeed_muon_gradient_bytes"] = 2 * numel * (world_size - 1) / world_size * 4
                entry["master_weights"] = held["master_weights"]
                entry["optimizer_states"] = held["optimizer_states"]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        for key, entry in results.items():  # bytes and memory: the rank sending or holding most
            for kind in ("master_weights", "optimizer_states", "gradient_bytes_per_step", "value_bytes_per_step"):
                entry[kind] = max(r[key][kind] for r in gathered)
            entry["step_ms"] = round(statistics.median(entry["step_ms"]), 1)
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    out = {"load_average": os.getloadavg(), "args": vars(args)}
    for world_size in args.world_sizes:
        queue = mp.get_context("spawn").SimpleQueue()
        port = 29500 + world_size * 7 + os.getpid() % 1000
        mp.spawn(_run, args=(world_size, args, port, queue), nprocs=world_size)
        out[f"W={world_size}"] = queue.get()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
