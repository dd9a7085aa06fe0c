"""StepLayout: how each optimizer param group is stepped, flat shards or whole tensors on owners; decided once, when
the engine adopts the optimizer, and handed to what the composition root builds.

[Note: which optimizers step flat shards] in optim/kinds.py says which optimizer needs which; [Note: owners over
the flat layout] in engine/owner_plan.py how whole tensors are stepped without changing the flat layout. The
choice is per param group, so that a chain (optim/chain.py: Muon on the hidden matrices, AdamW on the rest) keeps
AdamW's groups on flat shards and steps only Muon's matrices whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from accelerate_zero.config import ResolvedZeroConfig
from accelerate_zero.engine.buckets import GradBucket
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.owned_step import OwnedTensors
from accelerate_zero.engine.owner_plan import plan_owners
from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.offload.host_memory import HostMemory
from accelerate_zero.offload.policy import offload_policy
from accelerate_zero.optim.chain import group_owners
from accelerate_zero.optim.kinds import StepKind, describe, step_kind


@dataclass(frozen=True)
class StepLayout:
    """The param groups (by index in the optimizer) stepped as whole tensors; the others step flat shards."""

    whole_groups: frozenset[int] = frozenset()
    group_of: dict[int, int] = field(default_factory=dict)
    """id(parameter) -> its param group, for the parameters of whole-tensor groups."""
    reasons: tuple[str, ...] = ()
    """The optimizer classes that step whole tensors (for logs and `accelerate-zero estimate`)."""

    @property
    def any_whole(self) -> bool:
        return bool(self.whole_groups)

    def steps_whole(self, group: int) -> bool:
        return group in self.whole_groups

    def steps_any(self, params: list[nn.Parameter]) -> bool:
        """Any of `params` is in a whole-tensor group."""
        return any(id(param) in self.group_of for param in params)

    def split(self, slices_by_group: list[list[ShardSlice]]) -> tuple[list[list[ShardSlice]], list[ShardSlice]]:
        """(the flat groups' slices, each whole group's list emptied; the whole groups' slices: the runs of this
        rank's shard their pieces are stored in)."""
        # Without their flat fp32 masters (stage 3 cuts one per unit): the owners hold masters of their own. A flat
        # slice sharing a unit with whole groups gets its own copy of its run, so that the unit's copy can go.
        mixed = {id(s.bucket) for i, slices in enumerate(slices_by_group) if self.steps_whole(i) for s in slices}
        flat = [
            [] if self.steps_whole(i) else [_own_master(s) if id(s.bucket) in mixed else s for s in slices]
            for i, slices in enumerate(slices_by_group)
        ]
        held = [
            ShardSlice(s.bucket, s.start, s.end, s.params, s.params)
            for i, slices in enumerate(slices_by_group)
            if self.steps_whole(i)
            for s in slices
        ]
        return flat, held


def _own_master(shard_slice: ShardSlice) -> ShardSlice:
    if shard_slice.aliased:
        return shard_slice
    master = shard_slice.master.clone()
    return ShardSlice(shard_slice.bucket, shard_slice.start, shard_slice.end, master, shard_slice.params)


def choose_step_layout(
    optimizer: torch.optim.Optimizer, trainable: list[list[nn.Parameter]], config: ResolvedZeroConfig
) -> StepLayout:
    """The layout of each param group of `optimizer` (a chain decides per optimizer it holds); `trainable`: each
    group's trainable parameters.

    Raises:
        StepKindError: an optimizer that cannot be stepped in any layout (LBFGS, SparseAdam), by name.
        NotImplementedError: whole-tensor stepping with a feature it does not support yet, naming the key.
    """
    owners = group_owners(optimizer)
    kinds = [step_kind(inner) for inner in owners]
    whole = frozenset(i for i, kind in enumerate(kinds) if kind is StepKind.WHOLE_TENSORS)
    reasons = tuple(dict.fromkeys(describe(type(owners[i])) for i in sorted(whole)))
    group_of = {id(p): i for i, params in enumerate(trainable) if i in whole for p in params}
    if whole:
        _refuse_unsupported(config, reasons)
    return StepLayout(whole, group_of, reasons)


def _refuse_unsupported(config: ResolvedZeroConfig, reasons: tuple[str, ...]) -> None:
    zero = config.zero_optimization
    why = f"{', '.join(reasons)} steps each parameter whole on one rank (it reads the parameter's shape)"
    problems = []
    for key, block in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if block is not None and block.device == "nvme":
            problems.append(f"zero_optimization.{key}.device=nvme: not available with whole-tensor stepping; use cpu")
    if config.expert_parallel.enabled:
        problems.append("expert_parallel: split experts are not stepped whole yet; train without expert_parallel")
    if problems:
        listed = "\n- ".join(problems)
        raise NotImplementedError(f"{why}, and this config asks for what that layout lacks:\n- {listed}")


def owned_step_for(
    layout: StepLayout,
    buckets: list[GradBucket],
    held: list[ShardSlice],
    dp: DataParallelGroup,
    stats: CommStats,
    config: ResolvedZeroConfig,
    device: torch.device,
    host_memory: HostMemory,
) -> OwnedTensors | None:
    """The owner step of the whole-tensor groups (None when every group steps flat shards).

    Args:
        buckets: the reducer's buckets, in launch order (the same on every rank).
        held: this rank's slices of the whole groups (`StepLayout.split`).
        device: the compute device (where masters live, and the exchange buffers).
        host_memory: where masters live under optimizer offload.
    """
    if not layout.any_whole:
        return None
    groups = [[layout.group_of.get(id(b.params[slot.param_index])) for slot in b.plan.slots] for b in buckets]
    plan = plan_owners([(b.plan, of_slots) for b, of_slots in zip(buckets, groups, strict=True)])
    on_host = offload_policy(config).optimizer

    def make_master(shape: tuple[int, ...]) -> torch.Tensor:
        if on_host:
            return host_memory.zeros(math.prod(shape), torch.float32).view(shape)
        return torch.zeros(shape, dtype=torch.float32, device=device)

    grad_dtypes = {b.grad_dtype for b in buckets} or {torch.float32}
    return OwnedTensors(
        plan,
        buckets,
        held,
        dp,
        stats,
        device=device,
        grad_dtype=grad_dtypes.pop(),
        value_dtype=config.compute_dtype,
        make_master=make_master,
    )
