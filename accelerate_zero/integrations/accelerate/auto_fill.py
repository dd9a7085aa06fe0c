"""How `ZeroAccelerator.prepare` fills a config's "auto" values from the dataloaders and the model, as accelerate's
`_prepare_deepspeed` does (INTEGRATION_NOTES §3.3; same messages)."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn

from accelerate_zero.config import ZeroConfig
from accelerate_zero.config.hidden_size import HIDDEN_SIZE_KEYS, hidden_size_autos


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
