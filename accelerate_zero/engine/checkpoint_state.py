"""The contract between the engine and checkpointing: which element ranges of which parameters this rank holds, their
values out and in, and the step counters. checkpoint/engine_io.py reads and restores an engine only through this
(never its units, stores or optimizer slices), so the engine may change how it holds state without breaking the
checkpoint format ([Note: universal checkpoints] in checkpoint/fragments.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from accelerate_zero.engine.buckets import GradBucket
from accelerate_zero.engine.loss_scaler import LossScaler
from accelerate_zero.engine.shard_plan import BucketPlan, ParamSlot
from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.engine.sharded_optimizer import ShardedOptimizer
from accelerate_zero.engine.stage3.flat_unit import FlatUnitBuffer
from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.engine.stores import ShardStore


@dataclass(frozen=True)
class ShardRange:
    """Elements [lo, hi) of a flat buffer laid out by `plan`, whose slots index `params`."""

    plan: BucketPlan
    params: list[nn.Parameter]
    lo: int
    hi: int
    offsets: dict[int, int] = field(default_factory=dict)
    """id(parameter) -> where its first element sits in the whole tensor a checkpoint names, for a parameter that
    holds part of one (a split layer's experts, [Note: expert parallelism in the engine] in
    engine/experts/partition.py); absent: 0."""


@dataclass(frozen=True)
class TrainableRange:
    """A run of this rank's trainable shard: its fp32 `master` values (loading writes into them, then
    `CheckpointState.write_trainable`) and the optimizer state keyed by `master`. A parameter stepped whole
    (engine/owned_step.py) is one range on its owner, its master in the parameter's shape (`whole`)."""

    range: ShardRange
    master: torch.Tensor
    _slice: ShardSlice | None = field(repr=False)
    """None for a whole parameter: its holders' shards are written from the owners in `finish_load`."""

    @property
    def whole(self) -> bool:
        """The range is a whole parameter whose optimizer state keeps its own shapes (saved as they are)."""
        return self._slice is None

    @property
    def flat_master(self) -> torch.Tensor:
        """`master` as one dimension (a view: writes reach the master)."""
        return self.master.view(-1)


@dataclass(frozen=True)
class FrozenShard:
    """This rank's shard of a stage-3 unit's parameters without gradient."""

    range: ShardRange
    _flat: FlatUnitBuffer = field(repr=False)


@dataclass(frozen=True)
class StepCounters:
    global_steps: int
    micro_steps: int
    skipped_steps: int


class CheckpointState:
    """What a checkpoint saves of one engine and restores into it (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        units: list[ParamUnit],
        buckets: list[GradBucket],
        sharded_optimizer: ShardedOptimizer,
        shard_store: ShardStore,
        counters: StepCounters,
        restore_counters: Callable[[StepCounters], None],
        whole_layout: dict[int, tuple[int, list[int]]] | None = None,
        writes_parts: bool = True,
    ) -> None:
        """`whole_layout`: id(parameter) -> (its first element's place in the whole tensor, the whole shape), for
        parameters that hold part of one (a split layer's experts); `writes_parts`: this rank is the one of the
        ranks holding the same parts that saves them when they are not in shards (frozen ones)."""
        self.module, self._units, self._buckets = module, units, buckets
        self._sharded, self._store = sharded_optimizer, shard_store
        self.counters = counters
        """The engine's step counters when this state was taken."""
        self.restore_counters = restore_counters
        """Sets the engine's step counters (a loaded checkpoint's)."""
        self._whole = whole_layout or {}
        self._offsets = {key: offset for key, (offset, _) in self._whole.items()}
        self.writes_parts = writes_parts

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer; its state is keyed by the `master` tensors of the trainable ranges."""
        return self._sharded.optimizer

    @property
    def steps_whole_parameters(self) -> bool:
        """Some param groups step whole parameters on owner ranks (engine/owned_step.py)."""
        return self._sharded.owned is not None

    @property
    def loss_scaler(self) -> LossScaler | None:
        return self._sharded.loss_scaler

    # --------------------------------------------------------------- trainable
    def trainable_batches(self, write_back: bool) -> Iterator[list[TrainableRange]]:
        """Every trainable range, in batches whose masters and optimizer state are in memory while the batch is used
        (under NVMe optimizer offload one sub-group at a time; `write_back`: changes go back to its file)."""
        for slices in self._sharded.resident_slices(write_back=write_back):
            yield [self._trainable(s) for s in slices]
        owned = self._sharded.owned
        if owned is not None and owned.mine:
            yield [self._whole_range(each.bucket, each.param.slot, each.master) for each in owned.mine]

    def trainable_ranges(self) -> list[ShardRange]:
        """The element ranges of every trainable slice, without bringing masters or state into memory."""
        owned = self._sharded.owned
        mine = owned.mine if owned is not None else []
        return [self._trainable(s).range for s in self._sharded.slices] + [
            self._whole_range(each.bucket, each.param.slot, each.master).range for each in mine
        ]

    def _whole_range(self, bucket: GradBucket, slot: ParamSlot, master: torch.Tensor) -> TrainableRange:
        lo = slot.offset
        return TrainableRange(ShardRange(bucket.plan, bucket.params, lo, lo + slot.numel, self._offsets), master, None)

    def _trainable(self, shard_slice: ShardSlice) -> TrainableRange:
        bucket = shard_slice.bucket
        lo = bucket.plan.shard_range(bucket.rank)[0]
        shard_range = ShardRange(
            bucket.plan, bucket.params, lo + shard_slice.start, lo + shard_slice.end, self._offsets
        )
        return TrainableRange(shard_range, shard_slice.master, shard_slice)

    def write_trainable(self, ranges: list[TrainableRange]) -> None:
        """Copies the masters of `ranges` into the parameters they train (whole parameters: in `finish_load`)."""
        self._sharded.write_params([r._slice for r in ranges if r._slice is not None])

    # ------------------------------------------------------------------ frozen
    def frozen_shards(self) -> list[FrozenShard]:
        flats = [flat for unit in self._units for flat in unit.flats if flat is not unit.trainable]
        # a split layer's frozen experts in a unit of their own ([Note: experts below 1/ep at stage 3]): offsets
        return [
            FrozenShard(ShardRange(f.plan, f.params, *f.plan.shard_range(f.rank), self._offsets), f) for f in flats
        ]

    def read_frozen(self, shard: FrozenShard) -> torch.Tensor:
        """The shard's values (a copy when it lives in a file: write changes back with `write_frozen`)."""
        return self._store.read(shard._flat)

    def write_frozen(self, shard: FrozenShard, values: torch.Tensor) -> None:
        if values is not shard._flat.shard:
            self._store.overwrite(shard._flat, values)

    # ------------------------------------------------------------------ whole
    def sharded_parameters(self) -> set[int]:
        """ids of the parameters whose values live in shards (trainable buckets, stage-3 frozen shards), whether or
        not this rank's slice holds any of their elements (a small bucket's slice can be padding only)."""
        covered = {id(b.params[slot.param_index]) for b in self._buckets for slot in b.plan.slots}
        return covered | {id(p) for shard in self.frozen_shards() for p in shard.range.params}

    def param_shapes(self) -> dict[str, list[int]]:
        """Every parameter's real shape; at stage 3 from the unit plans (the parameters hold empty placeholders)."""
        planned = {
            id(flat.params[slot.param_index]): list(slot.shape)
            for unit in self._units
            for flat in unit.flats
            for slot in flat.plan.slots
        }
        whole = {key: shape for key, (_, shape) in self._whole.items()}
        return {n: whole.get(id(p)) or planned.get(id(p), list(p.shape)) for n, p in self.module.named_parameters()}

    def part_of_whole(self, param: nn.Parameter) -> int | None:
        """Where `param`'s first element sits in the whole tensor a checkpoint names, when it holds part of one
        (a split layer's experts); None for a whole parameter."""
        return self._offsets.get(id(param))

    def finish_load(self) -> None:
        """After every range was written: files are current and the parameters show the loaded values."""
        if self._sharded.owned is not None:
            self._sharded.owned.write_values()  # every rank, whether it owns anything or not: an exchange
        self._store.flush()
        self._sharded.publish()
