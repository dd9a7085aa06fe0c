"""What each rank runs for tests/integration/test_foreign_checkpoints.py: transformers' own Trainer with DeepSpeed and
with FSDP writing `checkpoint-N` folders, accelerate's FSDP `save_state`, and ours resuming them.

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


GLOBAL_MICRO = 6
"""Rows per micro-step over all ranks: 3 per rank on 2 ranks, 2 on 3 (the same rows, so the same run)."""
SAVE_AT = 2


def _args(folder: Path, world_size: int = 2) -> dict[str, Any]:
    return trainer_checks.args_kwargs(
        folder,
        GLOBAL_MICRO // world_size,
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
    folder = Path(checkpoint).parent.parent / f"ours{world_size}_from_{Path(checkpoint).parent.name}"
    args = TrainingArguments(zero_config=trainer_checks.zero_config(stage), **_args(folder, world_size))
    model = trainer_checks.tiny_llama(seed=7)  # other weights: the resume must replace them
    trainer = Trainer(model=model, args=args, train_dataset=trainer_checks.dataset())
    trainer.train(resume_from_checkpoint=checkpoint)
    state = trainer.zero_engine.full_state_dict(dtype=torch.float32)
    return {"log": logged(trainer), "step": trainer.state.global_step, "state": state}


def logged(trainer: Any) -> dict[int, tuple[float, float]]:
    """step -> (loss, learning rate) the Trainer logged: the batches a step trained on, and its schedule."""
    return {e["step"]: (e["loss"], e["learning_rate"]) for e in trainer.state.log_history if "loss" in e}


class Counter:
    """An object registered with `register_for_checkpointing`: accelerate saves and restores its state_dict."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def _accelerate_loop(accelerator: Any, model: Any, world_size: int, steps: range, force: Any = None) -> Any:
    """AdamW (weight decay) with a linear warmup LambdaLR, on this rank's slice of the same global batches."""
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1)
    scheduler = get_linear_schedule_with_warmup(optimizer, 3, 12)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if force is not None:
        force()
    for step in steps:
        _step(accelerator, model, optimizer, scheduler, step, world_size)
    return model, scheduler


def _step(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, step: int, world_size: int) -> None:
    """One optimizer step on this rank's rows of step `step`'s batch (the same batches in every run)."""
    rank = accelerator.process_index
    data = torch.randint(0, trainer_checks.VOCAB, (6, 8), generator=torch.Generator().manual_seed(50 + step))
    batch = data[rank * 6 // world_size : (rank + 1) * 6 // world_size]
    accelerator.backward(model(input_ids=batch, labels=batch).loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _fsdp_accelerator(version: int) -> tuple[Any, Any]:
    """An Accelerator with FSDP `version` (SHARDED_STATE_DICT, each decoder layer wrapped), forced on the CPU."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from tests.integration.fsdp_on_cpu import force_fsdp

    plain_torchrun_environment()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version,
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        use_orig_params=True,  # FSDP1: the optimizer is built before prepare
        cpu_ram_efficient_loading=False,
    )
    # FSDP2 needs accelerate's multi-process CPU state (cpu=True; without it accelerate counts one process and FSDP2
    # shards over a mesh of one); FSDP1 shards over the default group and refuses cpu=True (device "cpu" vs "cpu:0").
    # One scheduler step per optimizer step in every run (accelerate otherwise steps it once per process it counts).
    accelerator = Accelerator(cpu=version == 2, fsdp_plugin=plugin, step_scheduler_with_optimizer=False)
    force_fsdp(plugin)
    return accelerator, plugin


def accelerate_fsdp(rank: int, world_size: int, folder: str, version: int) -> dict[str, Any]:
    """accelerate with FSDP `version` (forced on the CPU) trains SAVE_AT steps, `save_state(folder)` (a registered
    Counter at 5), trains to 4 steps; returns its end (rank 0: the full weights) and the learning rate."""
    from tests.integration.fsdp_on_cpu import force_fsdp

    accelerator, plugin = _fsdp_accelerator(version)
    counter = Counter(5)
    accelerator.register_for_checkpointing(counter)
    model, scheduler = _accelerate_loop(
        accelerator, trainer_checks.tiny_llama(), world_size, range(SAVE_AT), lambda: force_fsdp(plugin)
    )
    force_fsdp(plugin)  # each AcceleratorState() copies the CPU's distributed type back (fsdp_on_cpu.py)
    accelerator.save_state(folder)
    model, scheduler = _continue(accelerator, model, scheduler, world_size, lambda: force_fsdp(plugin))
    # The end, saved the same way and merged by torch's own DCP tools (FSDP1's full state_dict hook crashes on the CPU)
    force_fsdp(plugin)
    accelerator.save_state(f"{folder}_end")
    return {"lr": scheduler.get_last_lr()[0], "state": _merged(Path(folder + "_end") / "pytorch_model_fsdp_0", rank)}


def _merged(dcp_folder: Path, rank: int) -> dict[str, torch.Tensor] | None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if rank != 0:
        return None
    dcp_to_torch_save(dcp_folder, dcp_folder.with_suffix(".pt"))
    model = torch.load(dcp_folder.with_suffix(".pt"), weights_only=False)["model"]  # a test's own file
    return {name: value.float() for name, value in model.items()}


def _continue(accelerator: Any, model: Any, scheduler: Any, world_size: int, force: Any = None) -> tuple[Any, Any]:
    optimizer = accelerator._optimizers[0]
    for step in range(SAVE_AT, trainer_checks.STEPS):
        if force is not None:
            force()
        _step(accelerator, model, optimizer, scheduler, step, world_size)
    return model, scheduler


def zero_accelerator_resumes(rank: int, world_size: int, folder: str, stage: int) -> dict[str, Any]:
    """`ZeroAccelerator.load_state(folder)` of accelerate's FSDP save, then the same steps to the end."""
    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    plain_torchrun_environment()
    config = {"train_micro_batch_size_per_gpu": 6 // world_size, "gradient_clipping": 0.0}
    config["zero_optimization"] = {"stage": stage}
    plugin = ZeroPlugin(config=config, zero3_save_16bit_model=True)
    accelerator = ZeroAccelerator(plugin, step_scheduler_with_optimizer=False)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, scheduler = _accelerate_loop(accelerator, trainer_checks.tiny_llama(seed=7), world_size, range(0))
    accelerator.load_state(folder)
    lr_loaded = scheduler.get_last_lr()[0]
    at_load = {k: v.float() for k, v in accelerator.get_state_dict(model).items()} if rank == 0 else None
    model, scheduler = _continue(accelerator, model, scheduler, world_size)
    state = accelerator.get_state_dict(model)
    out = {"lr": scheduler.get_last_lr()[0], "lr_loaded": lr_loaded, "counter": counter.value, "at_load": at_load}
    out["saved"] = _merged(Path(folder) / "pytorch_model_fsdp_0", rank)
    out["state"] = {k: v.float() for k, v in state.items()} if rank == 0 else None
    accelerator.free_memory()
    return out


def zero_accelerator_saves_fsdp(rank: int, world_size: int, folder: str, stage: int) -> dict[str, Any]:
    """Our ZeroAccelerator trains SAVE_AT steps, `save_state(folder, checkpoint_format="fsdp")` (Counter at 5), trains
    to 4 steps: the run that never moved."""
    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    plain_torchrun_environment()
    config = {"train_micro_batch_size_per_gpu": 6 // world_size, "gradient_clipping": 0.0}
    config["zero_optimization"] = {"stage": stage}
    plugin = ZeroPlugin(config=config, zero3_save_16bit_model=True)
    accelerator = ZeroAccelerator(plugin, step_scheduler_with_optimizer=False)
    accelerator.register_for_checkpointing(Counter(5))
    model, scheduler = _accelerate_loop(accelerator, trainer_checks.tiny_llama(), world_size, range(SAVE_AT))
    accelerator.save_state(folder, checkpoint_format="fsdp")
    model, scheduler = _continue(accelerator, model, scheduler, world_size)
    state = accelerator.get_state_dict(model)
    out = {"lr": scheduler.get_last_lr()[0], "state": {k: v.float() for k, v in state.items()} if rank == 0 else None}
    out["files"] = sorted(p.name for p in Path(folder).iterdir())
    accelerator.free_memory()
    return out


def accelerate_fsdp_resumes(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """accelerate's FSDP2 `load_state(folder)` of what our ZeroAccelerator saved, then the same steps to the end."""
    from tests.integration.fsdp_on_cpu import force_fsdp

    accelerator, plugin = _fsdp_accelerator(2)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, scheduler = _accelerate_loop(
        accelerator, trainer_checks.tiny_llama(seed=7), world_size, range(0), lambda: force_fsdp(plugin)
    )
    force_fsdp(plugin)
    accelerator.load_state(folder)
    model, scheduler = _continue(accelerator, model, scheduler, world_size, lambda: force_fsdp(plugin))
    force_fsdp(plugin)
    accelerator.save_state(f"{folder}_fsdp_end")
    state = _merged(Path(f"{folder}_fsdp_end") / "pytorch_model_fsdp_0", rank)
    return {"lr": scheduler.get_last_lr()[0], "counter": counter.value, "state": state}


def our_trainer_saves(rank: int, world_size: int, folder: str, checkpoint_format: str) -> dict[str, Any]:
    """Our Trainer with `save_checkpoint_format=checkpoint_format` trains 4 steps, checkpointing every SAVE_AT."""
    from accelerate_zero import Trainer, TrainingArguments

    plain_torchrun_environment()
    args = TrainingArguments(
        zero_config=trainer_checks.zero_config(2), save_checkpoint_format=checkpoint_format, **_args(Path(folder))
    )
    trainer = Trainer(model=trainer_checks.tiny_llama(), args=args, train_dataset=trainer_checks.dataset())
    trainer.train()
    state = trainer.zero_engine.full_state_dict(dtype=torch.float32)
    files = sorted(p.name for p in (Path(folder) / f"checkpoint-{SAVE_AT}").iterdir())
    return {"log": logged(trainer), "step": trainer.state.global_step, "state": state, "files": files}


def fsdp_trainer_resumes(rank: int, world_size: int, checkpoint: str, state_dict_type: str) -> dict[str, Any]:
    """transformers' FSDP Trainer (forced on the CPU) resumes `checkpoint` and trains to the end."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import TrainingArguments

    from tests.integration.fsdp_on_cpu import fsdp_trainer_class

    plain_torchrun_environment()
    fsdp = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": state_dict_type}
    folder = Path(checkpoint).parent.parent / f"fsdp_from_{Path(checkpoint).parent.name}"
    args = TrainingArguments(fsdp="full_shard", fsdp_config=fsdp, **_args(folder))
    model = trainer_checks.tiny_llama(seed=7)
    trainer = fsdp_trainer_class()(model=model, args=args, train_dataset=trainer_checks.dataset())
    trainer.train(resume_from_checkpoint=checkpoint)
    full = get_model_state_dict(
        trainer.model_wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    state = {name: value.float() for name, value in full.items()} if rank == 0 else None
    return {"log": logged(trainer), "step": trainer.state.global_step, "state": state}
