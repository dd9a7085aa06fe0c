"""Memory accounting from the tensors actually held: each distinct storage counted once, under its first kind."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def bytes_by_kind(kinds: Mapping[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Sums the bytes of the distinct storages behind the tensors of each kind.

    A storage shared by several tensors (views, tied weights, fp32 master shards that are views of the
    parameters) is counted once, under the first kind that names it, so the kinds add up to `total`.

    Args:
        kinds: kind name -> tensors, in priority order.

    Returns:
        Bytes per kind, plus "total".
    """
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    for kind, tensors in kinds.items():
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[kind] = total
    out["total"] = sum(out.values())
    return out
