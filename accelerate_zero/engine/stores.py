"""Where sharded state lives: the contracts the engine owns, and their in-memory implementations.

[Note: offload is a store, not a flag]
Offloading changes where a shard lives (device, host memory, a file), not what the engine does with it. The engine
states what it needs as protocols here; `offload/` implements them for files (offload/nvme_params.py,
offload/nvme.py) and this module for memory. The composition root (engine/assemble.py) picks one per config and
passes it to the constructors, so units, the scheduler and the sharded optimizer call one object whichever offload
runs, instead of asking whether a store exists.
- `ShardStore`: where stage-3 unit shards live between gathers (memory, or some of them in files).
- `StepRunner`: how the optimizer step walks the master weights and their state (all in memory at once, or one
  sub-group at a time from files).
(The third contract, where a reduced gradient slice waits for the step, is `KeptGradient` in engine/kept_grads.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch


if TYPE_CHECKING:
    from pathlib import Path

    from accelerate_zero.engine.shard_slice import ShardSlice
    from accelerate_zero.engine.stage3.flat_unit import FlatUnitBuffer


class UnitShards(Protocol):
    """What a store reads of a stage-3 unit (engine/stage3/param_unit.py's `ParamUnit`, which imports this module)."""

    index: int
    name: str
    flats: list[FlatUnitBuffer]
    trainable: FlatUnitBuffer | None


class ShardStore(Protocol):
    """Where the shards of stage-3 units live between gathers."""

    gates_reads: bool
    """`gate_reads` is honoured: every read and write of a shard first calls the gate ([Note: the host step across
    the step boundary] in engine/step_in_flight.py)."""

    def gate_reads(self, wait_for: Callable[[torch.Tensor], None]) -> None:
        """From now on `wait_for(flat.shard)` runs before a shard is read or written (a host step may still be
        writing it)."""
        ...

    def place(self, units: Sequence[UnitShards], spilled: dict[int, Path]) -> None:
        """Once, when the units are built: takes the shards this store keeps outside memory ([Note: where an
        offloaded shard settles] in engine/stage3/build.py). `spilled`: id(flat) -> the file partitioned loading
        already wrote that flat's shard to."""
        ...

    def swapped(self, flat: FlatUnitBuffer) -> bool:
        """The shard lives outside memory: `acquire` reads it and `release` must follow its gather."""
        ...

    def acquire(self, flat: FlatUnitBuffer) -> torch.Tensor:
        """The shard with its values in memory (for a gather)."""
        ...

    def release(self, flat: FlatUnitBuffer) -> None:
        """The gather reading `acquire`'s tensor is over."""
        ...

    def read(self, flat: FlatUnitBuffer) -> torch.Tensor:
        """The shard's values (a copy when it lives in a file)."""
        ...

    def overwrite(self, flat: FlatUnitBuffer, values: torch.Tensor, offset: int = 0) -> None:
        """Writes `values` into the shard from element `offset` on."""
        ...

    def read_ahead(self, flats: list[FlatUnitBuffer]) -> None:
        """The flat buffers gathered next, in order: start bringing their shards into memory."""
        ...

    def holds(self, shard_slice: ShardSlice) -> bool:
        """The optimizer slice's parameter values live in this store's files (written with `write_slice`)."""
        ...

    def read_slice(self, shard_slice: ShardSlice) -> torch.Tensor: ...

    def write_slice(self, shard_slice: ShardSlice) -> None: ...

    def flush(self) -> None:
        """Every write is done and nothing read ahead stays in memory (between steps, before a save)."""
        ...

    def file_bytes(self) -> int: ...

    def close(self) -> None: ...


class ShardsInMemory:
    """A `ShardStore` for shards that never leave memory (device or host: `flat.shard` is where they are)."""

    gates_reads = True

    def __init__(self) -> None:
        self._wait_for: Callable[[torch.Tensor], None] | None = None

    def gate_reads(self, wait_for: Callable[[torch.Tensor], None]) -> None:
        self._wait_for = wait_for

    def _gate(self, shard: torch.Tensor) -> torch.Tensor:
        if self._wait_for is not None:
            self._wait_for(shard)
        return shard

    def place(self, units: Sequence[UnitShards], spilled: dict[int, Path]) -> None:
        pass

    def swapped(self, flat: FlatUnitBuffer) -> bool:
        return False

    def acquire(self, flat: FlatUnitBuffer) -> torch.Tensor:
        return self._gate(flat.shard)

    def release(self, flat: FlatUnitBuffer) -> None:
        pass

    def read(self, flat: FlatUnitBuffer) -> torch.Tensor:
        return self._gate(flat.shard)

    def overwrite(self, flat: FlatUnitBuffer, values: torch.Tensor, offset: int = 0) -> None:
        self._gate(flat.shard)[offset : offset + values.numel()].copy_(values)

    def read_ahead(self, flats: list[FlatUnitBuffer]) -> None:
        pass

    def holds(self, shard_slice: ShardSlice) -> bool:
        return False

    def read_slice(self, shard_slice: ShardSlice) -> torch.Tensor:
        return self._gate(shard_slice.params)

    def write_slice(self, shard_slice: ShardSlice) -> None:
        raise AssertionError("write_slice() on shards in memory: the slice's parameters are written in place")

    def flush(self) -> None:
        pass

    def file_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class SliceStepper(Protocol):
    """What a `StepRunner` drives (engine/sharded_optimizer.py's `ShardedOptimizer`)."""

    optimizer: torch.optim.Optimizer

    def step_slices(
        self, slices: list[ShardSlice], coefficient: float, grads: list[torch.Tensor] | None = None
    ) -> None: ...


class StepRunner(Protocol):
    """How the optimizer step reaches the master weights and their optimizer state."""

    on_host: bool
    """The step is host work (offloaded masters): it may run on a worker thread ([Note: the host step across the
    step boundary] in engine/step_in_flight.py)."""

    def step(self, sharded: SliceStepper, coefficient: float) -> None:
        """Steps every slice with its gradient times `coefficient` (`sharded.step_slices` on each batch)."""
        ...

    def each_resident(self, optimizer: torch.optim.Optimizer, write_back: bool) -> Iterator[list[ShardSlice]]:
        """Every slice, in batches whose masters and state are in memory while the batch is used (`write_back`:
        changes made to them are kept)."""
        ...

    def file_bytes(self) -> int: ...

    def close(self) -> None: ...


class StepsInMemory:
    """A `StepRunner` for masters and state held in memory: one step over all slices at once."""

    on_host = False

    def __init__(self, slices: list[ShardSlice]) -> None:
        self.slices = slices

    def step(self, sharded: SliceStepper, coefficient: float) -> None:
        sharded.step_slices(self.slices, coefficient)

    def each_resident(self, optimizer: torch.optim.Optimizer, write_back: bool) -> Iterator[list[ShardSlice]]:
        yield self.slices

    def file_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass
