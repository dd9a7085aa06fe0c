"""Squared L2 norms of flat gradient buffers, exact to fp32 rounding whatever their size.

[Note: the norm of a large flat buffer]
A rank's gradient shard is one flat buffer of up to billions of elements. torch's fp32 norm of one large CPU tensor
accumulates in fp32 and drifts: -3.4e-3 relative at 50M elements, where `torch.nn.utils.clip_grad_norm_` on the
unflattened model (a norm per parameter) is exact to fp32 rounding. The clipping coefficient and the logged
grad_norm must not depend on how the gradients are flattened, so each buffer is cut into chunks small enough for an
fp32 norm to be exact to rounding, and the chunks' squares are summed in fp64 (-1.5e-7 relative at 50M elements,
about 0.1 s per 50M elements on one CPU core).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


CHUNK_NUMEL = 1 << 16
"""Elements per chunk: an fp32 sum of this many squares keeps its relative error near fp32 rounding."""


def sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The sum of the squares of every element of `tensors`, as a 0-dim fp64 tensor on `device`.

    Args:
        tensors: 1-D or contiguous tensors of any floating dtype (16-bit ones are norm-ed in fp32).
        device: where the result goes; default: the first tensor's device (the CPU when there is none).
    """
    chunks = [
        chunk
        for tensor in tensors
        if tensor.numel()
        for chunk in (tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float())
        .reshape(-1)
        .split(CHUNK_NUMEL)
    ]
    target = device if device is not None else (tensors[0].device if len(tensors) else torch.device("cpu"))
    if not chunks:
        return torch.zeros((), dtype=torch.float64, device=target)
    norms = torch.stack(torch._foreach_norm(chunks)).double()
    return norms.square().sum().to(target)
