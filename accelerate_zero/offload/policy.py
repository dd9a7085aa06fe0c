"""Where the optimizer's state and the partitioned parameters live: a policy decided once, at construction.

With `offload_optimizer.device: cpu` every fp32 master slice and its optimizer state live in host memory (pinned
when the compute device is a GPU, so copies can overlap), each gradient bucket accumulates its averaged slice
into a host fp32 buffer as soon as its reduction finishes, the optimizer steps on the CPU with torch's fused
kernel when the optimizer class has one, and the updated slices are copied back into the parameters. With
`offload_param.device: cpu` (stage 3) each unit's shard lives in host memory and is copied to the device right
before its all-gather; with `nvme` it lives in a file and is read into host memory for that (offload/nvme_params.py).
On a CPU-only machine the same code runs; the copies are host-to-host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from accelerate_zero.config import ZeroConfig
from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.offload.host_memory import HostMemory
from accelerate_zero.optim.fused import FUSED_KERNELS, has_fused_kernel


@dataclass(frozen=True)
class OffloadPolicy:
    optimizer: bool
    """fp32 master weights, optimizer states and their gradients live in host memory."""
    params: bool
    """Stage 3 parameter shards live in host memory."""
    pin_memory: bool
    """Page-locked host buffers; only used when the compute device is a GPU."""
    nvme_path: str | None = None
    """With offload_optimizer.device=nvme: masters and optimizer state live in files there (offload/nvme.py)."""
    buffer_count: int = 4
    param_nvme_path: str | None = None
    """With offload_param.device=nvme: stage-3 parameter shards live in files there (offload/nvme_params.py)."""


def offload_policy(config: ZeroConfig) -> OffloadPolicy:
    zero = config.zero_optimization
    opt = zero.offload_optimizer
    optimizer = opt is not None and opt.device in ("cpu", "nvme")
    params = zero.offload_param is not None and zero.offload_param.device in ("cpu", "nvme")
    pins = [b.pin_memory for b in (opt, zero.offload_param) if b is not None and b.device != "none"]
    nvme = opt.nvme_path if opt is not None and opt.device == "nvme" else None
    return OffloadPolicy(
        optimizer=optimizer,
        params=params,
        pin_memory=all(pins) if pins else False,
        nvme_path=nvme,
        buffer_count=opt.buffer_count if opt is not None else 4,
        param_nvme_path=zero.offload_param.nvme_path if params and zero.offload_param.device == "nvme" else None,
    )


def offload_masters(
    slices_by_group: list[list[ShardSlice]],
    policy: OffloadPolicy,
    values: Callable[[ShardSlice], torch.Tensor],
    memory: HostMemory,
) -> list[list[ShardSlice]]:
    """The same slices with their fp32 master in host memory (one contiguous host buffer per param group; under
    NVMe offload one placeholder tensor per slice, so a swapped-out slice frees its memory). `values` gives a
    slice's parameter values (its shard may be in a file: offload/nvme_params.py)."""
    if policy.nvme_path is not None:
        # Placeholders: NvmeSwapper fills them from the parameters one sub-group at a time and writes them out,
        # so the whole fp32 shard is never in memory at once.
        return [
            [ShardSlice(s.bucket, s.start, s.end, torch.empty(0), s.params) for s in slices]
            for slices in slices_by_group
        ]
    out = []
    for slices in slices_by_group:
        flat = memory.zeros(sum(s.end - s.start for s in slices), torch.float32)
        pieces = flat.split([s.end - s.start for s in slices]) if slices else []
        moved = []
        for shard_slice, master in zip(slices, pieces, strict=True):
            master.copy_(values(shard_slice))
            moved.append(
                ShardSlice(shard_slice.bucket, shard_slice.start, shard_slice.end, master, shard_slice.params)
            )
        out.append(moved)
    return out


def use_fused_cpu_step(optimizer: torch.optim.Optimizer, force_fast: bool) -> None:
    """Makes the optimizer step its host state with torch's fused CPU kernel.

    Raises:
        ValueError: the optimizer class has no fused CPU kernel and `zero_force_ds_cpu_optimizer` is true
            (DeepSpeed's guard against slow client optimizers under offload).
    """
    name = type(optimizer).__name__
    if has_fused_kernel(optimizer, "cpu"):
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
        return
    if force_fast:
        raise ValueError(
            f"offload_optimizer steps {name} on the CPU without a fused kernel, which is slow: use one of "
            f'{", ".join(FUSED_KERNELS["cpu"])} from torch.optim, or set "zero_force_ds_cpu_optimizer": false to accept it'
        )
