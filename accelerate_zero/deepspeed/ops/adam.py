"""`deepspeed.ops.adam.FusedAdam` and `DeepSpeedCPUAdam` with DeepSpeed's arguments, built as torch's optimizers.

The engine runs any torch optimizer (fused on the device, fused on the host under CPU offload: offload/policy.py),
so DeepSpeed's kernels are replaced by the torch optimizer computing the same update: `adam_w_mode=True` (the
default) is `torch.optim.AdamW`, False is `torch.optim.Adam` (L2 weight decay). What torch's optimizers cannot
express is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable


def FusedAdam(  # noqa: N802 (DeepSpeed's class name: scripts call it)
    params: Iterable[Any],
    lr: float = 1e-3,
    bias_correction: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    adam_w_mode: bool = True,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    set_grad_none: bool = True,
) -> torch.optim.Optimizer:
    """DeepSpeed's `FusedAdam(...)`: `torch.optim.AdamW` (or `Adam` with `adam_w_mode=False`) with these values.

    `set_grad_none` is accepted: the engine owns gradients and drops them after each step either way.

    Raises:
        DeepSpeedUnavailable: `bias_correction=False` (torch's Adam always corrects) or `amsgrad=True` (DeepSpeed's
            FusedAdam refuses it too).
    """
    if amsgrad:
        raise DeepSpeedUnavailable("FusedAdam does not support the AMSGrad variant.")
    return _adam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, "FusedAdam")


def DeepSpeedCPUAdam(  # noqa: N802
    model_params: Iterable[Any],
    lr: float = 1e-3,
    bias_correction: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    adamw_mode: bool = True,
    fp32_optimizer_states: bool = True,
) -> torch.optim.Optimizer:
    """DeepSpeed's `DeepSpeedCPUAdam(...)`: the same torch optimizer as `FusedAdam`; under `offload_optimizer` the
    engine steps it on the host with torch's fused CPU kernel.

    Raises:
        DeepSpeedUnavailable: `bias_correction=False`, `amsgrad=True` or `fp32_optimizer_states=False`.
    """
    if amsgrad:
        raise DeepSpeedUnavailable(
            "DeepSpeedCPUAdam(amsgrad=True): not available; use torch.optim.AdamW(amsgrad=True)"
        )
    if not fp32_optimizer_states:
        raise DeepSpeedUnavailable(
            "DeepSpeedCPUAdam(fp32_optimizer_states=False): not available, optimizer states are kept in fp32"
        )
    return _adam(model_params, lr, bias_correction, betas, eps, adamw_mode, weight_decay, "DeepSpeedCPUAdam")


def _adam(
    params: Iterable[Any],
    lr: float,
    bias_correction: bool,
    betas: tuple[float, float],
    eps: float,
    decoupled: bool,
    weight_decay: float,
    name: str,
) -> torch.optim.Optimizer:
    if not bias_correction:
        raise DeepSpeedUnavailable(
            f"{name}(bias_correction=False): not available, torch's Adam always applies bias correction"
        )
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
