"""Where a bucket keeps its averaged gradient slice until the optimizer step: the contract and its device homes.

[Note: a reduced gradient has one home]
After its reduction a bucket hands the averaged slice this rank steps to a `KeptGradient`, and the optimizer reads
it back from there; the bucket never asks where that is ([Note: offload is a store, not a flag] in
engine/stores.py). The homes:
- `ReducedInPlace` (stages 0/1): the reduction wrote the averaged values into the bucket's own full-size buffer,
  which stays until the step; the home just remembers that view.
- `DeviceShardGradient` (stages 2/3): a shard-sized buffer on the compute device that micro-steps accumulate into.
- `HostGradient` (engine/host_grads.py, `offload_optimizer`): the slice in host memory, filled by asynchronous copies.
- a slot of `NvmeGradStore` (offload/nvme_grads.py, `offload_optimizer` on NVMe, stages 2/3): the slice in a file.
The composition root (engine/assemble.py) picks the home of every bucket when it is built.
"""

from __future__ import annotations

from typing import Protocol

import torch

from accelerate_zero.engine.norms import sum_of_squares


def fold_into(destination: torch.Tensor, source: torch.Tensor, scale: float, fresh: bool) -> None:
    """`destination` = `source * scale` (`fresh`) or `destination += source * scale`, one pass over memory
    (how a home on the device, or in host memory on a CPU device, adds a reduction)."""
    if not fresh:
        destination.add_(source, alpha=scale)
    elif scale != 1.0:
        torch.mul(source, scale, out=destination)
    else:
        destination.copy_(source)


class KeptGradient(Protocol):
    """One bucket's averaged gradient slice (`numel` elements), kept from its reduction to the optimizer step."""

    numel: int
    in_host: bool
    """The slice lives outside the compute device's memory (accounted as host gradients)."""

    def add(self, reduced: torch.Tensor, post: float, fresh: bool) -> None:
        """Adds `reduced * post` (`reduced`: on the compute device, not to be written by the caller until the next
        `settle`); `fresh` replaces what an earlier step or micro-step left."""
        ...

    def read(self, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the slice, complete."""
        ...

    def square_norm(self, device: torch.device) -> torch.Tensor:
        """The sum of squares of the slice (fp64, 0-dim, on `device`; [Note: the norm of a large flat buffer])."""
        ...

    def clear(self) -> None:
        """The slice becomes zeros (a step in which this rank reduced nothing into it)."""
        ...

    def settle(self) -> None:
        """No copy in flight still reads a tensor handed to `add` (before the bucket reuses or frees it)."""
        ...

    def reset(self) -> None:
        """After the step: settle, and release memory that is allocated on use."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The storage this home holds of its own (for memory accounting)."""
        ...


class ReducedInPlace:
    """Stages 0/1 without offload: the averaged values are a view of the bucket's full-size buffer."""

    in_host = False

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._view: torch.Tensor | None = None

    def add(self, reduced: torch.Tensor, post: float, fresh: bool) -> None:
        assert fresh and post == 1.0, "a reduction in place writes the whole slice, already averaged"
        self._view = reduced

    def read(self, start: int, end: int) -> torch.Tensor:
        assert self._view is not None, "read() before the bucket was reduced"
        return self._view[start:end]

    def square_norm(self, device: torch.device) -> torch.Tensor:
        return sum_of_squares([self.read(0, self.numel)], device)

    def clear(self) -> None:
        raise AssertionError("a bucket reduced in place reads its own buffer when it was not reduced")

    def settle(self) -> None:
        pass

    def reset(self) -> None:
        self._view = None

    def tensors(self) -> list[torch.Tensor]:
        return []  # the bucket's own buffer


class DeviceShardGradient:
    """Stages 2/3 without offload: a shard-sized buffer on the compute device, accumulated over micro-steps.

    `storage` (`contiguous_gradients`) is a view of one flat buffer kept for the whole run; otherwise the buffer is
    allocated on first use and released after each step."""

    in_host = False

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, storage: torch.Tensor | None = None
    ) -> None:
        self.numel, self.dtype, self.device, self._storage = numel, dtype, device, storage
        self.values: torch.Tensor | None = storage

    def add(self, reduced: torch.Tensor, post: float, fresh: bool) -> None:
        if self.values is None:
            self.values = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        fold_into(self.values, reduced, post, fresh)

    def read(self, start: int, end: int) -> torch.Tensor:
        assert self.values is not None, "read() before anything was added or cleared"
        return self.values[start:end]

    def square_norm(self, device: torch.device) -> torch.Tensor:
        return sum_of_squares([self.read(0, self.numel)], device)

    def clear(self) -> None:
        if self.values is None:
            self.values = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        else:
            self.values.zero_()

    def settle(self) -> None:
        pass

    def reset(self) -> None:
        if self._storage is None:
            self.values = None

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.values is None else [self.values]
