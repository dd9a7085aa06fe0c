"""Whole-tensor ("owner") stepping against flat AdamW: bytes moved per step, step time and what each rank holds
(issue 50, item 5; bench/README.md, "owner_step.py").

Usage:
    .venv/bin/python bench/owner_step.py                                  # 2 and 3 ranks, hidden 512 x 8 layers
    .venv/bin/python bench/owner_step.py --world_sizes 2 4 --hidden 1024 --layers 8 --steps 8

W gloo ranks train the harness's stack of `--layers` x Linear(--hidden, --hidden) in bf16 at stages 2 and 3 (every
Linear a unit), clipping 1.0, with AdamW (flat shards), torch's Adafactor, and Muon on the matrices + AdamW on the
biases (whole parameters on owners, engine/owned_step.py). Per step, from the engine's own count (ring volumes): the
gradient bytes each rank sends beside DeepSpeed 0.19.8's Muon (`reduce_scatter: false`: an all-reduce of every
fp32 gradient, 2 N (W-1)/W x 4 bytes per rank), the value bytes, the median step time of `--steps` timed steps after
2 warm-up steps (the optimizers in turn, twice) and `memory_breakdown()`'s master weights and optimizer states;
bytes and memory the largest over the ranks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from harness import launch, report


OPTIMIZERS = ("adamw", "adafactor", "muon")
GRADIENT_KINDS = ("reduce_scatter", "all_reduce", "owner_gradients")
VALUE_KINDS = ("all_gather", "owner_values", "broadcast")
PER_RANK = ("master_weights", "optimizer_states", "gradient_bytes_per_step", "value_bytes_per_step")


def _optimizer(name: str, model: Any) -> Any:
    import torch

    from accelerate_zero.optim.chain import OptimizerChain

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-4)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return OptimizerChain(torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-4))


def train(hidden: int, layers: int, steps: int) -> dict[str, Any]:
    """Rank function: every optimizer at stages 2 and 3, twice in turn; this rank's bytes, memory and step times
    (each step's time the slowest rank's)."""
    import torch
    import torch.distributed as dist
    from harness import models

    import accelerate_zero

    x, y = models.make_batch(dist.get_rank(), hidden)
    results: dict[str, Any] = {}
    for _ in range(2):
        for stage in (2, 3):
            for name in OPTIMIZERS:
                model = models.build_model(hidden, layers)
                numel = sum(p.numel() for p in model.parameters())
                zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
                config = {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": zero}
                engine = accelerate_zero.initialize(model, _optimizer(name, model), config=config)
                times = []
                for step in range(2 + steps):
                    if step == 2:
                        engine.reset_comm_stats()
                    dist.barrier()
                    start = time.perf_counter()
                    engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
                    engine.step()
                    times.append(time.perf_counter() - start)
                stats, held = engine.comm_stats(), engine.memory_breakdown()
                engine.destroy()
                slowest = torch.tensor(times)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)

                def per_step(kinds: tuple[str, ...], stats: dict = stats) -> float:
                    return sum(stats.get(kind, {}).get("bytes_per_rank", 0) for kind in kinds) / steps

                entry = results.setdefault(f"stage{stage} {name}", {"step_ms": [], "numel": numel})
                entry["step_ms"].append(statistics.median(slowest[2:].tolist()) * 1e3)
                entry.update(
                    gradient_bytes_per_step=per_step(GRADIENT_KINDS), value_bytes_per_step=per_step(VALUE_KINDS)
                )
                entry["deepspeed_muon_gradient_bytes"] = (
                    2 * numel * (dist.get_world_size() - 1) / dist.get_world_size() * 4
                )
                entry.update(master_weights=held["master_weights"], optimizer_states=held["optimizer_states"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    facts, out, rows = report.machine_facts(), {}, []
    for world_size in args.world_sizes:
        kwargs = {"hidden": args.hidden, "layers": args.layers, "steps": args.steps}
        ranks = launch.on_ranks(world_size, train, kwargs, name=f"w{world_size}").results
        out[f"W={world_size}"] = merged = ranks[0]
        for key, entry in merged.items():  # bytes and memory: the rank sending or holding most
            entry.update({kind: max(r[key][kind] for r in ranks) for kind in PER_RANK})
            entry["step_ms"] = round(statistics.median(entry["step_ms"]), 1)
            stage, name = key.split()
            muon = f"{entry['deepspeed_muon_gradient_bytes'] / 1e6:.2f} MB" if name == "muon" else ""
            rows.append((world_size, stage[-1], name, f"{entry['gradient_bytes_per_step'] / 1e6:.2f} MB", muon,
                         f"{entry['value_bytes_per_step'] / 1e6:.2f} MB", f"{entry['master_weights'] / 1e6:.2f} MB",
                         f"{entry['optimizer_states'] / 1e6:.2f} MB", entry["step_ms"]))  # fmt: skip
    print(report.header(facts, f"owner_step: {args.layers} x Linear({args.hidden}), bf16, clipping 1.0"))
    columns = ["W", "stage", "optimizer", "gradient bytes / step", "DeepSpeed Muon", "value bytes / step", "masters",
               "optimizer states", "step (ms)"]  # fmt: skip
    print(report.table(columns, rows, "rrlrrrrrr"))
    if args.json:
        report.save_json(args.json, out, facts)


if __name__ == "__main__":
    main()
