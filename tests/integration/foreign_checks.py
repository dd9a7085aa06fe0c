"""What each rank runs for tests/integration/test_foreign_checkpoints.py: transformers' own Trainer with DeepSpeed (and
with FSDP) writing `checkpoint-N` folders, and ours resuming them.

Every run trains the tiny Llama of trainer_checks.py with AdamW (weight decay 0.1), a linear schedule with 2 warmup
steps and no clipping, on the Trainer's sequential sampler: 4 optimizer steps of 2 micro-steps, a checkpoint every 2.
The resumed run (ours, from `checkpoint-2`) must end where the run that never stopped (theirs) ended: the data
position, the step, the learning rate and the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import plain_torchrun_environment
from tests.integration import trainer_checks


MICRO = 3
SAVE_AT = 2


def _args(folder: Path) -> dict[str, Any]:
    return trainer_checks.args_kwargs(
        folder,
        MICRO,
        optim="adamw_torch",
        weight_decay=0.1,
        learning_rate=2e-2,
        warmup_steps=2,
        max_grad_norm=0.0,
        save_strategy="steps",
        save_steps=SAVE_AT,
    )


def deepspeed_trainer(rank: int, world_size: int, folder: str, stage: int) -> dict[str, Any]:
    """transformers' Trainer with `deepspeed=` (DeepSpeed 0.19.8 on the CPU) trains and checkpoints; returns its
    end: the lr, the step, and (rank 0) the final fp32 masters as DeepSpeed's zero_to_fp32 consolidates them."""
    from transformers import Trainer, TrainingArguments

    from tests.distributed import deepspeed_runs

    plain_torchrun_environment()
    deepspeed_runs.deepspeed()
    args = TrainingArguments(deepspeed=trainer_checks.zero_config(stage), **_args(Path(folder)))
    trainer = Trainer(model=trainer_checks.tiny_llama(), args=args, train_dataset=trainer_checks.dataset())
    trainer.train()
    out = {"log": logged(trainer), "step": trainer.state.global_step}
    final = Path(folder) / f"checkpoint-{trainer_checks.STEPS}"
    out["state"] = deepspeed_runs.deepspeed_masters(final, None) if rank == 0 else None
    out["files"] = sorted(p.name for p in (Path(folder) / f"checkpoint-{SAVE_AT}").iterdir())
    return out


def fsdp_trainer(rank: int, world_size: int, folder: str, state_dict_type: str) -> dict[str, Any]:
    """transformers' Trainer with FSDP2 (forced on the CPU, tests/integration/fsdp_on_cpu.py), wrapping each decoder
    layer, trains and checkpoints with `state_dict_type` ("FULL_STATE_DICT", transformers' default, or
    "SHARDED_STATE_DICT"); returns its end: the log, the step and (rank 0) the full fp32 weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import TrainingArguments

    from tests.integration.fsdp_on_cpu import fsdp_trainer_class

    plain_torchrun_environment()
    fsdp = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": state_dict_type}
    args = TrainingArguments(fsdp="full_shard", fsdp_config=fsdp, **_args(Path(folder)))
    trainer = fsdp_trainer_class()(
        model=trainer_checks.tiny_llama(), args=args, train_dataset=trainer_checks.dataset()
    )
    trainer.train()
    full = get_model_state_dict(
        trainer.model_wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {
        "log": logged(trainer),
        "step": trainer.state.global_step,
        "state": {name: value.float() for name, value in full.items()} if rank == 0 else None,
        "files": sorted(p.name for p in (Path(folder) / f"checkpoint-{SAVE_AT}").iterdir()),
    }


def our_trainer_resumes(rank: int, world_size: int, checkpoint: str, stage: int) -> dict[str, Any]:
    """Our Trainer (`zero_config=` the same config) resumes `checkpoint` and trains to the end."""
    from accelerate_zero import Trainer, TrainingArguments

    plain_torchrun_environment()
    folder = Path(checkpoint).parent.parent / f"ours_from_{Path(checkpoint).parent.name}"
    args = TrainingArguments(zero_config=trainer_checks.zero_config(stage), **_args(folder))
    model = trainer_checks.tiny_llama(seed=7)  # other weights: the resume must replace them
    trainer = Trainer(model=model, args=args, train_dataset=trainer_checks.dataset())
    trainer.train(resume_from_checkpoint=checkpoint)
    state = trainer.zero_engine.full_state_dict(dtype=torch.float32)
    return {"log": logged(trainer), "step": trainer.state.global_step, "state": state}


def logged(trainer: Any) -> dict[int, tuple[float, float]]:
    """step -> (loss, learning rate) the Trainer logged: the batches a step trained on, and its schedule."""
    return {e["step"]: (e["loss"], e["learning_rate"]) for e in trainer.state.log_history if "loss" in e}
