"""What `ZeroAccelerator` asks of accelerate's own setup: no other distributed backend, a process group under every
launcher (plain `torchrun` on CPU included) with the engine's timeout, and one process per rank."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from accelerate_zero.engine.groups import has_accelerator, process_group_timeout
from accelerate_zero.integrations.accelerate.deepspeed_env import adopt_accelerate_deepspeed_launch


_REFUSED_KWARGS = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin")


def refuse_other_backends(kwargs: dict[str, Any]) -> None:
    """Refuses `Accelerator` arguments asking for another backend; adopts `accelerate launch` with a DeepSpeed config.

    Raises:
        ValueError: a DeepSpeed/FSDP/Megatron-LM/tensor-parallel plugin or a `parallelism_config` was passed.
    """
    given = [name for name in _REFUSED_KWARGS if kwargs.get(name) is not None]
    if kwargs.get("parallelism_config") is not None:
        given.append("parallelism_config")
    if given:
        raise ValueError(f"ZeroAccelerator trains with accelerate_zero's ZeRO engine: remove {given}")
    adopt_accelerate_deepspeed_launch()  # `accelerate launch` with a DeepSpeed config: train with our engine


def with_process_group_setup(kwargs: dict[str, Any]) -> dict[str, Any]:
    """[Note: process group under plain torchrun] On a machine without an accelerator, accelerate only goes
    distributed (MULTI_CPU, gloo) when told the run is on CPU (`cpu=True` or ACCELERATE_USE_CPU, which
    `accelerate-zero launch` sets); under plain `torchrun` it reports DistributedType.NO and every rank trains alone.
    Passing `cpu=True` there is the narrowest fix: accelerate itself then forms the gloo group from
    RANK/WORLD_SIZE/MASTER_*, and reports the real world size and rank. In every launch mode the group gets the
    engine's timeout (ACCELERATE_ZERO_PG_TIMEOUT) unless the caller passed its own InitProcessGroupKwargs."""
    kwargs = dict(kwargs)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not has_accelerator() and PartialState._shared_state == {} and not dist.is_initialized():
        kwargs["cpu"] = True
    handlers = list(kwargs.get("kwargs_handlers") or [])
    if not any(isinstance(handler, InitProcessGroupKwargs) for handler in handlers):
        handlers.append(InitProcessGroupKwargs(timeout=process_group_timeout()))
    kwargs["kwargs_handlers"] = handlers
    return kwargs


def check_distributed_state(accelerator: Accelerator) -> None:
    """Checks, once accelerate is set up, that it runs no other backend and that every rank trains with the others.

    Raises:
        ValueError: accelerate is set up for DeepSpeed, FSDP or Megatron-LM (by the environment).
        RuntimeError: WORLD_SIZE says several ranks but accelerate was initialised for this process alone.
    """
    distributed_type = accelerator.distributed_type
    if distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"accelerate is set up for {distributed_type} (ACCELERATE_USE_* in the environment): "
            "ZeroAccelerator trains with accelerate_zero's engine; launch with `accelerate-zero launch` instead"
        )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes == 1 and world_size > 1:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but accelerate runs this process alone ({distributed_type}): "
            "accelerate was initialised (PartialState/Accelerator) before ZeroAccelerator without cpu=True, so "
            "every rank would train by itself. Create the ZeroAccelerator first, or launch with "
            "`accelerate-zero launch`"
        )
