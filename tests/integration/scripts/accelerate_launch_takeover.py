"""Train under accelerate's own `accelerate launch` with a DeepSpeed config, deepspeed installed; report what the
ZeRO engine trains with and whether deepspeed was imported on this rank.

Usage (what tests/integration/test_migration.py runs):
    accelerate launch --config_file ds.yaml tests/integration/scripts/accelerate_launch_takeover.py --out OUT_DIR
    accelerate launch --config_file ds.yaml tests/integration/scripts/accelerate_launch_takeover.py --out OUT_DIR \
        --trainer --bf16 --gradient_accumulation_steps 2 --max_grad_norm 0.5

Without `--trainer` it runs accelerate's documented loop with `ZeroAccelerator()` (nothing ZeRO-specific in the
script: every setting comes from the launch); with it, accelerate_zero's `Trainer` (whose arguments must agree with
the accelerate config, as under DeepSpeed); with `--then_trainer`, the loop and then the Trainer in the same
processes (accelerate's process-wide state reset between them: one launch, and one import of torch per rank, for
both). Each rank writes OUT_DIR/<loop|trainer>_rank<R>.json at the end of each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trainer", action="store_true", help="train with the Trainer instead of a plain loop")
    parser.add_argument("--then_trainer", action="store_true", help="the plain loop, then the Trainer")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    exported = ("ACCELERATE_DEEPSPEED_", "ACCELERATE_GRADIENT_", "ACCELERATE_MIXED_PRECISION")
    launched = {name: value for name, value in os.environ.items() if name.startswith(exported)}
    if args.then_trainer:
        from accelerate.state import AcceleratorState, GradientState

        _report(args.out, "loop", launched, *_train_in_a_loop())
        AcceleratorState._reset_state()  # the Trainer's accelerator reads the launch's settings again
        GradientState._reset_state()
        _report(args.out, "trainer", launched, *_train_with_trainer(args))
    elif args.trainer:
        _report(args.out, "trainer", launched, *_train_with_trainer(args))
    else:
        _report(args.out, "loop", launched, *_train_in_a_loop())


def _report(out: Path, name: str, launched: dict[str, str], engine: Any, accelerator: Any, losses: list) -> None:
    config = engine.config
    result: dict[str, Any] = {
        "launched_with": launched,  # what accelerate's DeepSpeed launcher exported to this rank
        "use_deepspeed": os.environ.get("ACCELERATE_USE_DEEPSPEED"),
        "distributed_type": str(accelerator.distributed_type),
        "world_size": accelerator.num_processes,
        "stage": engine.stage,
        "offload_optimizer": engine.offload.optimizer,
        "offload_params": engine.offload.params,
        "offload_devices": [
            getattr(config.zero_optimization, name).device for name in ("offload_optimizer", "offload_param")
        ],
        "engine_accumulation": engine.gradient_accumulation_steps(),
        "accelerator_accumulation": accelerator.gradient_accumulation_steps,
        "gradient_clipping": config.gradient_clipping,
        "bf16": config.bf16.enabled,
        "compute_dtype": str(engine.compute_dtype),
        "param_dtype": str(next(engine.module.parameters()).dtype),
        "micro_steps": engine.micro_steps,
        "optimizer_steps": engine.global_steps,
        "losses_finite": bool(losses) and all(math.isfinite(loss) for loss in losses),
        "deepspeed_modules": _deepspeed_modules(),  # last: nothing after this may import anything
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}_rank{accelerator.process_index}.json").write_text(json.dumps(result))


def _deepspeed_modules() -> list[str]:
    """The deepspeed modules this process imported: the first few, and how many."""
    names = sorted(name for name in sys.modules if name.split(".")[0] == "deepspeed")
    return names[:3] + [f"... {len(names)} deepspeed modules in all"] * (len(names) > 3)


def _train_in_a_loop() -> tuple[Any, Any, list[float]]:
    from accelerate_zero.integrations.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator()
    torch.manual_seed(0)
    inputs = torch.randn(64, 7)
    targets = inputs @ torch.randn(7, 3)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4)
    model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.ReLU(), torch.nn.Linear(15, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch_inputs, batch_targets in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(batch_inputs).float(), batch_targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return accelerator.zero_engines[0], accelerator, losses


def _train_with_trainer(args: argparse.Namespace) -> tuple[Any, Any, list[float]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from accelerate_zero import Trainer, TrainingArguments

    training_args = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm,
        bf16=args.bf16,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=45, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    rows = torch.randint(0, 61, (16, 10), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    trainer = Trainer(model=LlamaForCausalLM(config), args=training_args, train_dataset=dataset)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return trainer.zero_engine, trainer.accelerator, losses


if __name__ == "__main__":
    main()
