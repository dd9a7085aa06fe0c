"""What an optimizer keeps per tensor, and what the owner layout holds per rank, for `accelerate-zero estimate`.

[Note: what the owner layout holds, per rank]
An optimizer that reads its parameters whole (optim/kinds.py: Adafactor, Muon, bitsandbytes' 8-bit AdamW) steps
each parameter on one owner rank ([Note: owners over the flat layout] in engine/owner_plan.py). Parameters,
gradients and stage 3's gathers are laid out exactly as for AdamW; what differs, per rank r:
- master weights (fp32 under bf16/fp16, or under optimizer offload) and optimizer states: those of the parameters r
  owns, in their own shapes, instead of 1/W of every bucket. Owners are balanced by elements, but a parameter is
  never split: the most loaded rank holds at least the largest parameter (an untied embedding, at large W);
- the optimizer states are the optimizer's own per shape (`OPTIMIZERS[...].state_bytes`): Adafactor's factored
  moments (a row and a column vector per matrix, fp32), Muon's momentum (one fp32 per element; torch's Muon takes
  matrices only: the other parameters are AdamW's, estimated here on the owners too), 8-bit AdamW's two uint8
  moments plus a fp32 maximum per block of 256 (tensors under 4096 elements stay 32-bit, as bitsandbytes does);
- during the step, transients on the device: the gradients of the owned parameters that are not wholly in r's own
  shard, assembled whole (fp32), and the exchange buffers, the pieces r sends and receives each way (`moved`:
  gradients in the gradient dtype, values back in the compute dtype).
`estimate_stage` reports the given rank; `owner_layout` gives every rank's load and the bytes moved per step.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

from accelerate_zero.engine.owner_plan import OwnerPlan, plan_owners
from accelerate_zero.engine.shard_plan import BucketPlan, plan_group


Shape = tuple[int, ...]
BNB_BLOCK, BNB_MIN_8BIT = 256, 4096
"""bitsandbytes' block size of its 8-bit state and the smallest tensor it keeps in 8 bits (`min_8bit_size`)."""


def _adafactor_bytes(shape: Shape) -> int:
    if len(shape) < 2:
        return math.prod(shape) * 4 + 4  # `variance` and `step`
    return (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) * 4 + 4  # row_var, col_var, step


def _muon_bytes(shape: Shape) -> int:
    return math.prod(shape) * 4 if len(shape) == 2 else math.prod(shape) * 8 + 4  # momentum; AdamW's moments + step


def _adamw_8bit_bytes(shape: Shape) -> int:
    numel = math.prod(shape)
    if numel < BNB_MIN_8BIT:
        return numel * 8
    return numel * 2 + 2 * math.ceil(numel / BNB_BLOCK) * 4 + 2 * 256 * 4  # state1/2, absmax1/2, qmap1/2


@dataclass(frozen=True)
class OptimizerStates:
    per_element: int
    """fp32 tensors the size of each optimizer tensor (Adam: exp_avg and exp_avg_sq)."""
    scalars: int
    """4-byte scalar tensors per optimizer tensor (torch's `step`)."""
    state_bytes: Callable[[Shape], int] | None = None
    """For an optimizer stepping whole parameters: its state's bytes for a parameter of a shape; None: the
    optimizer is elementwise (flat shards, `per_element` and `scalars`)."""

    @property
    def whole_tensors(self) -> bool:
        return self.state_bytes is not None


OPTIMIZERS = {
    "adamw": OptimizerStates(per_element=2, scalars=1),
    "adam": OptimizerStates(per_element=2, scalars=1),
    "sgd": OptimizerStates(per_element=0, scalars=0),
    "sgd_momentum": OptimizerStates(per_element=1, scalars=0),
    "adagrad": OptimizerStates(per_element=1, scalars=1),
    "adafactor": OptimizerStates(per_element=0, scalars=0, state_bytes=_adafactor_bytes),
    "muon": OptimizerStates(per_element=0, scalars=0, state_bytes=_muon_bytes),
    "adamw_8bit": OptimizerStates(per_element=0, scalars=0, state_bytes=_adamw_8bit_bytes),
}
"""State per parameter of the torch optimizers (`torch.optim.SGD` without momentum keeps none); the last three step
whole parameters ([Note: what the owner layout holds, per rank])."""


@dataclass(frozen=True)
class OwnerLayout:
    """The owner layout of one model at one stage and world size."""

    plan: OwnerPlan
    owned: tuple[int, ...]
    """Elements each rank owns (its fp32 masters)."""
    state_bytes: tuple[int, ...]
    """Optimizer state bytes each rank holds."""
    largest: int
    """Elements of the largest parameter (stepped whole on one rank)."""
    moved: tuple[int, ...]
    """Elements each rank sends to owners per step (as many values come back the other way)."""
    assembled: tuple[int, ...]
    """Elements of the parameters each rank owns that are not wholly in its own shard: their gradients are assembled
    in new fp32 tensors during the step (the others are stepped from views of the reduced shard)."""

    @property
    def heaviest(self) -> int:
        """The rank holding the most master and state bytes."""
        return max(range(len(self.owned)), key=lambda rank: self.state_bytes[rank] + self.owned[rank] * 4)

    def received(self, rank: int) -> int:
        """Elements `rank` receives as an owner per step (the gradient pieces other ranks hold)."""
        moves = self.plan.moves()
        return sum(piece.numel for (_, owner), pairs in moves.items() if owner == rank for _, piece in pairs)


def owner_layout(
    shapes: tuple[Shape, ...],
    unit_shapes: tuple[tuple[Shape, ...], ...],
    persistent: tuple[Shape, ...],
    stage: int,
    world_size: int,
    bucket_numel: int,
    optimizer: str,
) -> OwnerLayout:
    """Lays the parameters out as the engine does at `stage` (ModelShapes' fields) and plans their owners."""
    states = OPTIMIZERS[optimizer]
    if states.state_bytes is None:
        raise ValueError(f"{optimizer=} steps flat shards, not whole parameters")
    buckets: list[BucketPlan]
    if stage == 3:
        units = [plan_group(list(s), sys.maxsize, world_size).buckets[0] for s in unit_shapes if s]
        buckets = units + list(plan_group(list(persistent), bucket_numel, world_size).buckets)
    else:
        buckets = list(plan_group(list(shapes), bucket_numel, 1 if stage == 0 else world_size).buckets)
    plan = plan_owners([(bucket, [0] * len(bucket.slots)) for bucket in buckets])
    # Stage 0: one shard, which every rank holds and steps whole (as DDP does).
    mine = [[p for p in plan.params if stage == 0 or p.owner == rank] for rank in range(world_size)]
    moves = plan.moves()
    ranks = range(world_size)
    moved = [sum(x.numel for (src, _), pairs in moves.items() if src == r for _, x in pairs) for r in ranks]
    return OwnerLayout(
        plan,
        owned=tuple(sum(p.numel for p in params) for params in mine),
        state_bytes=tuple(sum(states.state_bytes(p.shape) for p in params) for params in mine),
        largest=max((p.numel for p in plan.params), default=0),
        moved=tuple(moved),
        assembled=tuple(sum(p.numel for p in params if len(p.pieces) > 1) for params in mine),
    )
