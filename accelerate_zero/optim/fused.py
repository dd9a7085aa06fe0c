"""Which torch optimizers step with torch's fused kernel, and choosing it where the user did not choose.

The shard a rank steps is a few large flat tensors. torch's default implementation on the CPU is the per-tensor
loop, about 4x slower than the fused kernel for AdamW on one core (bench/host_adam.py, 50M fp32 elements: 542 vs
2144 Mparams/s; the foreach path 362); DDP users of the Trainer
get the fused kernel by default. The results agree to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from accelerate_zero.optim.chain import optimizers_in


# torch optimizers with a fused kernel per device type (torch >= 2.4).
FUSED_KERNELS: dict[str, tuple[str, ...]] = {
    "cpu": ("Adam", "AdamW", "SGD", "Adagrad"),
    "cuda": ("Adam", "AdamW", "SGD"),
}


def has_fused_kernel(optimizer: torch.optim.Optimizer, device_type: str) -> bool:
    """True when `optimizer` is one of torch.optim's classes with a fused kernel on `device_type`."""
    name = type(optimizer).__name__
    return type(optimizer).__module__.startswith("torch.optim") and name in FUSED_KERNELS.get(device_type, ())


def choose_fused_kernels(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], offloaded: bool) -> None:
    """Under optimizer offload every param group whose class has a fused CPU kernel uses it;
    otherwise the groups the user left unset get the fused kernel of the masters' device (`prefer_fused_step`).
    A chain (optim/chain.py) decides per optimizer it holds."""
    for each in optimizers_in(optimizer):
        if offloaded:
            _fused_on_cpu(each)
        else:
            prefer_fused_step(each, masters)


def _fused_on_cpu(optimizer: torch.optim.Optimizer) -> None:
    """The host step with torch's fused CPU kernel when the class has one; the others step as they are
    (`zero_force_ds_cpu_optimizer` was checked when the optimizer was adopted: engine/setup.py)."""
    if has_fused_kernel(optimizer, "cpu"):
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False


def prefer_fused_step(optimizer: torch.optim.Optimizer, tensors: Iterable[torch.Tensor]) -> bool:
    """Turns on the fused kernel for the param groups that left both `fused` and `foreach` unset (None).

    An explicit choice (`fused=False`, `foreach=True`, `differentiable=True`) is kept. Returns True when any
    group was switched.
    """
    devices = {t.device.type for t in tensors}
    floating = all(t.is_floating_point() for t in tensors)
    if len(devices) != 1 or not floating or not has_fused_kernel(optimizer, next(iter(devices))):
        return False
    switched = False
    for group in optimizer.param_groups:
        if group.get("fused") is None and group.get("foreach") is None and not group.get("differentiable", False):
            group["fused"], group["foreach"] = True, False
            switched = True
    return switched
