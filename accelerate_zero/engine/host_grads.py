"""HostGradient: a bucket's averaged gradient slice kept in host memory while the optimizer is offloaded.

[Note: a gradient slice in host memory]
Under `offload_optimizer` the optimizer steps fp32 masters in host memory, so the slice of the averaged gradient
this rank steps lives there too. It is filled by asynchronous copies ([Note: asynchronous host copies] in
engine/host_copies.py), one per bucket per reduction, so backward never waits for a copy:
- the first reduction of a cycle (stages 0/1: the only one) copies straight into the slice;
- a later one (gradient accumulation at stages 2/3) lands in a staging buffer and is added to the slice the next time
  the host needs either: when the slice is read, when this bucket lands again, or when another bucket needs the
  staging buffer. Staging buffers form one small ring shared by every bucket (`HostStaging`, two slices' worth,
  allocated on first use), so accumulation costs two bucket slices of host memory, not one per bucket.
Whoever reads or writes the slice goes through `read()`/`clear()`, which first wait for the copy in flight.
On a CPU device the slice is filled in place, one pass per reduction, and the ring is never used ([Note: the host is
the device] in engine/host_copies.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from accelerate_zero.engine.host_copies import CopyDone, HostCopies
from accelerate_zero.engine.norms import sum_of_squares


class HostStaging:
    """A ring of `slots` host buffers that later reductions land in (see the note); each as large as the largest
    slice `reserve`d, allocated on first use."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], slots: int = 2, numel: int = 0) -> None:
        self.numel, self._allocate = numel, allocate
        self.buffers: list[torch.Tensor] = []
        self._owners: list[HostGradient | None] = [None] * slots
        self._next = 0

    def reserve(self, numel: int) -> None:
        """A slice of `numel` elements may land here (before the first use)."""
        assert not self.buffers, "HostStaging.reserve() after the buffers were allocated"
        self.numel = max(self.numel, numel)

    def acquire(self, owner: HostGradient, numel: int) -> tuple[int, torch.Tensor]:
        """A free slot for `owner` (`numel` elements); a slot still landing another bucket's copy is settled first."""
        if not self.buffers:
            self.buffers = [self._allocate(self.numel) for _ in self._owners]
        slot = self._next
        self._next = (slot + 1) % len(self._owners)
        previous = self._owners[slot]
        if previous is not None:
            previous.settle()
        assert self._owners[slot] is None, "a settled gradient released its staging slot"
        self._owners[slot] = owner
        return slot, self.buffers[slot][:numel]

    def release(self, slot: int) -> None:
        self._owners[slot] = None


class HostGradient:
    """One bucket's gradient slice in host memory (fp32, `numel` elements; a `KeptGradient`, engine/kept_grads.py),
    see the note above. Its memory is allocated (`allocate(numel)`, zeros) on first use, so that at start-up it comes
    after the shards and masters went to their files, not on top of them."""

    in_host = True

    def __init__(
        self, numel: int, staging: HostStaging, copies: HostCopies, allocate: Callable[[int], torch.Tensor]
    ) -> None:
        self.numel, self.staging, self.copies, self._allocate = numel, staging, copies, allocate
        staging.reserve(numel)
        self._values: torch.Tensor | None = None
        self._copy: CopyDone | None = None
        self._landing: tuple[int, torch.Tensor] | None = None  # (staging slot, its buffer) to add once copied

    @property
    def values(self) -> torch.Tensor:
        if self._values is None:
            self._values = self._allocate(self.numel)
        return self._values

    def add(self, reduced: torch.Tensor, post: float, fresh: bool) -> None:
        """Starts adding `reduced * post` to the slice; `fresh` replaces it. The scaling runs on the device, so that
        one copy carries the result."""
        self.settle()
        if self.copies.host_is_device:  # [Note: the host is the device] in engine/host_copies.py
            self.copies.fold_into_host(reduced, self.values, post, fresh)
            return
        if post != 1.0:
            reduced = reduced.float().mul_(post)
        if fresh:
            self._copy = self.copies.to_host(reduced, self.values)
            return
        self._landing = self.staging.acquire(self, self.numel)
        self._copy = self.copies.to_host(reduced, self._landing[1])

    def settle(self) -> None:
        """Waits for the copy in flight and adds what landed in staging."""
        if self._copy is not None:
            self._copy.wait()
            self._copy = None
        if self._landing is not None:
            slot, landed = self._landing
            self._landing = None
            self.values.add_(landed)
            self.staging.release(slot)

    def read(self, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the slice, complete."""
        self.settle()
        return self.values[start:end]

    def square_norm(self, device: torch.device) -> torch.Tensor:
        return sum_of_squares([self.read(0, self.numel)], device)

    def clear(self) -> None:
        self.settle()
        self.values.zero_()

    def reset(self) -> None:
        self.settle()

    def tensors(self) -> list[torch.Tensor]:
        return [] if self._values is None else [self._values]
