"""What `activation_checkpointing.cpu_checkpointing` takes off the device, measured on the CPU (issue 40, item 5).

Usage:
    python bench/cpu_checkpointing.py [--layers 4] [--hidden 256] [--seq 512] [--batch 2]

On the CPU torch.cuda's memory figures do not exist, so the saving is measured where it is made: the bytes autograd
saves for backward during one forward of a Llama (bf16, one rank, stage 3), counted by saved-tensor hooks opened
around the call. Without `cpu_checkpointing` they stay with autograd on the compute device; with it the engine's
hooks, inside, copy them to host memory (`ActivationsToHost.stats`) and the outer hooks see nothing left. The
parameters autograd saves (their views) stay where the engine keeps them, with it or not.
"""

from __future__ import annotations

import argparse
import os

import torch

import accelerate_zero


def _saved_outside(model: torch.nn.Module) -> tuple[list[int], torch.autograd.graph.saved_tensors_hooks]:
    """[activation bytes, parameter bytes] autograd saves under the returned hooks (parameters told by storage)."""
    counts = [0, 0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.untyped_storage().nbytes()}
        counts[tensor.untyped_storage().data_ptr() in params] += tensor.numel() * tensor.element_size()
        return tensor

    return counts, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def measure(args: argparse.Namespace, checkpointing: bool, cpu: bool) -> dict[str, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    model = LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ds = {
        "train_micro_batch_size_per_gpu": args.batch,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "activation_checkpointing": {"cpu_checkpointing": cpu},
    }
    engine = accelerate_zero.initialize(model, config=ds, device="cpu")
    tokens = torch.randint(0, 1024, (args.batch, args.seq))
    counts, hooks = _saved_outside(engine.module)
    with hooks:
        loss = engine(input_ids=tokens, labels=tokens).loss
    stats = engine.activation_offload.stats if engine.activation_offload is not None else None
    out = {"device_activations": counts[0], "device_parameters": counts[1]}
    out["host_activations"] = stats.held_bytes if stats is not None else 0
    out["kept_parameters"] = stats.kept_bytes if stats is not None else 0
    engine.backward(loss)
    engine.step()
    out["host_after_backward"] = stats.held_bytes if stats is not None else 0
    engine.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 4), ("hidden", 256), ("seq", 512), ("batch", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29631", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    print(f"Llama, {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq} tokens, bf16, stage 3")
    print(
        "| gradient checkpointing | cpu_checkpointing | autograd's activations on the device | in host memory "
        "| parameters' views saved (in place) | host after backward |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for checkpointing in (False, True):
        for cpu in (False, True):
            m = measure(args, checkpointing, cpu)
            params = m["kept_parameters"] if cpu else m["device_parameters"]
            print(
                f"| {'on' if checkpointing else 'off'} | {'on' if cpu else 'off'} | {m['device_activations']:,} "
                f"| {m['host_activations']:,} | {params:,} | {m['host_after_backward']:,} |"
            )


if __name__ == "__main__":
    main()
