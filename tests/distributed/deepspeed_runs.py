"""DeepSpeed 0.19.8 training a tiny Llama on the pooled gloo ranks, and our engines resuming what it saved.

Imported by the rank bodies of test_checkpoint_deepspeed.py only (importing deepspeed costs seconds): DeepSpeed
runs with its CPU accelerator (`DS_ACCELERATOR=cpu`, set before its first import), and its shared-memory
communication op, which it would compile with g++ on first use (minutes), is marked unavailable in this process, so
it falls back to torch.distributed on gloo ([Note: DeepSpeed in the test ranks]).

[Note: DeepSpeed in the test ranks]
The brief `deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False` is a test-harness setting of
DeepSpeed's own op registry (DeepSpeed then takes its torch.distributed path, as it does where the op cannot be
built); the product never imports deepspeed. A pooled rank runs one body after another, each with a new process
group, and DeepSpeed caches the groups it saw in module globals (its comm backend, `deepspeed.utils.groups`): they
are dropped before each DeepSpeed run, so the next one builds them from the current group.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


GLOBAL_BATCH, SEQ, VOCAB = 6, 8, 64
SAVED_AT, STEPS = 2, 4
FINAL = "final"


def deepspeed() -> Any:
    """The deepspeed module, imported for the CPU (see the module docstring)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed as ds
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    ds.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # A pooled rank gets a new process group for every body: DeepSpeed's caches of the previous one are dropped
    ds_comm.cdb = None
    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
        setattr(groups, name, None)
    for name in ("_ZERO_PARAM_INTRA_PARALLEL_GROUP", "mpu", "mesh_device"):
        setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP"):
        getattr(groups, name).clear()
    return ds


def config(world_size: int, stage: int, dtype: str = "fp32", **zero: Any) -> dict[str, Any]:
    """AdamW with weight decay and a linear warmup (DeepSpeed's WarmupLR), no clipping (DeepSpeed defaults to 1.0)."""
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, **zero},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-2, "weight_decay": 0.1, "betas": [0.9, 0.99], "eps": 1e-6, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2, "warmup_num_steps": 5, "warmup_type": "linear"},
        },
    }
    if dtype == "bf16":
        out["bf16"] = {"enabled": True}
    if dtype == "fp16":  # the scale doubles after every step without overflow: the saved scale is not the initial one
        out["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 1, "hysteresis": 1}
    return out


def tiny_llama(lora: bool = False) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from tests.helpers.models import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def tokens(step: int, rank: int, world_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    per_rank = GLOBAL_BATCH // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def train(engine: Any, steps: range, rank: int, world_size: int) -> None:
    """DeepSpeed's engine and ours take the same calls."""
    for step in steps:
        batch = tokens(step, rank, world_size)
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()


def deepspeed_run(
    rank: int, world_size: int, folder: Path, stage: int, dtype: str = "fp32", lora: bool = False, **save: Any
) -> dict[str, Any]:
    """DeepSpeed trains SAVED_AT steps, saves to `folder` (`save`: save_checkpoint's arguments; tag default
    global_step<SAVED_AT>), trains on to STEPS and saves tag FINAL without moving `latest`; returns its learning rate
    and step count at the end."""
    ds = deepspeed()
    model = tiny_llama(lora)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds.initialize(model=model, model_parameters=params, config=config(world_size, stage, dtype))
    train(engine, range(SAVED_AT), rank, world_size)
    engine.save_checkpoint(str(folder), **save)
    scale_at_save = float(getattr(engine.optimizer, "loss_scale", 1.0))
    train(engine, range(SAVED_AT, STEPS), rank, world_size)
    final = {key: value for key, value in save.items() if key != "tag"}
    engine.save_checkpoint(str(folder), tag=FINAL, save_latest=False, **final)
    out = {"lr": engine.get_lr()[0], "steps": engine.global_steps, "scale_at_save": scale_at_save}
    dist.barrier()
    return out


def deepspeed_masters(folder: Path, tag: str) -> dict[str, torch.Tensor]:
    """The fp32 masters DeepSpeed's own zero_to_fp32 consolidates from `folder/tag` (the reference)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {k: v.float() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag).items()}


def to_universal(tag_folder: Path) -> Path:
    """DeepSpeed's ds_to_universal on `tag_folder` (`<dir>/global_stepN` -> `<dir>/global_stepN_universal`, and
    `<dir>/latest_universal`), in this process."""
    from deepspeed.checkpoint import ds_to_universal

    output = tag_folder.parent / f"{tag_folder.name}_universal"
    # its command line's arguments; one worker runs in this process (more would start a process pool)
    args = argparse.Namespace(
        input_folder=str(tag_folder),
        output_folder=str(output),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # set by DeepSpeed's Megatron integration, not by the engine alone
    )
    ds_to_universal.main(args)
    return output


def ours(world_size: int, stage: int, dtype: str = "fp32", lora: bool = False, seed_offset: int = 7) -> Any:
    """Our engine on the same model built with other weights (a load must replace them) and the same config."""
    import accelerate_zero

    model = tiny_llama(lora)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(seed_offset * 1e-2)
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    return accelerate_zero.initialize(model, config=config(world_size, stage, dtype, **zero))


def full_state(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's values in fp32 on rank 0 (`{}` elsewhere); an fp32 run's are its masters."""
    return engine.full_state_dict(dtype=torch.float32)


def max_diff(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest difference over the parameters both hold (DeepSpeed's dict also names tied aliases)."""
    shared = [name for name in reference if name in ours]
    assert shared, (sorted(ours)[:3], sorted(reference)[:3])
    return max((ours[name] - reference[name]).abs().max().item() for name in shared)
