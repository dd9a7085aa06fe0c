"""Long completions on CPU ranks: the longest GRPO completion that trains within a memory budget per rank, with
Ulysses sequence parallelism (sp 1, 2, 4), tiled and not, and the step time against sp 1 (issue 42; the
counterpart of long_context.py's SFT table; bench/README.md, "long_completions.py").

Usage:
    .venv/bin/python bench/long_completions.py                     # budget 1200 MB per rank, ~15 min on 2 cores
    .venv/bin/python bench/long_completions.py --budget_mb 600 --max_tokens 8192 --json bench/out/completions.json

Each rank scores its own prompt (32 tokens, 8 of them left padding) and completion as `ZeroGRPOTrainer` does under
sp ([Note: per-token values under sequence parallelism] in accelerate_zero/sequence/token_logps.py), then GRPO's
clipped objective at ratio 1, backward, AdamW; "tiled" is the config's `sequence_tiling` (LM head, softmax and
MLPs on 256 positions at a time), untiled the whole logits of the slice and whole MLPs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import launch, report
from long_context import TILE, VOCAB, climb, sequence_parallel_llama


PROMPT, PADS = 32, 8


def _grpo_step(engine: Any, model: Any, group: Any, tiled: bool) -> Callable[[int], None]:
    """One GRPO step on this rank's prompt and a completion of `length` tokens."""
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


def longest(budget_mb: float, max_tokens: int) -> dict[str, dict[str, list[float]]]:
    """Rank function: untiled, then tiled: {length: [peak bytes, seconds]} of the completions that fit."""
    results = {}
    for tiled in (False, True):
        engine, model, group = sequence_parallel_llama(tiled)
        step_at = _grpo_step(engine, model, group, tiled)
        results["tiled" if tiled else "untiled"] = climb(step_at, budget_mb, max_tokens, f"tiled={tiled}")
        engine.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--budget_mb", type=float, default=1200)
    parser.add_argument("--max_tokens", type=int, default=16384)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    facts = report.machine_facts()
    kwargs = {"budget_mb": args.budget_mb, "max_tokens": args.max_tokens}
    runs = {sp: launch.on_ranks(sp, longest, kwargs, name=f"sp{sp}").results[0] for sp in args.sp}
    rows = []
    for mode in ("untiled", "tiled"):
        common = min(max((int(k) for k in runs[sp][mode]), default=0) for sp in runs)  # every sp fits it
        base = runs[args.sp[0]][mode].get(str(common), [None, None])[1]
        for sp in args.sp:
            fits = runs[sp][mode]
            longest_fit = max((int(k) for k in fits), default=0)
            seconds = fits.get(str(common), [None, None])[1]
            rows.append({"sp": sp, "mode": mode, "longest": longest_fit, "common": common, "seconds": seconds,
                         "peak": fits[str(longest_fit)][0] if longest_fit else None,
                         "vs_sp1": seconds / base if seconds and base else None})  # fmt: skip
    print(
        report.header(facts, f"long_completions: the longest GRPO completion within {args.budget_mb:.0f} MB per rank")
    )
    columns = [
        "sp",
        "mode",
        f"longest completion within {args.budget_mb:.0f} MB per rank",
        "its peak MB",
        "step s at L",
        "vs sp 1",
    ]
    print(report.table(columns, [
        (r["sp"], r["mode"], r["longest"], f"{r['peak'] / 1e6:.0f}" if r["peak"] else "-",
         f"{r['seconds']:.1f} (L={r['common']})" if r["seconds"] else "-",
         f"{r['vs_sp1']:.2f}x" if r["vs_sp1"] else "-")
        for r in rows
    ], "rlrrrr"))  # fmt: skip
    if args.json:
        report.save_json(args.json, {"rows": rows}, facts)


if __name__ == "__main__":
    main()
