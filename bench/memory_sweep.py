"""Memory per rank of stages 0-3 against world size, measured and estimated, and whether the estimate is honest
(bench/README.md, "memory_sweep.py").
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

from harness import cli, launch, models, report
from harness.summary import MB, memory_formula_bytes


MODEL_STATES = ("parameters", "gradients", "master_weights", "optimizer_states")
TOLERANCE = 0.10
"""The estimate of model-state bytes per rank must be within 10% of `memory_breakdown()` (issue 8)."""
LLAMA_LAYERS = 2
"""The Llama: 2 decoder layers of offload_bench.py's ladder (27.8M parameters)."""


def _reading(stage: int, make: Callable[[], tuple[Any, Callable]]) -> dict[str, Any]:
    """What this rank holds at the end of a backward after one optimizer step at `stage` (the whole model state:
    gradients live from the first backward to the step), beside the estimate for the same model and rank."""
    import torch
    import torch.distributed as dist
    from harness.readings import live_tensor_bytes, proc_status

    import accelerate_zero
    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.debug.estimate import TrainingSetup, estimate_stage, shapes_from_module

    gc.collect()
    dist.barrier()
    live_before, status_before = live_tensor_bytes(), proc_status()
    model, loss_of = make()
    config = models.engine_config(stage)
    zero = ZeroConfig.from_any(config).zero_optimization
    setup = TrainingSetup(dist.get_world_size(), "no", "adamw", zero=zero)
    estimated = estimate_stage(shapes_from_module(model, zero), setup, stage, rank=dist.get_rank()).device
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=models.LR), config=config)
    engine.backward(loss_of(engine))
    engine.step()
    engine.backward(loss_of(engine))  # read before its step: the gradients are freed after it
    gc.collect()
    dist.barrier()
    reading = {"measured": engine.memory_breakdown(), "estimated": dict(estimated),
               "live": live_tensor_bytes() - live_before, "rss": proc_status()["VmRSS"] - status_before["VmRSS"],
               "params": sum(p.numel() for p in model.parameters())}  # fmt: skip
    engine.step()
    engine.destroy()
    return reading


def sweep(llama: bool) -> dict[str, dict[str, dict[str, Any]]]:
    """Rank function: stages 0-3 on the Linear stack (and the ladder's Llama), after a throwaway run on a tiny
    stack (the first engine in a process also maps code pages and allocator arenas)."""
    import torch.distributed as dist
    from offload_bench import LADDER_LLAMA, ladder_llama
    from torch import nn

    rank = dist.get_rank()

    def stack(hidden: int = models.HIDDEN, layers: int = models.LAYERS) -> tuple[Any, Callable]:
        model = models.build_model(hidden, layers)
        x, y = models.make_batch(rank, hidden)
        return model, lambda engine: nn.functional.mse_loss(engine(x), y)

    def llama_model() -> tuple[Any, Callable]:
        tokens = models.tokens(2, 64, LADDER_LLAMA["vocab"], seed=rank)
        return models.llama(ladder_llama(LLAMA_LAYERS)), lambda engine: engine(input_ids=tokens, labels=tokens).loss

    _reading(0, lambda: stack(64, 2))
    out = {"linear": {str(stage): _reading(stage, stack) for stage in range(4)}}
    if llama:
        out["llama"] = {str(stage): _reading(stage, llama_model) for stage in range(4)}
    return out


def rows(by_world: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (model, stage, W): the rank whose estimate is farthest from what it held, and the largest
    readings over the ranks."""
    out = []
    for world_size, ranks in sorted(by_world.items()):
        for model in ranks[0]:
            for stage in ranks[0][model]:
                point = [rank[model][stage] for rank in ranks]
                states = [[sum(r[kind][k] for k in MODEL_STATES) for r in point] for kind in ("estimated", "measured")]
                ratios = [e / m for e, m in zip(*states, strict=True)]
                worst = max(range(len(point)), key=lambda i: abs(ratios[i] - 1))  # noqa: B023
                formula = memory_formula_bytes(f"az{stage}", point[0]["params"], world_size)
                out.append({"model": model, "stage": int(stage), "W": world_size, "formula": formula,
                            "estimated": states[0][worst], "measured": states[1][worst], "ratio": ratios[worst],
                            "worst_rank": worst, "measured_total": max(r["measured"]["total"] for r in point),
                            "estimated_total": max(r["estimated"]["total"] for r in point),
                            "live": max(r["live"] for r in point), "rss": max(r["rss"] for r in point)})  # fmt: skip
    return out


def tables(found: list[dict[str, Any]]) -> tuple[str, bool]:
    """The sweep's table (the Linear stack) and the honesty table (every model); True when every rank's estimate
    is within `TOLERANCE`."""
    mb = lambda value, digits=1: report.fmt(value / MB, digits)  # noqa: E731
    linear = [(r["stage"], r["W"], *(mb(r[k]) for k in ("formula", "estimated", "measured", "measured_total",
                                                          "estimated_total", "live", "rss"))) for r in found
              if r["model"] == "linear"]  # fmt: skip
    columns = ["stage", "W", "ZeRO formula (MB)", "estimated model states (MB)",
               "memory_breakdown() model states (MB)", "memory_breakdown() total (MB)", "estimated total (MB)",
               "live tensors (MB)", "RSS (MB)"]  # fmt: skip
    honest = [abs(r["ratio"] - 1) <= TOLERANCE for r in found]
    verdicts = [(r["model"], r["stage"], r["W"], mb(r["estimated"], 3), mb(r["measured"], 3),
                 f"{r['ratio']:.4f} (rank {r['worst_rank']})", "PASS" if ok else "FAIL")
                for r, ok in zip(found, honest, strict=True)]  # fmt: skip
    verdict_columns = ["model", "stage", "W", "estimated model states per rank (MB)", "memory_breakdown() model "
                       "states (MB)", "estimate / measured (worst rank)", "within 10%"]  # fmt: skip
    ok = bool(found) and all(honest)
    text = (f"{report.table(columns, linear, 'r' * 9)}\n\n**{'PASS: every' if ok else 'FAIL: not every'} estimate "
            f"is within {TOLERANCE:.0%} of what the engine holds.**\n\n"
            f"{report.table(verdict_columns, verdicts, 'lrrrrrl')}")  # fmt: skip
    return text, ok


def memory_sweep(world_sizes: tuple[int, ...] = (1, 2, 3, 4), llama_world_size: int = 2) -> cli.Answer:
    """Stages 0-3 at each world size: memory_breakdown(), live tensors and RSS against the estimate.

    Args:
        world_sizes: the world sizes of the Linear stack (harness/models.py's size variables set its size).
        llama_world_size: the world size that also measures the Llama (0: none).
    """
    by_world = {}
    for world_size in world_sizes:
        kwargs = {"llama": world_size == llama_world_size}
        by_world[world_size] = launch.on_ranks(world_size, sweep, kwargs, name=f"sweep_w{world_size}").results
    found = rows(by_world)
    text, ok = tables(found)
    title = (f"memory_sweep: {models.LAYERS} x Linear({models.HIDDEN}) at W = {', '.join(map(str, world_sizes))}; "
             f"a {LLAMA_LAYERS}-layer Llama at W = {llama_world_size}")  # fmt: skip
    return cli.Answer(title, text, found, ok)


if __name__ == "__main__":
    sys.exit(cli.main(memory_sweep))
