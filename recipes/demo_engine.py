"""Train a tiny Llama with the ZeRO engine on a synthetic copy task; print the loss and the memory of each rank.

Usage:
    torchrun --nproc_per_node 2 recipes/demo_engine.py              # ZeRO stage 2 on 2 CPU processes
    torchrun --nproc_per_node 2 recipes/demo_engine.py --stage 1 --steps 60

Each sequence is 12 random tokens followed by the same 12 tokens; the loss is taken on the copy only, so it falls
as the model learns to look back. Nothing is downloaded: the model is built from a `LlamaConfig`.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import accelerate_zero


VOCAB, HALF, MICRO_BATCH, GRAD_ACCUM = 64, 12, 8, 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()


def make_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    half = torch.randint(2, VOCAB, (MICRO_BATCH, HALF), generator=gen)
    tokens = torch.cat([half, half], dim=1)
    labels = tokens.clone()
    labels[:, :HALF] = -100
    return tokens, labels


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2 * HALF,
            tie_word_embeddings=True,
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 20_000, "overlap_comm": True},
    }
    engine = accelerate_zero.initialize(model, optimizer, config=config)
    rank, world_size = engine.dp.rank, engine.dp.world_size
    gen = torch.Generator().manual_seed(1000 + rank)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"ZeRO stage {args.stage} on {world_size} processes, {n_params:,} parameters")
    for step in range(1, args.steps + 1):
        losses = []
        for _ in range(GRAD_ACCUM):
            tokens, labels = (t.to(engine.device) for t in make_batch(gen))
            loss = engine(input_ids=tokens, labels=labels).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step == 1 or step % 5 == 0):
            print(
                f"step {step:3d}  loss {mean_loss.item() / world_size:.3f}  grad_norm {engine.get_global_grad_norm():.3f}"
            )
    report_memory(engine)


def report_memory(engine: accelerate_zero.ZeroEngine) -> None:
    breakdowns = [None] * engine.dp.world_size
    dist.all_gather_object(breakdowns, engine.memory_breakdown())
    if engine.dp.rank != 0:
        return
    kinds = ["parameters", "gradients", "master_weights", "optimizer_states", "communication_buffers_peak", "total"]
    print("\nbytes held per rank (engine.memory_breakdown())")
    print("rank " + "".join(f"{kind:>28}" for kind in kinds))
    for rank, breakdown in enumerate(breakdowns):
        print(f"{rank:4d} " + "".join(f"{breakdown[kind]:>28,}" for kind in kinds))


if __name__ == "__main__":
    main()
