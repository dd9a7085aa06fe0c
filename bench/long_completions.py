"""Long completions on CPU ranks: the longest GRPO completion that trains within a memory budget per rank, with Ulysses
sequence parallelism (sp 1, 2, 4), tiled and not, and the step time against sp 1 (issue 42; the counterpart of
long_context.py's SFT table).

Usage:
    .venv/bin/python bench/long_completions.py                     # budget 1200 MB per rank, ~15 min on 2 cores
    .venv/bin/python bench/long_completions.py --budget_mb 600 --max_tokens 8192 --json bench/out/completions.json

Each rank holds its own prompt (32 tokens, 8 of them left padding) and one completion of L tokens, as GRPO's ranks
hold their own generations. One training step scores them as `ZeroGRPOTrainer` does under sp: the group computes the
per-token log-probabilities over cut sequences, one member's row at a time under activation checkpointing, and
returns them whole ([Note: per-token values under sequence parallelism] in accelerate_zero/sequence/token_logps.py),
then GRPO's clipped objective at ratio 1 (`-exp(logp - logp.detach()) * advantage`, token mean), backward, AdamW.
"Tiled": the config's `sequence_tiling` (`logits_tile_tokens` and `mlp_tile_tokens` 256: the LM head and softmax,
and the MLPs, on 256 positions at a time, `tiled_token_values` and `tile_mlp`); untiled: the model's whole logits of
the slice and whole MLPs. (TRL's fused LM head chunks by 32,768 positions off Triton devices: on CPU, below that, it
holds the slice's logits whole.) The peak is the step's resident memory above the rank's before it (VmHWM
after `clear_refs`, maximum over ranks); lengths 512, 1024, ... until it exceeds the budget. The step time is that
of the longest completion every sp fits, against sp 1's. Llama: vocabulary 32,000, hidden 256, 4 layers, 8 heads
(4 key/value), fp32, ZeRO-3 with every tensor partitioned; no reference model (TRL's default beta is 0).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.readings import proc_status, reset_peak_rss  # noqa: E402


VOCAB, HIDDEN, LAYERS, TILE, PROMPT, PADS = 32000, 256, 4, 256, 32, 8


def _row(length: int, rank: int) -> tuple:  # noqa: ANN401
    import torch

    generator = torch.Generator().manual_seed(length * 7 + rank)
    ids = torch.randint(1, VOCAB, (1, PROMPT + length), generator=generator)
    mask = torch.ones_like(ids)
    mask[:, :PADS] = 0  # a left-padded prompt
    scored = torch.zeros_like(mask, dtype=torch.bool)
    scored[:, PROMPT:] = True
    return ids.masked_fill(mask == 0, 0), mask, scored


def _scorer(model, tiled: bool):  # noqa: ANN001, ANN202
    import torch

    from accelerate_zero.sequence.tiled_values import tiled_token_values

    def score(batch: dict) -> dict:
        labels = batch.pop("shift_labels")
        if tiled:
            return tiled_token_values(model, batch.pop("input_ids"), labels, TILE, **batch)
        logits = model(**batch).logits.float()
        logps = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return {"log_probs": logps.masked_fill(labels == -100, 0)}

    return score


def _step(engine, model, group, length: int, tiled: bool, rank: int) -> tuple[float, float]:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from accelerate_zero.engine.collectives import CommStats
    from accelerate_zero.sequence.token_logps import sequence_parallel_token_values

    ids, mask, scored = _row(length, rank)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the step before freed goes back to the system first
    dist.barrier()
    before = proc_status()["VmRSS"]
    reset_peak_rss()
    start = time.perf_counter()
    values = sequence_parallel_token_values(_scorer(model, tiled), ids, mask, scored, group, CommStats())
    logps = values["log_probs"]
    per_token = -torch.exp(logps - logps.detach()) * 0.5
    loss = (per_token * scored).sum() / scored.sum()
    engine.backward(loss)
    engine.step()
    seconds = time.perf_counter() - start
    peak = torch.tensor([float(proc_status()["VmHWM"] - before), seconds])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak[0].item(), peak[1].item()


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import accelerate_zero
    from accelerate_zero.engine.groups import DataParallelGroup
    from accelerate_zero.sequence import register_ulysses_attention, tile_mlp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    results = {}
    for tiled in (False, True):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=3 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1 << 17,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
        engine = accelerate_zero.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-4),
            config={"sequence_parallel_size": world, "zero_optimization": zero},
        )
        group = engine.layout.sequence if world > 1 else DataParallelGroup(None, 0, 1)
        if world > 1:
            model.set_attn_implementation(register_ulysses_attention(group))
        if tiled:
            tile_mlp(model, TILE)
        model.train()
        _step(engine, model, group, 128, tiled, rank)  # the optimizer's states are made at the first step
        fits, length = {}, 512
        while length <= args.max_tokens:
            peak, seconds = _step(engine, model, group, length, tiled, rank)
            if rank == 0:
                print(f"sp={world} tiled={tiled} L={length}: peak {peak / 1e6:.0f} MB, {seconds:.1f} s", flush=True)
            if peak > args.budget_mb * 1e6:
                break
            fits[length] = [peak, seconds]
            length *= 2
        engine.destroy()
        results["tiled" if tiled else "untiled"] = fits
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--budget_mb", type=float, default=1200)
    parser.add_argument("--max_tokens", type=int, default=16384)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs = {}
    for sp in args.sp:
        out = Path(f"/tmp/az_long_completions_{sp}.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(sp), __file__, "--worker"]
        command += ["--out", str(out), "--budget_mb", str(args.budget_mb), "--max_tokens", str(args.max_tokens)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        runs[sp] = json.loads(out.read_text())
    rows = []
    for mode in ("untiled", "tiled"):
        common = min(max((int(k) for k in runs[sp][mode]), default=0) for sp in runs)  # every sp fits it
        base = runs[args.sp[0]][mode].get(str(common), [None, None])[1]
        for sp in args.sp:
            fits = runs[sp][mode]
            longest = max((int(k) for k in fits), default=0)
            seconds = fits.get(str(common), [None, None])[1]
            rows.append(
                {
                    "sp": sp,
                    "mode": mode,
                    "longest": longest,
                    "peak": fits[str(longest)][0] if longest else None,
                    "common": common,
                    "seconds": seconds,
                    "vs_sp1": seconds / base if seconds and base else None,
                }
            )
    print(
        f"| sp | mode | longest completion within {args.budget_mb:.0f} MB per rank | its peak MB | step s at L "
        "| vs sp 1 |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        peak = f"{row['peak'] / 1e6:.0f}" if row["peak"] else "-"
        seconds = f"{row['seconds']:.1f} (L={row['common']})" if row["seconds"] else "-"
        ratio = f"{row['vs_sp1']:.2f}x" if row["vs_sp1"] else "-"
        print(f"| {row['sp']} | {row['mode']} | {row['longest']} | {peak} | {seconds} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
