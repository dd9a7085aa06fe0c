"""A plain accelerate training loop on an `nn.Sequential` fed float32 batches from a DataLoader, with ZeroAccelerator.

Usage (what tests/integration/test_accelerate_loop_configs.py runs):
    accelerate-zero launch --config_file zero3.yaml tests/integration/scripts/accelerate_loop.py --out OUT_DIR

The loop is accelerate's documented one (`prepare`, `accumulate`, `backward`, `optimizer.step`, `zero_grad`), with
nothing ZeRO- or precision-specific in it: under bf16 the prepared model casts its float32 inputs itself. Each rank
writes OUT_DIR/rank<R>.json: its losses, the parameters' dtype, the output's dtype, the stage, the accumulation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate_zero.integrations.accelerate import ZeroAccelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    accelerator = ZeroAccelerator()
    torch.manual_seed(0)
    inputs = torch.randn(256, 16)
    targets = inputs @ torch.randn(16, 4)  # float32 regression targets, kept float32 by the loss
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, output_dtype = [], None
    for _ in range(args.epochs):
        for batch_inputs, batch_targets in loader:
            with accelerator.accumulate(model):
                outputs = model(batch_inputs)
                loss = torch.nn.functional.mse_loss(outputs, batch_targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            output_dtype = str(outputs.dtype)

    engine = accelerator.zero_engines[0]
    result = {
        "losses": losses,
        "input_dtype": str(batch_inputs.dtype),
        "output_dtype": output_dtype,
        "param_dtype": str(next(model.parameters()).dtype),
        "stage": engine.stage,
        "world_size": accelerator.num_processes,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "distributed_type": str(accelerator.distributed_type),
        "deepspeed_imported": "deepspeed" in sys.modules,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
