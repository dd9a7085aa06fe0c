"""Pure planning of whole-parameter ("owner") stepping: which rank steps each parameter, and which pieces of it
travel between ranks; no torch.distributed here.

[Note: owners over the flat layout]
The flat layout stays as it is for every parameter (engine/shard_plan.py): buckets, their reduce-scatter, the norm,
the all-gather and stage 3's gathers do not change. Only the step of a parameter whose optimizer reads it whole
(optim/kinds.py) moves: one rank of the shard group, its owner, holds its fp32 master in its own shape and its
optimizer state, gets the pieces of its averaged gradient the other ranks' shards hold, steps it, and sends each
holder its piece of the updated values back (engine/owned_step.py). Owners are chosen so that little moves and the
masters balance:
- a parameter whose elements all fall in one rank's slice (most of them, in a large bucket) is owned by that rank:
  nothing moves for it;
- the others (across a slice boundary; at stage 3 the large matrices of a unit) are taken largest first, each by
  the least loaded of the ranks holding a piece of it (load: elements owned so far; ties: the larger piece, then
  the lower rank).
Every rank computes the same plan from the bucket plans alone, so the exchange needs no negotiation: the pieces
from holder h to owner o are listed in the same order on both sides. At stage 0 (one shard, every rank holding
everything) every rank owns every parameter and nothing moves, as in DDP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accelerate_zero.engine.shard_plan import BucketPlan, ParamSlot


@dataclass(frozen=True)
class Piece:
    """The elements of one parameter that one rank's shard holds."""

    holder: int
    """The rank (in the shard group) whose slice of the bucket holds them."""
    lo: int
    hi: int
    """The element range, relative to the parameter."""
    at: int
    """Where the range starts in the holder's slice of the bucket."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class OwnedParam:
    """One parameter stepped whole: where it lives in the flat layout and who steps it."""

    index: int
    """Position in the plan (the order every rank lists parameters in)."""
    bucket: int
    """Index of its bucket in the list the plan was made from (the reducer's launch order)."""
    slot: ParamSlot
    group: int
    """The optimizer param group it belongs to."""
    owner: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return self.slot.numel

    @property
    def shape(self) -> tuple[int, ...]:
        return self.slot.shape


@dataclass(frozen=True)
class OwnerPlan:
    """Every parameter stepped whole, in one order shared by all ranks, and the group size it was planned for."""

    params: tuple[OwnedParam, ...]
    num_shards: int
    loads: tuple[int, ...] = field(default=())
    """Elements each rank owns."""

    def owned_by(self, rank: int) -> list[OwnedParam]:
        return [p for p in self.params if p.owner == rank]

    def moves(self) -> dict[tuple[int, int], list[tuple[OwnedParam, Piece]]]:
        """(holder, owner) -> the pieces the holder sends the owner when gradients go to their owners, in plan order
        (the updated values travel the same lists back); only pairs of different ranks."""
        out: dict[tuple[int, int], list[tuple[OwnedParam, Piece]]] = {}
        for param in self.params:
            for piece in param.pieces:
                if piece.holder != param.owner:
                    out.setdefault((piece.holder, param.owner), []).append((param, piece))
        return out

    def moves_anything(self) -> bool:
        return any(piece.holder != param.owner for param in self.params for piece in param.pieces)

    def moved_numel(self) -> int:
        """Elements that cross ranks each way per step (gradients to owners, as many values back)."""
        return sum(piece.numel for param in self.params for piece in param.pieces if piece.holder != param.owner)


def plan_owners(buckets: list[tuple[BucketPlan, list[int | None]]]) -> OwnerPlan:
    """Assigns every parameter stepped whole to an owner ([Note: owners over the flat layout]).

    Args:
        buckets: per bucket (in the reducer's launch order, the same on every rank): its plan and, per slot of the
            plan, the optimizer param group of the parameter if it is stepped whole, else None.

    Returns:
        The plan (params in bucket order, slots in plan order).

    Raises:
        ValueError: the buckets were not all cut into the same number of shards.
    """
    shards = {plan.num_shards for plan, groups in buckets if any(g is not None for g in groups)}
    if len(shards) > 1:
        raise ValueError(f"whole-parameter stepping needs one shard count for every bucket, got {sorted(shards)}")
    num_shards = shards.pop() if shards else 1
    entries: list[tuple[int, ParamSlot, int, tuple[Piece, ...]]] = []
    for index, (plan, groups) in enumerate(buckets):
        for slot, group in zip(plan.slots, groups, strict=True):
            if group is not None:
                entries.append((index, slot, group, _pieces(plan, slot)))
    loads = [0] * num_shards
    owners: dict[int, int] = {}
    for position, (_, slot, _, pieces) in enumerate(entries):
        if len(pieces) <= 1:  # in one rank's slice (or empty: nothing to hold)
            owners[position] = pieces[0].holder if pieces else 0
            loads[owners[position]] += slot.numel
    spread = sorted((p for p in range(len(entries)) if p not in owners), key=lambda p: (-entries[p][1].numel, p))
    for position in spread:
        slot, pieces = entries[position][1], entries[position][3]
        best = min(pieces, key=lambda piece: (loads[piece.holder], -piece.numel, piece.holder))
        owners[position] = best.holder
        loads[best.holder] += slot.numel
    params = tuple(
        OwnedParam(position, bucket, slot, group, owners[position], pieces)
        for position, (bucket, slot, group, pieces) in enumerate(entries)
    )
    return OwnerPlan(params, num_shards, tuple(loads))


def _pieces(plan: BucketPlan, slot: ParamSlot) -> tuple[Piece, ...]:
    pieces = []
    for shard in range(plan.num_shards):
        overlap = plan.slot_overlap(slot, shard)
        if overlap is not None:
            lo, hi = overlap
            pieces.append(Piece(shard, lo, hi, slot.offset + lo - plan.shard_range(shard)[0]))
    return tuple(pieces)
