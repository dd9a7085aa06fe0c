"""How `ZeroAccelerator.prepare` fills a config's "auto" values and pairs models with optimizers, as accelerate's
`_prepare_deepspeed` does (INTEGRATION_NOTES §3.3; same messages)."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils.deepspeed import DummyOptim  # importable without deepspeed
from torch import nn

from accelerate_zero.config import ZeroConfig
from accelerate_zero.config.hidden_size import HIDDEN_SIZE_KEYS, hidden_size_autos
from accelerate_zero.integrations.accelerate.prepared import PreparedModel


def micro_batch_size(acc: Accelerator, args: tuple, required: bool) -> int | None:
    """`train_micro_batch_size_per_gpu` from the dataloaders (accelerate's `_prepare_deepspeed` step 1, messages
    included); None when nothing says and the caller can do without (`required=False`)."""
    sizes = [obj.batch_size for obj in args if isinstance(obj, torch.utils.data.DataLoader)]
    if any(size is None for size in sizes) and required:
        raise ValueError(
            "At least one of the dataloaders passed to `accelerate.prepare()` has `None` as batch size. "
            "Please set an integer value in `train_micro_batch_size_per_gpu` in the DeepSpeed config."
        )
    if sizes and None not in sizes:
        return min(size // acc.num_processes if acc.split_batches else size for size in sizes)
    # A dataloader prepared in an earlier call (the Trainer prepares it before the model).
    earlier = [d.total_batch_size // acc.num_processes for d in acc._dataloaders if hasattr(d, "total_batch_size")]
    if earlier or not required:
        return min(earlier, default=None)
    raise ValueError(
        "When using ZeRO, `accelerate.prepare()` requires you to pass at least one of training or evaluation "
        "dataloaders with `batch_size` attribute returning an integer value (in this or an earlier call) or "
        "alternatively set an integer value in `train_micro_batch_size_per_gpu` in the DeepSpeed config."
    )


def without_optimizer_blocks(config: ZeroConfig) -> ZeroConfig:
    """The config of a model prepared for inference: no optimizer/scheduler block (as transformers'
    `deepspeed_init(inference=True)`), so their "auto" values need no filling."""
    raw = config.to_dict()
    raw.pop("optimizer", None)
    raw.pop("scheduler", None)
    return ZeroConfig.from_any(raw)


def pair_optimizers(args: tuple, models: list[int], optimizers: list[int], prepared: list[PreparedModel]) -> dict:
    """model index -> the index of the optimizer over its parameters (each optimizer belongs to exactly one model)."""
    owner_of = {id(p): i for i in models for p in args[i].parameters()}
    pairs: dict[int, int] = {}
    for opt_index in optimizers:
        params = optimizer_params(args[opt_index])
        owners = {owner_of.get(id(p)) for p in params}
        if len(owners) != 1 or None in owners:
            earlier = any(any(p is q for q in e.model.parameters()) for e in prepared for p in params[:1])
            raise ValueError(
                "an optimizer was passed to prepare() without the model owning all its parameters"
                + (" (its model was prepared earlier without an optimizer, for inference)" if earlier else "")
                + ": with ZeroAccelerator a model and its optimizer must be passed together to the same prepare() call"
            )
        model_index = owners.pop()
        if model_index in pairs:
            raise ValueError("several optimizers for one model: the ZeRO engine steps one optimizer per model")
        pairs[model_index] = opt_index
    return pairs


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    if isinstance(optimizer, DummyOptim):
        groups = list(optimizer.params)
        return [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return [p for group in optimizer.param_groups for p in group["params"]]


def hidden_size_values(model: nn.Module, config: ZeroConfig) -> dict[str, int]:
    """accelerate's hidden-size "auto" values (`_prepare_deepspeed` step 5), with its messages."""
    autos = config.auto_keys()
    wanted = [key for key in HIDDEN_SIZE_KEYS if key in autos]
    if config.zero_optimization.stage != 3:
        wanted = [key for key in wanted if "stage3_" not in key]
    if not wanted:
        return {}
    reasoning = (
        "therefore it's not possible to automatically fill out the following `auto` entries in the DeepSpeed config "
        f"file: {wanted}. You can fix that by replacing `auto` values for these keys with an integer value of your "
        "choice."
    )
    model_config = getattr(model, "config", None)
    if model_config is None:
        raise ValueError("Can't find `model.config` entry, " + reasoning)
    if hasattr(model_config, "hidden_size"):
        hidden = model_config.hidden_size
    elif hasattr(model_config, "hidden_sizes"):
        hidden = max(model_config.hidden_sizes)
    else:
        raise ValueError("Can find neither `model.config.hidden_size` nor `model.config.hidden_sizes`, " + reasoning)
    values = hidden_size_autos(hidden)
    return {key: values[key] for key in wanted}
