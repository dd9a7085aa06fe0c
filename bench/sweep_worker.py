"""Memory per rank of accelerate_zero stages 0-3 at one world size; started by run_report.py under torchrun.

Usage (what run_report.py runs, once per world size 1..4):
    torchrun --standalone --nproc_per_node 2 bench/sweep_worker.py --stages 0 1 2 3 --steps 1 --out sweep_w2.json

In one process group, for each stage in turn: build the benchmark model (harness/models.py `build_model`, its size from
AZ_BENCH_HIDDEN / AZ_BENCH_LAYERS), wrap it with `accelerate_zero.initialize` and `models.engine_config`,
take `--steps` optimizer steps (so that Adam's states exist), then read `engine.memory_breakdown()`, the bytes of
every live tensor (`readings.live_tensor_bytes`, each storage once) and RSS, all minus the same readings taken
before the model was built; then destroy the engine and free everything before the next stage. A run on a tiny
model comes first, so that one-time costs (code pages, allocator arenas) do not land in the first stage's RSS.
`--llama` measures a LlamaForCausalLM shaped like offload_bench.py's too (for the estimate-honesty check). Nothing is timed.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from harness.models import LR, build_model, engine_config, make_batch
from harness.readings import live_tensor_bytes, proc_status
from torch import nn


# A LlamaForCausalLM shaped like one rung of offload_bench.py's largest-model ladder (the other model the
# benchmarks train), 2 decoder layers: 27.8M parameters. Measured with --llama for the estimate-honesty check.
LLAMA = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=1024,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    num_hidden_layers=2,
)


def build_llama(device: str | None = None) -> nn.Module:
    """The Llama above, the same on every rank (`device="meta"`: shapes only, for the estimate)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA))


Loss = Callable[[nn.Module], torch.Tensor]


def linear_stack(hidden: int | None = None, layers: int | None = None) -> tuple[nn.Module, Loss]:
    """harness/models.py's stack (its size from AZ_BENCH_HIDDEN / AZ_BENCH_LAYERS unless given) and its MSE loss."""
    model = build_model(*(v for v in (hidden, layers) if v is not None))
    x, y = make_batch(dist.get_rank(), model[0].in_features)
    return model, lambda engine: nn.functional.mse_loss(engine(x), y)


def llama() -> tuple[nn.Module, Loss]:
    """The Llama and a causal-LM loss on 2 x 64 random tokens per rank."""
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    return build_llama(), lambda engine: engine(input_ids=tokens, labels=tokens).loss


def measure_stage(stage: int, steps: int, make: Callable[[], tuple[nn.Module, Loss]]) -> dict[str, Any]:
    """One stage: what this rank holds after `steps` steps, above what it held before the model existed."""
    import accelerate_zero

    gc.collect()
    dist.barrier()
    live_before, status_before = live_tensor_bytes(), proc_status()
    model, loss_of = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = accelerate_zero.initialize(model, optimizer, config=engine_config(stage, None))
    for _ in range(steps):
        loss = loss_of(engine)
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
    del engine, optimizer, model, loss_of
    gc.collect()
    # What the stage left behind (should be ~0): a leak would inflate the next stage's baseline silently.
    reading["live_tensor_bytes_left"] = live_tensor_bytes() - live_before
    return reading


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps before reading (default 1)")
    parser.add_argument("--llama", action="store_true", help="also measure the Llama (LLAMA) at every stage")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes every rank's readings to")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    params = sum(p.numel() for p in build_model().parameters())
    # A throwaway run on a small model first: the first engine in a process also maps code pages and allocator
    # arenas, which would otherwise count in the first stage's RSS.
    measure_stage(args.stages[0], 1, lambda: linear_stack(hidden=64, layers=2))
    record = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "params": params,
        "stages": {str(stage): measure_stage(stage, args.steps, linear_stack) for stage in args.stages},
    }
    if args.llama:
        record["llama_params"] = sum(p.numel() for p in build_llama("meta").parameters())
        record["llama_stages"] = {str(stage): measure_stage(stage, args.steps, llama) for stage in args.stages}
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        with open(args.out, "w") as out:
            json.dump(records, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
