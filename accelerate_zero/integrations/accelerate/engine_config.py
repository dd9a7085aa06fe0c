"""The config each engine `ZeroAccelerator.prepare` builds gets: the plugin's config with accelerate's mixed precision,
checked against the objects passed with the model, every "auto" filled as accelerate's `_prepare_deepspeed` does
(INTEGRATION_NOTES §3.3; same messages), resolved for the world size."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # importable without deepspeed
from torch import nn

from accelerate_zero.config import ResolvedZeroConfig, ZeroConfig, ZeroConfigError, data_parallel_ranks, resolve_config
from accelerate_zero.config.schema import is_auto
from accelerate_zero.integrations.accelerate.auto_fill import (
    hidden_size_values,
    micro_batch_size,
    without_optimizer_blocks,
)
from accelerate_zero.integrations.accelerate.launch_config import build_deepspeed_config
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin


def config_with_precision(plugin: ZeroPlugin, mixed_precision: str) -> ZeroConfig:
    """The plugin's config with accelerate's `mixed_precision` applied as `DeepSpeedPlugin.set_mixed_precision` does:
    on the config as written, where an absent fp16/bf16 block differs from a disabled one.

    Raises:
        ZeroConfigError: the config with this mixed precision is invalid.
    """
    settings = dataclasses.replace(plugin._settings(), mixed_precision=mixed_precision)
    return build_deepspeed_config(settings).zero_config


def check_objects(config: ZeroConfig, args: tuple, optimizer: Any, scheduler: DummyScheduler | None) -> None:
    """accelerate's DeepSpeed checks between the config and the optimizer/scheduler objects (same messages).

    Raises:
        ValueError: the config and the objects both give an optimizer or a scheduler, or neither does where one is
            needed (`DummyOptim`/`DummyScheduler` without a config block), or `DummyOptim` has param groups.
    """
    if optimizer is not None and config.optimizer is not None and not isinstance(optimizer, DummyOptim):
        raise ValueError(
            "You cannot specify an optimizer in the config file and in the code at the same time. Please remove "
            "the optimizer from the config file or create `accelerate.utils.DummyOptim` in the code."
        )
    if isinstance(optimizer, DummyOptim) and config.optimizer is None:
        raise ValueError("You cannot create a `DummyOptim` without specifying an optimizer in the config file.")
    if isinstance(optimizer, DummyOptim) and any(isinstance(group, dict) for group in optimizer.params):
        raise ValueError(
            "DummyOptim with param groups: the engine builds the config's optimizer over all trainable "
            "parameters; pass a torch optimizer with your groups instead and remove the config's optimizer block"
        )
    torch_schedulers = [obj for obj in args if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)]
    if config.scheduler is not None and any(s.optimizer is optimizer for s in torch_schedulers):
        raise ValueError(
            "You cannot specify a scheduler in the config file and in the code at the same time. Please remove "
            "the scheduler from the config file or create `accelerate.utils.DummyScheduler` in the code."
        )
    if scheduler is not None and config.scheduler is None and scheduler.lr_scheduler_callable is None:
        raise ValueError(
            "Either specify a scheduler in the config file or pass in the `lr_scheduler_callable` parameter when "
            "using `accelerate.utils.DummyScheduler`."
        )
    if isinstance(optimizer, DummyOptim) and any(s.optimizer is optimizer for s in torch_schedulers):
        raise ValueError(
            "You can only specify `accelerate.utils.DummyScheduler` in the code when using "
            "`accelerate.utils.DummyOptim`."
        )


def engine_config(
    accelerator: Accelerator,
    config: ZeroConfig,
    model: nn.Module,
    optimizer: Any,
    scheduler: DummyScheduler | None,
    args: tuple,
) -> ResolvedZeroConfig:
    """`config` with every "auto" filled as accelerate's `_prepare_deepspeed` does (steps 1-6), resolved for this
    world size.

    Args:
        accelerator: gives the dataloaders' batch size, the accumulation steps, the world size and `split_batches`.
        config: the accelerator's config (its optimizer/scheduler blocks are dropped for a model without optimizer).
        model: the model (hidden-size bucket values).
        optimizer: its optimizer (torch or `DummyOptim`); None: prepared for inference.
        scheduler: the `DummyScheduler` passed with it, or None.
        args: every object passed to `prepare` (the dataloaders).

    Raises:
        ZeroConfigError: a value is still "auto" with nothing to fill it from (accelerate's message per key).
    """
    config = config if optimizer is not None else without_optimizer_blocks(config)
    values: dict[str, Any] = {
        "gradient_clipping": 1.0,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
    }
    micro = config.train_micro_batch_size_per_gpu
    if is_auto(micro):
        # A model prepared for inference needs no batch size (accelerate's `set_deepspeed_weakref` uses 1).
        micro = micro_batch_size(accelerator, args, required=optimizer is not None) or 1
        values["train_micro_batch_size_per_gpu"] = micro
    ga = config.gradient_accumulation_steps
    ga = accelerator.gradient_accumulation_steps if is_auto(ga) else ga
    if isinstance(micro, int) and isinstance(ga, int):
        values["train_batch_size"] = micro * ga * data_parallel_ranks(config, accelerator.num_processes)
    values.update(hidden_size_values(model, config))
    values.update(optimizer_values(optimizer, scheduler, accelerator))
    filled = config.fill_auto(values)
    below_3 = filled.zero_optimization.stage != 3  # resolve_config gives stage3_* "auto" values their defaults
    left = [key for key in filled.auto_keys() if not (below_3 and key.startswith("zero_optimization.stage3_"))]
    if left:
        raise ZeroConfigError(
            [
                f"`{key}` not found in kwargs. Please specify `{key}` without `auto` (set to correct value) in the "
                "DeepSpeed config (ZeroPlugin(config=...) or the launcher's deepspeed_config_file)."
                for key in left
            ]
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        filled.zero_allow_untested_optimizer = True  # accelerate sets it for any client optimizer
    return resolve_config(filled, world_size=accelerator.num_processes)


def optimizer_values(optimizer: Any, scheduler: DummyScheduler | None, accelerator: Accelerator) -> dict[str, Any]:
    """ "auto" values of the config's optimizer/scheduler blocks, from the objects passed (fill_auto skips a
    block the config does not have)."""
    values: dict[str, Any] = {}
    if isinstance(optimizer, DummyOptim):
        values["optimizer.params.lr"] = optimizer.lr
        values["optimizer.params.weight_decay"] = optimizer.weight_decay
        lr = optimizer.lr
    else:
        lr = optimizer.defaults.get("lr") if isinstance(optimizer, torch.optim.Optimizer) else None
    if lr is not None:
        values.update({"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": lr})
    if scheduler is not None and scheduler.lr_scheduler_callable is None:
        values["scheduler.params.warmup_num_steps"] = max(1, scheduler.warmup_num_steps)
        if scheduler.total_num_steps is not None:
            total = scheduler.total_num_steps
            values["scheduler.params.total_num_steps"] = (
                total if accelerator.split_batches else math.ceil(total / accelerator.num_processes)
            )
    return values
