"""ParamUnit: one gather unit's lifecycle (sharded -> gathering -> gathered -> sharded).

[Note: what a parameter points at while its unit is sharded]
The unit's parameters are views into a full flat buffer. At rest the buffer's storage is resized to zero bytes
and each parameter's `.data` is an empty placeholder (shape `[0]`, as under DeepSpeed ZeRO-3), so reading it
outside the unit's forward fails with a shape error instead of reading freed memory; read or modify parameters
inside `accelerate_zero.GatheredParameters(...)`. Gathering resizes the same storage back, all-gathers into it,
and points the parameters at their views again. Keeping the storage object (not allocating a new one) matters:
tensors autograd saved in forward as views of a weight (e.g. its transpose) see the re-gathered values in
backward. Only this rank's shard stays in memory permanently.

[Note: hpZ's secondary copy]
Under hpZ (engine/layout.py) a unit released after a forward that backward will follow keeps this rank's slice of
the full buffer as cut over the secondary group (a node): `secondary`, 1/n of the unit. A later gather while it is
kept (backward's, a recomputation's) all-gathers those slices inside the group instead of the primary shards over
every rank; the values are the same, as the parameters only change at the optimizer step. A unit kept gathered
from forward to backward needs no copy. The copy is dropped
when the unit's backward is done and at the end of every backward, at the step and when the shards are rewritten,
so it never outlives the values it copies.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from accelerate_zero.engine import collectives
from accelerate_zero.engine.buckets import GradBucket
from accelerate_zero.engine.collectives import CommStats, Pending
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.host_copies import CopyDone, HostCopies
from accelerate_zero.engine.quantized_comm import BlockQuantization, quantized_all_gather
from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.engine.stage3.flat_unit import FlatUnitBuffer
from accelerate_zero.engine.stores import ShardsInMemory, ShardStore


class UnitState(enum.Enum):
    SHARDED = "sharded"
    """Only this rank's shard is in memory; the parameters' storage is empty."""
    GATHERING = "gathering"
    """The all-gather is in flight: `wait_for_unshard()` before computing."""
    GATHERED = "gathered"
    """The full parameters are usable."""


class ParamUnit:
    """A gather unit: its flat buffers, the gradient bucket of its trainable part, and its state."""

    index: int
    name: str
    module: nn.Module
    flats: list[FlatUnitBuffer]
    trainable: FlatUnitBuffer | None
    bucket: GradBucket | None
    state: UnitState
    store: ShardStore  # where the shards live between gathers (engine/stores.py)

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        trainable: FlatUnitBuffer | None,
        frozen: FlatUnitBuffer | None,
        bucket: GradBucket | None,
        store: ShardStore | None = None,
    ) -> None:
        self.index, self.name, self.module = index, name, module
        self.trainable, self.bucket = trainable, bucket
        self.flats = [f for f in (trainable, frozen) if f is not None]
        self.has_frozen = frozen is not None
        """Holds parameters without gradient: autograd may need them after the unit's gradients are all ready
        ([Note: release after backward])."""
        self.numel = sum(f.plan.numel for f in self.flats)
        self.state = UnitState.SHARDED
        self.holds = 0
        """Open `GatheredParameters` contexts; the unit is not released while any is open."""
        self.external: list[ParamUnit] = []
        """Units whose parameters this unit's forward uses (gathered with it; see stage3/external.py)."""
        self._pending: list[Pending] = []
        self.secondary: list[torch.Tensor] | None = None
        """hpZ: this rank's slice of each flat over the secondary group ([Note: hpZ's secondary copy])."""
        self._host_read: CopyDone | None = None
        """The last copy from a host shard (offload_param), maybe in flight: waited before a shard is written (copies
        run in order on one stream, so the last one done means all are)."""
        self.store = store if store is not None else ShardsInMemory()

    def __repr__(self) -> str:
        return f"ParamUnit({self.index}, {self.name or '<root>'!r}, numel={self.numel}, {self.state.value})"

    def unshard(
        self,
        dp: DataParallelGroup,
        stats: CommStats,
        use_all_reduce: bool = False,
        copies: HostCopies | None = None,
        secondary: DataParallelGroup | None = None,
        quantize: BlockQuantization | None = None,
    ) -> None:
        """Starts gathering the full parameters (asynchronously); nothing to do unless sharded.

        `use_all_reduce` fetches with an all-reduce of a zero buffer holding only this rank's slice
        (DeepSpeed's `stage3_use_all_reduce_for_fetch_params`): twice the traffic, for networks where
        all-reduce is faster than all-gather. `copies` brings a shard kept in host memory (offload_param) to the
        device without stopping Python ([Note: asynchronous host copies] in engine/host_copies.py). `secondary`:
        hpZ's group, gathered from when this unit keeps a secondary copy ([Note: hpZ's secondary copy]).
        `quantize`: qwZ, the primary shards travel as int8 blocks (engine/quantized_comm.py).
        """
        if self.state is not UnitState.SHARDED:
            return
        if secondary is not None and self.secondary is not None:
            for flat, part in zip(self.flats, self.secondary, strict=True):
                flat.allocate()
                self._pending.append(collectives.all_gather(flat.full, part, secondary, stats, async_op=True))
            self.state = UnitState.GATHERING
            return
        for flat in self.flats:
            if flat.shard.numel() and not flat.shard.untyped_storage().nbytes():
                # [Note: sleeping moves storages, not tensors] (engine/sleep.py): gathering now would read nothing.
                raise RuntimeError(
                    f"unit {self.name!r} is gathered while the training state is offloaded: call "
                    "engine.reload_states() first"
                )
            flat.allocate()
            swapped = self.store.swapped(flat)
            source = self.store.acquire(flat)
            # offload_param keeps the shard in host memory: bring it to the device first (no-op when it is there).
            if copies is None:
                shard = source.to(flat.full.device)
            else:
                shard, self._host_read = copies.to_device(source)
            if use_all_reduce:
                flat.full.zero_()
                flat.full[slice(*flat.plan.shard_range(flat.rank))].copy_(shard)
                pending = collectives.all_reduce(flat.full, dp, stats, async_op=True, kind="all_reduce_fetch")
            elif quantize is not None:
                pending = quantized_all_gather(flat.full, shard, dp, stats, quantize)
            else:
                pending = collectives.all_gather(flat.full, shard, dp, stats, async_op=True)
            if swapped:
                # [Note: when a swapped shard is in memory] (offload/nvme_params.py): only until its gather is done
                # and the copy from its buffer is over (the buffer is refilled from a file next).
                pending.wait()
                self.wait_for_host_reads()
                self.store.release(flat)
            else:
                self._pending.append(pending)
        self.state = UnitState.GATHERING

    def _assert_in(self, action: str, *states: UnitState) -> None:
        """A transition from any other state is a scheduling bug: say which unit, where it was and what was expected
        (rather than doing nothing and letting a forward run on empty parameters)."""
        if self.state not in states:
            expected = " or ".join(state.value for state in states)
            raise AssertionError(f"{self!r}: cannot {action} in state {self.state.value} (expected {expected})")

    def wait_for_unshard(self) -> None:
        """Completes a started gather (`unshard` first: a sharded unit has nothing to wait for)."""
        self._assert_in("wait for its gather", UnitState.GATHERING, UnitState.GATHERED)
        if self.state is UnitState.GATHERING:
            for pending in self._pending:
                pending.wait()
            self._pending.clear()
            for flat in self.flats:
                flat.expose()
            self.state = UnitState.GATHERED

    def reshard(self, force: bool = False, keep_secondary: DataParallelGroup | None = None) -> None:
        """Frees the full parameters (kept while a `GatheredParameters` context holds them, unless `force`).
        `keep_secondary`: hpZ's group, this rank's slice over it is kept ([Note: hpZ's secondary copy])."""
        if self.state is UnitState.SHARDED or (self.holds and not force):
            return
        self.wait_for_unshard()
        if keep_secondary is not None and self.secondary is None:
            width = keep_secondary.world_size
            self.secondary = [flat.full.view(width, -1)[keep_secondary.rank].clone() for flat in self.flats]
        for flat in self.flats:
            flat.free()
        self.state = UnitState.SHARDED

    def drop_secondary(self) -> None:
        """Frees hpZ's secondary copy ([Note: hpZ's secondary copy]); the next gather reads the primary shards."""
        self.secondary = None

    def wait_for_host_reads(self) -> None:
        """Waits for the copies reading this unit's host shards (before they are written or their buffer reused)."""
        if self._host_read is not None:
            self._host_read.wait()
            self._host_read = None

    def refresh_shards_from_full(self) -> None:
        """After the full parameters were written (GatheredParameters with a modifier rank): keep our slice."""
        self._assert_in("refresh its shards from the full parameters", UnitState.GATHERED)
        self.wait_for_host_reads()
        self.drop_secondary()  # a copy of the old values
        for flat in self.flats:
            lo, hi = flat.plan.shard_range(flat.rank)
            self.store.overwrite(flat, flat.full[lo:hi])

    def resident_tensors(self) -> list[torch.Tensor]:
        return [t for flat in self.flats for t in (flat.shard, flat.full)] + list(self.secondary or [])


def unit_slices(
    unit: ParamUnit, group_of: dict[nn.Parameter, int], rank: int, num_groups: int, fp32_masters: bool = True
) -> list[list[ShardSlice]]:
    """This rank's runs of the unit's trainable shard, one optimizer tensor per (param group, contiguous run).
    `fp32_masters` False: the slices' masters are the shard itself, whatever its dtype (the offload policy replaces
    them with host ones)."""
    out: list[list[ShardSlice]] = [[] for _ in range(num_groups)]
    flat, bucket = unit.trainable, unit.bucket
    if flat is None or bucket is None:
        return out
    lo, hi = flat.plan.shard_range(rank)
    master = flat.shard if flat.shard.dtype == torch.float32 or not fp32_masters else flat.shard.float()
    runs: list[tuple[int, int, int]] = []  # (group, start, end) relative to the shard
    for slot in sorted(flat.plan.slots, key=lambda s: s.offset):
        start, end = max(lo, slot.offset) - lo, min(hi, slot.offset + slot.numel) - lo
        if start >= end:
            continue
        group = group_of[flat.params[slot.param_index]]
        if runs and runs[-1][0] == group and runs[-1][2] == start:
            runs[-1] = (group, runs[-1][1], end)
        else:
            runs.append((group, start, end))
    for group, start, end in runs:
        params = flat.shard[start:end]
        master_run = params if master is flat.shard else master[start:end]
        out[group].append(ShardSlice(bucket=bucket, start=start, end=end, master=master_run, params=params))
    return out
