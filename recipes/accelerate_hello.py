"""An accelerate training loop that trains with ZeRO: the usual `Accelerator` code, with `ZeroAccelerator` instead.

Usage:
    accelerate-zero launch --config_file accelerate_configs/zero2.yaml recipes/accelerate_hello.py
    accelerate-zero launch --config_file accelerate_configs/zero3.yaml recipes/accelerate_hello.py --steps 30
    torchrun --nproc_per_node 2 recipes/accelerate_hello.py       # ZeroPlugin() defaults: stage 2

A tiny Llama (built from a `LlamaConfig`, nothing is downloaded) learns to copy 8 random tokens; the loss is taken
on the copy only. The ZeRO stage, batch sizes and clipping come from the launch config; "auto" values are filled
by `prepare` from the dataloader and the accelerator, as accelerate does for DeepSpeed.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from accelerate_zero import ZeroAccelerator


VOCAB, HALF, SAMPLES = 64, 8, 512


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=8, help="micro-batch per process")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args()


def copy_task() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    half = torch.randint(2, VOCAB, (SAMPLES, HALF), generator=gen)
    tokens = torch.cat([half, half], dim=1)
    labels = tokens.clone()
    labels[:, :HALF] = -100
    return TensorDataset(tokens, labels)


def main() -> None:
    args = parse_args()
    accelerator = ZeroAccelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * HALF,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    loader = DataLoader(copy_task(), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    zero = accelerator.zero_config
    accelerator.print(
        f"ZeRO stage {zero.zero_optimization.stage} on {accelerator.num_processes} processes "
        f"({accelerator.distributed_type}), micro-batch {zero.train_micro_batch_size_per_gpu}, "
        f"global batch {zero.train_batch_size}"
    )
    step = 0
    model.train()
    while step < args.steps:
        for tokens, labels in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=tokens, labels=labels).loss
                accelerator.backward(loss)  # the engine steps the optimizer here on the accumulation boundary
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()  # no-op under ZeRO: kept so the loop also runs with a plain Accelerator
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
                if step == 1 or step % 4 == 0:
                    accelerator.print(f"step {step:3d}  loss {mean_loss.item():.3f}  grad_norm {grad_norm.item():.3f}")
                if step == args.steps:
                    break
    accelerator.wait_for_everyone()
    accelerator.print("done")
    accelerator.end_training()


if __name__ == "__main__":
    main()
