"""Long sequences on CPU ranks at ZeRO-3: the longest SFT sequence and the longest GRPO completion that train within a
memory budget per rank, with Ulysses sequence parallelism (sp 1, 2, 4) and with tiling (bench/README.md,
"long_sequences.py").
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from harness import cli, launch, models, report


VOCAB, HIDDEN, LAYERS, TILE = 32000, 256, 4, 256
PROMPT, PADS = 32, 8
"""A GRPO prompt: 32 tokens, the first 8 of them left padding."""


def sequence_parallel_llama(tiled: bool) -> tuple[Any, Any, Any]:
    """The Llama at ZeRO-3 (every tensor partitioned) over this group as one sequence-parallel group, Ulysses
    attention, MLPs tiled by `TILE` positions when `tiled`: (engine, model, the sequence group)."""
    import torch
    import torch.distributed as dist

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


def sft_step(engine: Any, model: Any, group: Any, tiled: bool) -> Callable[[int], None]:
    """One training step on one sequence of `length` tokens, cut in the group's slices."""
    import torch

    from accelerate_zero.sequence import sequence_parallel_loss, shard_sequence

    def step_at(length: int) -> None:
        tokens = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        shard = shard_sequence(tokens, tokens, group)
        engine.backward(sequence_parallel_loss(model, shard, group, tile_tokens=TILE if tiled else None))
        engine.step()

    return step_at


def grpo_step(engine: Any, model: Any, group: Any, tiled: bool) -> Callable[[int], None]:
    """One GRPO step on this rank's prompt and a completion of `length` tokens, scored as `ZeroGRPOTrainer` does
    under sp ([Note: per-token values under sequence parallelism] in accelerate_zero/sequence/token_logps.py), then
    the clipped objective at ratio 1; tiled: the config's `sequence_tiling` (LM head, softmax and MLPs by `TILE`)."""
    import torch
    import torch.distributed as dist

    from accelerate_zero.engine.collectives import CommStats
    from accelerate_zero.sequence.tiled_values import tiled_token_values
    from accelerate_zero.sequence.token_logps import sequence_parallel_token_values

    def score(batch: dict) -> dict:
        labels = batch.pop("shift_labels")
        if tiled:
            return tiled_token_values(model, batch.pop("input_ids"), labels, TILE, **batch)
        logits = model(**batch).logits.float()
        logps = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return {"log_probs": logps.masked_fill(labels == -100, 0)}

    def step_at(length: int) -> None:
        generator = torch.Generator().manual_seed(length * 7 + dist.get_rank())
        ids = torch.randint(1, VOCAB, (1, PROMPT + length), generator=generator)
        mask = torch.ones_like(ids)
        mask[:, :PADS] = 0  # a left-padded prompt
        scored = torch.zeros_like(mask, dtype=torch.bool)
        scored[:, PROMPT:] = True
        values = sequence_parallel_token_values(score, ids.masked_fill(mask == 0, 0), mask, scored, group, CommStats())
        logps = values["log_probs"]
        per_token = -torch.exp(logps - logps.detach()) * 0.5
        engine.backward((per_token * scored).sum() / scored.sum())
        engine.step()

    return step_at


def longest(kind: str, budget_mb: float, max_tokens: int) -> dict[str, dict[str, list[float]]]:
    """Rank function: untiled, then tiled; after a warm-up step of 128 tokens (it makes the optimizer's states),
    lengths 512, 1024, ... until a step's peak exceeds the budget: {length: [peak bytes, seconds]} of those that
    fit."""
    import torch.distributed as dist

    results = {}
    for tiled in (False, True):
        engine, model, group = sequence_parallel_llama(tiled)
        step_at = (sft_step if kind == "sft" else grpo_step)(engine, model, group, tiled)
        step_at(128)
        fits, length = {}, 512
        while length <= max_tokens:
            peak, seconds = peak_of_step(lambda: step_at(length))  # noqa: B023 (called at once)
            if dist.get_rank() == 0:
                print(f"tiled={tiled} L={length}: peak {peak / 1e6:.0f} MB, {seconds:.1f} s", flush=True)
            if peak > budget_mb * 1e6:
                break
            fits[str(length)] = [peak, seconds]
            length *= 2
        results["tiled" if tiled else "untiled"] = fits
        engine.destroy()
    return results


def long_context(sp: tuple[int, ...] = (1, 2, 4), budget_mb: float = 1200, max_tokens: int = 32768) -> cli.Answer:
    """The longest SFT sequence within the budget per rank, and its memory per token (the slope between the two
    longest lengths that fit).

    Args:
        sp: sequence-parallel sizes (= ranks).
        budget_mb: resident peak allowed per rank.
        max_tokens: the longest length tried.
    """
    rows = []
    for size in sp:
        kwargs = {"kind": "sft", "budget_mb": budget_mb, "max_tokens": max_tokens}
        for mode, fits in launch.on_ranks(size, longest, kwargs, name=f"sft_sp{size}").results[0].items():
            lengths = sorted(int(k) for k in fits)
            ends = [fits[str(n)][0] for n in lengths[-2:]]
            slope = (ends[1] - ends[0]) / (lengths[-1] - lengths[-2]) if len(lengths) > 1 else None
            rows.append({"sp": size, "mode": mode, "longest": lengths[-1] if lengths else 0,
                         "peak": ends[-1] if lengths else None, "bytes_per_token": slope})  # fmt: skip
    columns = ["sp", "mode", f"longest sequence within {budget_mb:.0f} MB per rank", "its peak MB",
               "bytes per token (slope)"]  # fmt: skip
    table = report.table(columns, [
        (r["sp"], r["mode"], r["longest"], f"{r['peak'] / 1e6:.0f}" if r["peak"] else "-",
         f"{r['bytes_per_token']:.0f}" if r["bytes_per_token"] else "-") for r in rows], "rlrrr")  # fmt: skip
    return cli.Answer(f"long_context: the longest sequence within {budget_mb:.0f} MB per rank", table, rows)


def long_completions(sp: tuple[int, ...] = (1, 2, 4), budget_mb: float = 1200, max_tokens: int = 16384) -> cli.Answer:
    """The longest GRPO completion within the budget per rank, and the step time against the first sp at the
    longest length every sp fits.

    Args:
        sp: sequence-parallel sizes (= ranks).
        budget_mb: resident peak allowed per rank.
        max_tokens: the longest completion tried.
    """
    kwargs = {"kind": "grpo", "budget_mb": budget_mb, "max_tokens": max_tokens}
    runs = {size: launch.on_ranks(size, longest, kwargs, name=f"grpo_sp{size}").results[0] for size in sp}
    rows = []
    for mode in ("untiled", "tiled"):
        common = min(max((int(k) for k in runs[size][mode]), default=0) for size in runs)  # every sp fits it
        base = runs[sp[0]][mode].get(str(common), [None, None])[1]
        for size in sp:
            fits = runs[size][mode]
            longest_fit = max((int(k) for k in fits), default=0)
            seconds = fits.get(str(common), [None, None])[1]
            rows.append({"sp": size, "mode": mode, "longest": longest_fit, "common": common, "seconds": seconds,
                         "peak": fits[str(longest_fit)][0] if longest_fit else None,
                         "vs_sp1": seconds / base if seconds and base else None})  # fmt: skip
    columns = ["sp", "mode", f"longest completion within {budget_mb:.0f} MB per rank", "its peak MB", "step s at L",
               "vs the first sp"]  # fmt: skip
    table = report.table(columns, [
        (r["sp"], r["mode"], r["longest"], f"{r['peak'] / 1e6:.0f}" if r["peak"] else "-",
         f"{r['seconds']:.1f} (L={r['common']})" if r["seconds"] else "-",
         f"{r['vs_sp1']:.2f}x" if r["vs_sp1"] else "-")
        for r in rows], "rlrrrr")  # fmt: skip
    return cli.Answer(f"long_completions: the longest GRPO completion within {budget_mb:.0f} MB per rank", table, rows)


if __name__ == "__main__":
    sys.exit(cli.main(long_context, long_completions))
