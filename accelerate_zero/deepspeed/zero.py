"""`deepspeed.zero`: `Init`, `GatheredParameters`, `register_external_parameter`, with DeepSpeed 0.19.8's arguments.

`Init` partitions a model while it is built ([Note: partitioning while a model is built] in
engine/stage3/construction.py): no rank ever holds the whole model, and `initialize` turns the pieces into the
engine's stage-3 shards unit by unit. Unlike DeepSpeed's, every value equals an eager build's (the same code runs
with the same random state; a weight re-initialised after its module was partitioned is written whole), and
nothing is attached to the parameters (no `ds_id`, `ds_status`, `ds_numel`): their data is a 0-element
placeholder, as under DeepSpeed, until `GatheredParameters` or the engine gathers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accelerate_zero.config import ZeroConfig
from accelerate_zero.deepspeed.comm import init_distributed
from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable
from accelerate_zero.engine import gathered
from accelerate_zero.engine.gathered import register_external_parameter
from accelerate_zero.engine.groups import has_accelerator, init_data_parallel_group, resolve_device
from accelerate_zero.engine.stage3.construction import PartitionedConstruction


_REMOTE_DEVICES = (None, "none", "cpu", "nvme")


class Init:
    """Partitions the parameters of every module built inside the context (DeepSpeed's `zero.Init`).

    Args:
        module: an already built module to partition now (`model = zero.Init(module=model)` keeps the context
            object; the module is partitioned in place).
        data_parallel_group: None or the world group: parameters are partitioned over every rank (a smaller shard
            group is the config's `mics_shard_size`).
        mem_efficient_linear: accepted; gathered parameters are plain tensors, so `F.linear` needs no replacement.
        remote_device: where each rank's pieces live until `initialize`: None/"none" on the compute device, "cpu"
            (and "nvme": the engine writes them to files at `initialize`) in host memory. The config's
            `offload_param.device` takes precedence, as in DeepSpeed.
        pin_memory: page-locked host pieces (with an accelerator); the config's `offload_param.pin_memory` wins.
        config_dict_or_path: the DeepSpeed config (dict or path; checked as `initialize` checks it): its bf16/fp16
            block gives the dtype.
        config: the deprecated name of `config_dict_or_path`.
        enabled: False makes the context do nothing.
        dtype: the dtype floating-point parameters are kept in; default from the config (bf16, fp16, else fp32),
            without a config DeepSpeed's default (fp16 on an accelerator, bf16 on a CPU).

    Raises:
        DeepSpeedUnavailable: `mpu`, `zero_param_parallel_group`, a sub-group, quantized weights, a
            `param_swapper` or `tensor_overrides` (none is available).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        tensor_overrides: Any = None,
    ) -> None:
        _refuse_arguments(
            mpu=mpu,
            zero_param_parallel_group=zero_param_parallel_group,
            zero_quantized_weights=zero_quantized_weights or None,
            zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights or None,
            param_swapper=param_swapper,
            tensor_overrides=tensor_overrides,
        )
        for name, group in (
            ("data_parallel_group", data_parallel_group),
            ("sequence_data_parallel_group", sequence_data_parallel_group),
        ):
            if group is not None and group is not dist.group.WORLD:
                raise DeepSpeedUnavailable(
                    f"zero.Init({name}=<a sub-group>): not available, parameters are partitioned over every rank; "
                    "set mics_shard_size in the config for a smaller shard group"
                )
        self.enabled = enabled
        self._construction: PartitionedConstruction | None = None
        if not enabled:
            return
        zero = (
            ZeroConfig.from_any(config_dict_or_path if config_dict_or_path is not None else config)
            if (config_dict_or_path is not None or config is not None)
            else None
        )
        init_distributed()
        device = resolve_device(None)
        self._construction = PartitionedConstruction(
            init_data_parallel_group(device),
            dtype=_dtype(zero, dtype),
            device=device,
            shard_device=_shard_device(zero, remote_device, device),
            pin_memory=_pin_memory(zero, pin_memory),
        )
        if module is not None:
            self._construction.partition_module(module)

    def __enter__(self) -> None:
        if self._construction is not None:
            self._construction.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._construction is not None:
            self._construction.__exit__(*exc)


class GatheredParameters(gathered.GatheredParameters):
    """Gathers `params` for the duration of the context (DeepSpeed's `zero.GatheredParameters`).

    Args:
        params: a parameter or an iterable of them, of a model built under `Init` (before `initialize`) or trained
            by an engine; others are left as they are.
        modifier_rank: None to read only; otherwise the rank whose writes are kept: on exit its values reach every
            rank's piece (and the engine's fp32 master weights).
        fwd_module: also declares `params` as used by this module's forward (`register_external_parameter`).
        enabled: False makes the context do nothing.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        super().__init__(params, modifier_rank=modifier_rank, enabled=enabled)
        if enabled and fwd_module is not None:
            for param in self.params:
                register_external_parameter(fwd_module, param)


def _refuse_arguments(**values: Any) -> None:
    given = [name for name, value in values.items() if value is not None]
    if given:
        raise DeepSpeedUnavailable(
            f"zero.Init({', '.join(f'{name}=...' for name in given)}): not available in accelerate_zero (no model "
            "parallelism, no quantized or swapped construction, no tensor overrides); remove the argument(s)"
        )


def _dtype(zero: ZeroConfig | None, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"Invalid data type {dtype}, allowed values are [torch.half, torch.bfloat16, torch.float]"
            )
        return dtype
    if zero is None:
        return torch.float16 if has_accelerator() else torch.bfloat16
    if zero.bf16.enabled and zero.fp16.enabled:
        raise RuntimeError("bfloat16 and fp16 cannot be enabled at once")
    return torch.bfloat16 if zero.bf16.enabled else torch.float16 if zero.fp16.enabled else torch.float32


def _pin_memory(zero: ZeroConfig | None, pin_memory: bool) -> bool:
    offload = zero.zero_optimization.offload_param if zero is not None else None
    return offload.pin_memory if offload is not None else pin_memory


def _shard_device(zero: ZeroConfig | None, remote_device: str | None, device: torch.device) -> torch.device:
    offload = zero.zero_optimization.offload_param if zero is not None else None
    if offload is not None:
        remote_device = offload.device
    if remote_device not in _REMOTE_DEVICES:
        raise ValueError(f"zero.Init(remote_device={remote_device!r}): one of 'none', 'cpu', 'nvme'")
    return torch.device("cpu") if remote_device in ("cpu", "nvme") else device


def __getattr__(name: str) -> Any:
    hints = {
        "ZeroParamStatus": "parameters carry no ds_status: a parameter's data is a 0-element placeholder while "
        "partitioned; gather it with GatheredParameters",
        "ZeroParamType": "parameters carry no ds_* attributes",
        "DeepSpeedZeRoOffload": "the engine itself runs stage 3 without an optimizer (initialize without one)",
        "DeepSpeedTensorOverride": "tensor overrides are not available",
        "TiledLinear": "tiled linear layers are not available: stage 3 gathers one unit at a time",
        "TiledLinearReturnBias": "tiled linear layers are not available",
        "unwrap_model_for_generation": "call generate on engine.module (every rank) or gather with "
        "GatheredParameters(list(model.parameters()))",
        "unregister_external_parameter": "external parameters stay registered",
        "MiCS_Init": "set mics_shard_size in the config and use zero.Init",
        "partition_parameters": "use zero.Init / zero.GatheredParameters",
    }
    if name in hints:
        raise DeepSpeedUnavailable(f"deepspeed.zero.{name} is not available in accelerate_zero: {hints[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
