"""Long context on CPU ranks: the longest sequence that trains within a memory budget per rank, and the memory per
token, with Ulysses sequence parallelism (sp 1, 2, 4) and with tiling, at ZeRO-3 (issue 34).

Usage:
    .venv/bin/python bench/long_context.py                      # budget 1200 MB per rank, ~10 min on 2 cores
    .venv/bin/python bench/long_context.py --budget_mb 300 --json bench/out/long_context.json

For each sp (one `torchrun` of sp processes: one sequence, cut in sp slices) and each of untiled / tiled (MLP and
logits + loss in tiles of 256 positions, accelerate_zero/sequence/tiling.py), sequences of 512, 1024, 2048, ...
tokens train one step (forward, backward, AdamW step) until the peak resident memory of a step, above the rank's
memory before it (VmHWM after `clear_refs`, maximum over ranks), exceeds the budget. Memory per token is the slope
of that peak between the two longest lengths that fit (per rank, per token of the whole sequence): the cost of
one more token, without what every step holds whatever the length (a warm-up step of 128 tokens makes the
optimizer's states first). Llama: vocabulary 32,000, hidden 256, 4 layers, 8 heads (4 key/value), fp32, every
tensor partitioned (ZeRO-3).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.readings import proc_status, reset_peak_rss  # noqa: E402


VOCAB, HIDDEN, LAYERS, TILE = 32000, 256, 4, 256


def _step(engine, model, group, length: int, tiled: bool) -> float:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from accelerate_zero.sequence import sequence_parallel_loss, shard_sequence

    tokens = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    shard = shard_sequence(tokens, tokens, group)
    # freed memory of the step before goes back to the system first, or this step would reuse it unseen
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = proc_status()["VmRSS"]
    reset_peak_rss()
    loss = sequence_parallel_loss(model, shard, group, tile_tokens=TILE if tiled else None)
    engine.backward(loss)
    engine.step()
    peak = torch.tensor([float(proc_status()["VmHWM"] - before)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import accelerate_zero
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
        group = engine.layout.sequence if world > 1 else engine.dp
        model.set_attn_implementation(register_ulysses_attention(group))
        if tiled:
            tile_mlp(model, TILE)
        _step(engine, model, group, 128, tiled)  # the optimizer's states are made at the first step: not measured
        fits, length = {}, 512
        while length <= args.max_tokens:
            peak = _step(engine, model, group, length, tiled)
            if rank == 0:
                print(f"sp={world} tiled={tiled} length={length}: peak {peak / 1e6:.0f} MB", flush=True)
            if peak > args.budget_mb * 1e6:
                break
            fits[length] = peak
            length *= 2
        engine.destroy()
        results["tiled" if tiled else "untiled"] = fits
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--budget_mb", type=float, default=1200)
    parser.add_argument("--max_tokens", type=int, default=32768)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for sp in args.sp:
        out = Path(f"/tmp/az_long_context_{sp}.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(sp), __file__, "--worker"]
        command += ["--out", str(out), "--budget_mb", str(args.budget_mb), "--max_tokens", str(args.max_tokens)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for mode, fits in json.loads(out.read_text()).items():
            lengths = sorted(int(k) for k in fits)
            longest = lengths[-1] if lengths else 0
            # the cost of one more token: the slope between the two longest lengths that fit
            slope = None
            if len(lengths) >= 2:
                slope = (fits[str(lengths[-1])] - fits[str(lengths[-2])]) / (lengths[-1] - lengths[-2])
            peak = fits[str(longest)] if longest else None
            rows.append({"sp": sp, "mode": mode, "longest": longest, "peak": peak, "bytes_per_token": slope})
    print(
        f"| sp | mode | longest sequence within {args.budget_mb:.0f} MB per rank | its peak MB | bytes per token (slope) |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        slope = f"{row['bytes_per_token']:.0f}" if row["bytes_per_token"] else "-"
        peak = f"{row['peak'] / 1e6:.0f}" if row["peak"] else "-"
        print(f"| {row['sp']} | {row['mode']} | {row['longest']} | {peak} | {slope} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
