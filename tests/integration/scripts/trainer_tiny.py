"""Train a tiny random Llama for 2 steps with accelerate_zero's Trainer, ZeRO settings from the launcher.

Usage (what tests/integration/test_migration.py runs, with deepspeed installed):
    accelerate launch --config_file zero3.yaml tests/integration/scripts/trainer_tiny.py --out OUT_DIR [--bf16]

Each rank writes OUT_DIR/trainer_rank<R>.json: the stage its engine trains at, what accelerate sees, the losses,
and whether deepspeed was imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from accelerate_zero import Trainer, TrainingArguments


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bf16", action="store_true", help="as the accelerate config's mixed_precision: bf16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    training_args = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        bf16=args.bf16,
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=45, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    rows = torch.randint(0, 61, (16, 10), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()
    result = {
        "stage": trainer.zero_engine.stage,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "deepspeed_plugin": training_args.deepspeed_plugin is not None,
        "param_dtype": str(next(model.parameters()).dtype),
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "deepspeed_imported": "deepspeed" in sys.modules,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"trainer_rank{trainer.accelerator.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
