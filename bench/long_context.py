"""Long context on CPU ranks: the longest sequence that trains within a memory budget per rank, and the memory per
token, with Ulysses sequence parallelism (sp 1, 2, 4) and with tiling, at ZeRO-3 (issue 34; bench/README.md,
"long_context.py").

Usage:
    .venv/bin/python bench/long_context.py                      # budget 1200 MB per rank, ~10 min on 2 cores
    .venv/bin/python bench/long_context.py --budget_mb 300 --json bench/out/long_context.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import launch, report


VOCAB, HIDDEN, LAYERS, TILE = 32000, 256, 4, 256


def sequence_parallel_llama(tiled: bool) -> tuple[Any, Any, Any]:
    """The Llama at ZeRO-3 (every tensor partitioned) over this group as one sequence-parallel group, Ulysses
    attention, MLPs tiled by `TILE` positions when `tiled`: (engine, model, the sequence group)."""
    import torch
    import torch.distributed as dist
    from harness import models

    import accelerate_zero
    from accelerate_zero.sequence import register_ulysses_attention, tile_mlp

    model = models.llama(models.llama_config(HIDDEN, LAYERS, vocab=VOCAB, heads=8, kv_heads=4, seq=1 << 17))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    config = {"sequence_parallel_size": dist.get_world_size(), "zero_optimization": zero}
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
    group = engine.layout.sequence if dist.get_world_size() > 1 else engine.dp
    if dist.get_world_size() > 1:
        model.set_attn_implementation(register_ulysses_attention(group))
    if tiled:
        tile_mlp(model, TILE)
    model.train()
    return engine, model, group


def peak_of_step(step: Callable[[], None]) -> tuple[float, float]:
    """The step's resident peak above the memory before it (VmHWM after `clear_refs`) and its seconds, max over
    ranks; what the step before freed goes back to the system first, or this step would reuse it unseen."""
    import ctypes
    import time

    import torch
    import torch.distributed as dist
    from harness.readings import proc_status, reset_peak_rss

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    before = proc_status()["VmRSS"]
    reset_peak_rss()
    start = time.perf_counter()
    step()
    reading = torch.tensor([float(proc_status()["VmHWM"] - before), time.perf_counter() - start])
    dist.all_reduce(reading, op=dist.ReduceOp.MAX)
    return reading[0].item(), reading[1].item()


def climb(step_at: Callable[[int], None], budget_mb: float, max_tokens: int, label: str) -> dict[str, list[float]]:
    """After a warm-up step of 128 tokens (it makes the optimizer's states), lengths 512, 1024, ... until a step's
    peak exceeds the budget: {length: [peak bytes, seconds]} of those that fit."""
    import torch.distributed as dist

    step_at(128)
    fits, length = {}, 512
    while length <= max_tokens:
        peak, seconds = peak_of_step(lambda: step_at(length))  # noqa: B023 (called at once)
        if dist.get_rank() == 0:
            print(f"{label} L={length}: peak {peak / 1e6:.0f} MB, {seconds:.1f} s", flush=True)
        if peak > budget_mb * 1e6:
            break
        fits[str(length)] = [peak, seconds]
        length *= 2
    return fits


def _sft_step(engine: Any, model: Any, group: Any, tiled: bool) -> Callable[[int], None]:
    """One training step on one sequence of `length` tokens, cut in the group's slices."""
    import torch

    from accelerate_zero.sequence import sequence_parallel_loss, shard_sequence

    def step_at(length: int) -> None:
        tokens = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        shard = shard_sequence(tokens, tokens, group)
        engine.backward(sequence_parallel_loss(model, shard, group, tile_tokens=TILE if tiled else None))
        engine.step()

    return step_at


def longest(budget_mb: float, max_tokens: int) -> dict[str, dict[str, list[float]]]:
    """Rank function: untiled, then tiled, one sequence cut in sp slices per step (forward, backward, AdamW)."""
    results = {}
    for tiled in (False, True):
        engine, model, group = sequence_parallel_llama(tiled)
        step_at = _sft_step(engine, model, group, tiled)
        results["tiled" if tiled else "untiled"] = climb(step_at, budget_mb, max_tokens, f"tiled={tiled}")
        engine.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--budget_mb", type=float, default=1200)
    parser.add_argument("--max_tokens", type=int, default=32768)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    facts, rows = report.machine_facts(), []
    for sp in args.sp:
        kwargs = {"budget_mb": args.budget_mb, "max_tokens": args.max_tokens}
        for mode, fits in launch.on_ranks(sp, longest, kwargs, name=f"sp{sp}").results[0].items():
            lengths = sorted(int(k) for k in fits)
            # the cost of one more token: the slope between the two longest lengths that fit
            slope = (
                (fits[str(lengths[-1])][0] - fits[str(lengths[-2])][0]) / (lengths[-1] - lengths[-2])
                if len(lengths) > 1
                else None
            )
            peak = fits[str(lengths[-1])][0] if lengths else None
            rows.append(
                {
                    "sp": sp,
                    "mode": mode,
                    "longest": lengths[-1] if lengths else 0,
                    "peak": peak,
                    "bytes_per_token": slope,
                }
            )
    print(report.header(facts, f"long_context: the longest sequence within {args.budget_mb:.0f} MB per rank"))
    columns = [
        "sp",
        "mode",
        f"longest sequence within {args.budget_mb:.0f} MB per rank",
        "its peak MB",
        "bytes per token (slope)",
    ]
    print(report.table(columns, [
        (r["sp"], r["mode"], r["longest"], f"{r['peak'] / 1e6:.0f}" if r["peak"] else "-",
         f"{r['bytes_per_token']:.0f}" if r["bytes_per_token"] else "-") for r in rows
    ], "rlrrr"))  # fmt: skip
    if args.json:
        report.save_json(args.json, {"rows": rows}, facts)


if __name__ == "__main__":
    main()
