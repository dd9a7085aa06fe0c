"""Where a bucket keeps its averaged gradient slice until the optimizer step: the contract and its device homes.

[Note: a reduced gradient has one home]
After its reduction a bucket hands the averaged slice this rank steps to a `KeptGradient`, and the optimizer reads
it back from there; the bucket never asks where that is ([Note: offload is a store, not a flag] in
engine/stores.py). The homes:
- `ReducedInPlace` (stages 0/1): the reduction wrote the averaged values into the bucket's own full-size buffer,
  which stays until the step; the home just remembers that view.
- `DeviceShardGradient` (stages 2/3): a shard-sized buffer on the compute device that micro-steps accumulate into,
  released after the step.
- `HostGradient` (engine/host_grads.py, `offload_optimizer`): the slice in host memory, filled by asynchronous copies.
- a slot of `NvmeGradStore` (offload/nvme_grads.py, `offload_optimizer` on NVMe, stages 2/3): the slice in a file.
The composition root (engine/assemble.py) picks the home of every bucket when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from accelerate_zero.engine.norms import sum_of_squares
from accelerate_zero.engine.scratch import device_empty


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


# [Note: gradients live from the first backward to the optimizer step]
# Between optimizer steps no rank needs a gradient: the step read and cleared them. FSDP2 frees its sharded
# gradients at `zero_grad(set_to_none=True)` and DeepSpeed allocates its gradients in backward; keeping ours would
# hold them through evaluation, generation and checkpoints, memory those could use: 4 bytes per parameter / W at
# stages 2-3 (a quarter of fp32 AdamW's state), 4 bytes per parameter at stages 0-1 (the full gradient, which also
# sat allocated from `initialize` to the first backward). So every gradient buffer is allocated by the first
# backward of a step (stages 0-1: the full buffer the cycle accumulates into; stages 2-3: the shard, by the first
# reduction) and released when the engine zeroes the gradients after its step. `contiguous_gradients` (DeepSpeed's
# default) keeps its meaning, one buffer for the buckets instead of one per bucket (fewer allocations, no
# fragmentation): a `GradArena`, allocated when its first bucket takes a slot and freed when its last one gives the
# slot back. Measured in bench/user_load.py (stage 3) and bench/phase_peaks.py (stages 0-2).
class GradArena:
    """One flat buffer that several buckets' gradients are cut from (`contiguous_gradients`), allocated while at
    least one of them holds its slot."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self._flat: torch.Tensor | None = None
        self._holders = 0

    def take(self, offset: int, numel: int) -> torch.Tensor:
        """The slot [offset, offset + numel), uninitialised; allocates the buffer for the first holder."""
        assert 0 <= offset and offset + numel <= self.numel, "a slot outside the arena"
        if self._flat is None:
            assert self._holders == 0, "an arena without a buffer has no holders"
            self._flat = device_empty(self.numel, self.dtype, self.device)  # [Note: host temporaries in huge pages]
        self._holders += 1
        return self._flat[offset : offset + numel]

    def give(self) -> None:
        """A holder drops its slot (and its view of it); the last one frees the buffer."""
        assert self._holders > 0, "a slot given back that was not taken"
        self._holders -= 1
        if self._holders == 0:
            self._flat = None

    @property
    def allocated(self) -> bool:
        return self._flat is not None


@dataclass(frozen=True)
class ArenaSlot:
    """Where in a `GradArena` one bucket's gradient goes (its shard at stages 2-3, its full buffer at 0-1)."""

    arena: GradArena
    offset: int


class DeviceShardGradient:
    """Stages 2/3 without offload: a shard-sized buffer on the compute device, accumulated over micro-steps and
    released after the step ([Note: gradients live from the first backward to the optimizer step]).

    `slot` (`contiguous_gradients`): the buffer is a slot of one flat buffer shared with other buckets; otherwise
    it is allocated on its own."""

    in_host = False

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        slot: ArenaSlot | None = None,
    ) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self._slot = slot
        self.values: torch.Tensor | None = None

    def _allocate(self) -> torch.Tensor:
        if self._slot is not None:
            return self._slot.arena.take(self._slot.offset, self.numel)
        return device_empty(self.numel, self.dtype, self.device)

    def add(self, reduced: torch.Tensor, post: float, fresh: bool) -> None:
        if self.values is None:
            assert fresh, "a gradient added to a released shard must replace it"
            self.values = self._allocate()
        fold_into(self.values, reduced, post, fresh)

    def read(self, start: int, end: int) -> torch.Tensor:
        assert self.values is not None, "read() before anything was added or cleared"
        return self.values[start:end]

    def square_norm(self, device: torch.device) -> torch.Tensor:
        return sum_of_squares([self.read(0, self.numel)], device)

    def clear(self) -> None:
        if self.values is None:
            self.values = self._allocate()
        self.values.zero_()

    def settle(self) -> None:
        pass

    def reset(self) -> None:
        if self.values is not None and self._slot is not None:
            self._slot.arena.give()
        self.values = None

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.values is None else [self.values]
