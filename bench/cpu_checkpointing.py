"""What `activation_checkpointing.cpu_checkpointing` takes off the device, measured on the CPU (issue 40, item 5;
bench/README.md, "cpu_checkpointing.py").

Usage:
    python bench/cpu_checkpointing.py [--layers 4] [--hidden 256] [--seq 512] [--batch 2]

On the CPU torch.cuda's memory figures do not exist, so the saving is measured where it is made: the bytes autograd
saves for backward during one forward of a Llama (bf16, one rank, stage 3), counted by saved-tensor hooks around the
call. With `cpu_checkpointing` the engine's hooks, inside, copy them to host memory (`ActivationsToHost.stats`).
"""

from __future__ import annotations

import argparse

import torch
from harness import launch, models, report


def _saved_outside(model: torch.nn.Module) -> tuple[list[int], torch.autograd.graph.saved_tensors_hooks]:
    """[activation bytes, parameter bytes] autograd saves under the returned hooks (parameters told by storage)."""
    counts = [0, 0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.untyped_storage().nbytes()}
        counts[tensor.untyped_storage().data_ptr() in params] += tensor.numel() * tensor.element_size()
        return tensor

    return counts, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def measure(args: argparse.Namespace, checkpointing: bool, cpu: bool) -> dict[str, int]:
    import accelerate_zero

    model = models.llama(models.llama_config(args.hidden, args.layers, vocab=1024, heads=8, kv_heads=4, seq=args.seq))
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ds = {
        "train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "activation_checkpointing": {"cpu_checkpointing": cpu},
    }  # fmt: skip
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
    launch.single_process_env()
    title = (f"cpu_checkpointing: Llama, {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq} "
             "tokens, bf16, stage 3")  # fmt: skip
    print(report.header(report.machine_facts(), title) + "\n")
    rows = []
    for checkpointing in (False, True):
        for cpu in (False, True):
            m = measure(args, checkpointing, cpu)
            params = m["kept_parameters"] if cpu else m["device_parameters"]
            rows.append(("on" if checkpointing else "off", "on" if cpu else "off", f"{m['device_activations']:,}",
                         f"{m['host_activations']:,}", f"{params:,}", f"{m['host_after_backward']:,}"))  # fmt: skip
    columns = ["gradient checkpointing", "cpu_checkpointing", "autograd's activations on the device", "in host memory",
               "parameters' views saved (in place)", "host after backward"]  # fmt: skip
    print(report.table(columns, rows, "llrrrr"))


if __name__ == "__main__":
    main()
