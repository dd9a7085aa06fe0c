"""Checks and builders that turn a resolved config, a model and an optimizer into the engine's inputs."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

from accelerate_zero.config import ZeroConfig
from accelerate_zero.offload.policy import use_fused_cpu_step
from accelerate_zero.optim.chain import optimizers_in
from accelerate_zero.optim.factory import build_lr_scheduler, build_optimizer
from accelerate_zero.optim.kinds import describe
from accelerate_zero.optim.muon import build_muon_with_adam, is_muon_block


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Keys that only mean something at stage 3; DeepSpeed ignores them below it, we say so.
_STAGE3_ONLY = (
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "pipeline_loading_checkpoint",
    "leaf_module",
)


def dtype_from_name(name: str | None) -> torch.dtype | None:
    return None if name is None else _DTYPES[name]


def check_implemented(config: ZeroConfig) -> None:
    """Warns about keys that do nothing at the config's stage. What this version cannot do is refused by
    `ZeroConfig.from_any` (config/schema.py REFUSED_FEATURES, config/deepspeed_keys.py), so that
    `accelerate-zero validate` and the launcher refuse it too."""
    _warn_inapplicable(config)


def _warn_inapplicable(config: ZeroConfig) -> None:
    zero = config.zero_optimization
    defaults = type(zero)()
    inert = []
    if zero.stage < 3:
        inert += [f"zero_optimization.{k}" for k in _STAGE3_ONLY if getattr(zero, k) != getattr(defaults, k)]
    offload = any(b is not None and b.device != "none" for b in (zero.offload_optimizer, zero.offload_param))
    if zero.sub_group_size != defaults.sub_group_size and not offload:
        inert.append("zero_optimization.sub_group_size (tiles the optimizer step of offloaded state only)")
    if zero.round_robin_gradients:
        inert.append("zero_optimization.round_robin_gradients (only reorders CPU-offloaded gradients)")
    if inert:
        warnings.warn(
            f"these keys have no effect at zero_optimization.stage={zero.stage} and are ignored: {', '.join(inert)}",
            stacklevel=3,
        )


def trainable_param_groups(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
    """The trainable parameters of each optimizer param group, checked against the model.

    Raises:
        ValueError: an optimizer parameter is not in the model, is listed twice (in one group, in two groups, or in
            two optimizers of a chain), or a trainable model parameter is in no group.
    """
    names = {param: name for name, param in module.named_parameters()}
    groups, seen, listed = [], set(), {}
    for index, group in enumerate(optimizer.param_groups):
        params = []
        for param in group["params"]:
            if param not in names:
                raise ValueError(
                    f"optimizer param group {index} holds a tensor of shape {tuple(param.shape)} that is not a "
                    "parameter of the model passed to accelerate_zero.initialize: build the optimizer over "
                    "model.parameters()"
                )
            if param in listed:
                raise ValueError(
                    f"parameter {names[param]!r} is in optimizer param groups {listed[param]} and {index}: it would "
                    "be stepped twice; list every parameter in exactly one group (of one optimizer of a chain)"
                )
            listed[param] = index
            if param.requires_grad:
                params.append(param)
                seen.add(param)
        groups.append(params)
    missing = sorted(name for param, name in names.items() if param.requires_grad and param not in seen)
    if missing:
        raise ValueError(
            f"these trainable parameters are in no optimizer param group: {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}; add them to the optimizer or set requires_grad=False"
        )
    return groups


def build_optimizer_for(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, config: ZeroConfig
) -> torch.optim.Optimizer:
    """The user's optimizer (checked) or one built from the config's `optimizer` block."""
    if optimizer is not None and config.optimizer is not None:
        raise ValueError(
            f"an optimizer was passed in code ({type(optimizer).__name__}) and the config has an optimizer block "
            f"(type={config.optimizer.type!r}): remove one of them"
        )
    if optimizer is None:
        if config.optimizer is None:
            raise ValueError("no optimizer: pass one to accelerate_zero.initialize or add an optimizer block")
        if is_muon_block(config.optimizer.type):
            return build_muon_with_adam(module, config.optimizer.params)  # optim/muon.py: DeepSpeed's Muon block
        trainable = [p for p in module.parameters() if p.requires_grad]
        return build_optimizer([{"params": trainable}], config.optimizer.type, config.optimizer.params)
    # zero_allow_untested_optimizer keeps DeepSpeed's meaning: it admits a class, and never chooses its step layout
    # ([Note: which optimizers step flat shards] in optim/kinds.py).
    for each in optimizers_in(optimizer):
        if not type(each).__module__.startswith("torch.optim") and not config.zero_allow_untested_optimizer:
            raise ValueError(
                f"{describe(type(each))} is not one of torch.optim's optimizers: set "
                '"zero_allow_untested_optimizer": true in the config to use it with ZeRO'
            )
        offload = config.zero_optimization.offload_optimizer
        if offload is not None and offload.device != "none" and config.zero_force_ds_cpu_optimizer:
            use_fused_cpu_step(each, force_fast=True)  # DeepSpeed refuses a client optimizer without a fast host step
    return optimizer


def build_lr_scheduler_for(optimizer: torch.optim.Optimizer, lr_scheduler: Any, config: ZeroConfig) -> Any:
    """The user's scheduler, one made by the user's callable, or one built from the `scheduler` block."""
    if lr_scheduler is not None and config.scheduler is not None:
        raise ValueError(
            f"an LR scheduler was passed in code and the config has a scheduler block "
            f"(type={config.scheduler.type!r}): remove one of them"
        )
    if config.scheduler is not None:
        return build_lr_scheduler(optimizer, config.scheduler.type, config.scheduler.params)
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
        return lr_scheduler(optimizer)
    return lr_scheduler


def cast_floating_inputs(obj: Any, dtype: torch.dtype) -> Any:
    """Casts every floating-point tensor inside nested tuples, lists and dicts to `dtype` (other values as given)."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating_inputs(item, dtype) for item in obj)
    if isinstance(obj, dict):
        return {key: cast_floating_inputs(value, dtype) for key, value in obj.items()}
    return obj


def has_constructor_state_only(optimizer: torch.optim.Optimizer) -> bool:
    """True when every state the optimizer holds equals what its constructor makes (Adagrad's `sum` and `step`):
    such an optimizer was never stepped, and its state can be made again for the shards.

    A fresh optimizer of the same class and param groups is built over zero parameters shaped like the state;
    anything that differs (a stepped optimizer) or cannot be rebuilt counts as real state.
    """
    pairs, groups = [], []
    for group in optimizer.param_groups:
        dummies = []
        for param in group["params"]:
            tensors = [v for v in optimizer.state.get(param, {}).values() if torch.is_tensor(v) and v.ndim > 0]
            like = max(tensors, key=torch.Tensor.numel) if tensors else param
            dummy = nn.Parameter(torch.zeros(like.shape, dtype=like.dtype, device=like.device))
            dummies.append(dummy)
            pairs.append((param, dummy))
        groups.append({**group, "params": dummies})
    try:
        fresh = _rebuild(optimizer, groups)
    except Exception:  # a constructor that does not take param groups: the state cannot be proven fresh
        return False
    return all(_same_state(optimizer.state.get(p, {}), fresh.state.get(d, {})) for p, d in pairs)


def _same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if torch.is_tensor(value) != torch.is_tensor(other):
            return False
        if torch.is_tensor(value):
            if value.shape != other.shape or not torch.equal(value.cpu(), other.cpu()):
                return False
        elif value != other:
            return False
    return True


def constructor_state(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """The state the optimizer's constructor makes for its current parameters (after they became the shards)."""
    return dict(_rebuild(optimizer, [dict(group) for group in optimizer.param_groups]).state)


def _rebuild(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    # Constructors read some values from their arguments, not the groups (Adagrad's initial_accumulator_value).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"})


def keep_generate_in_step(module: nn.Module) -> None:
    """Makes transformers' `generate()` keep every rank stepping until the longest sequence is done (`synced_gpus`),
    for an engine whose every forward is a collective (stage 3's gathers, expert parallelism's all-to-alls).
    transformers enables it for a model flagged `_is_fsdp_managed_module`, and reads the flag on the model whose
    `generate` runs: a wrapper's (peft's `PeftModel.generate` calls its base model's), so every module with a
    `generate` is flagged, not only the root. torch.compile reads the flag too: it traces a flagged module as one
    FSDP manages, which it refuses unless `_fsdp_use_orig_params` is set (FSDP2 sets both): our parameters are the
    model's own, as with `use_orig_params`."""
    for each in module.modules():
        if each is module or callable(getattr(each, "generate", None)):
            each._is_fsdp_managed_module = True
            each._fsdp_use_orig_params = True


TARGET_KWARGS = frozenset({"labels", "label"})
"""Keyword arguments of a forward that `cast_forward_inputs` leaves in their dtype: they hold targets, not inputs."""


def forward_input_dtype(config: ZeroConfig) -> torch.dtype | None:
    """The dtype floating-point forward inputs are cast to ([Note: casting forward inputs]); None: no cast.

    bf16 casts always; fp16 when `fp16.auto_cast` is true (accelerate's `mixed_precision="fp16"` sets it).
    """
    if config.bf16.enabled:
        return torch.bfloat16
    if config.fp16.enabled and config.fp16.auto_cast:
        return torch.float16
    return None


def cast_forward_inputs(args: tuple, kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[tuple, dict[str, Any]]:
    """The forward's arguments with their floating-point tensors cast to `dtype`, targets (`TARGET_KWARGS`) kept.

    [Note: casting forward inputs] The engine keeps the model's weights in the 16-bit compute dtype (as DeepSpeed
    does), so a float32 tensor reaching the first layer fails ("mat1 and mat2 must have the same dtype"). What the
    others do: DeepSpeed's engine casts floating inputs to fp16 under `fp16.auto_cast` only, and nothing under bf16
    (transformers' vision models cast `pixel_values` to the weight dtype themselves for that reason); accelerate's
    DeepSpeed path adds no cast; transformers' Trainer under DeepSpeed casts every floating tensor of the batch,
    labels included. We cast at the model's entry, under bf16 always and under fp16 as `auto_cast` says:
    - every floating-point tensor in the positional and keyword arguments (nested tuples, lists, dicts), so a
      plain module fed float32 batches from a DataLoader works at every stage;
    - integer and bool tensors (token ids, masks, class labels) are never touched;
    - keyword targets (`labels=`) keep their dtype: torch's losses promote 16-bit outputs with float32 targets to
      float32, while a cast would round regression targets to bf16's 8 significant bits (3.14159 -> 3.140625);
    - only the entry: tensors the model computes inside keep the dtype it gives them (a model that keeps its
      residual stream in float32 still can), and a sub-module called directly gets its inputs as passed.
    """
    kept = {key: value for key, value in kwargs.items() if key in TARGET_KWARGS}
    cast = cast_floating_inputs({key: value for key, value in kwargs.items() if key not in TARGET_KWARGS}, dtype)
    return cast_floating_inputs(args, dtype), {key: kept[key] if key in kept else cast[key] for key in kwargs}
