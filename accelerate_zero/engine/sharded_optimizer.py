"""ShardedOptimizer: the user's torch optimizer stepping this rank's fp32 shard, then the all-gather.

The user's optimizer object is kept and its param groups are switched in place to the master shards (as
accelerate does for FSDP2), so its class, hyperparameters, groups, and any LR scheduler bound to it keep working.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats, Pending
from accelerate_zero.engine.flat_buffer import GroupShard
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.loss_scaler import LossScaler


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float
    """Global L2 norm of the unscaled gradient, before clipping (inf/nan on overflow)."""
    overflow: bool
    """True when the step was skipped because a gradient was not finite."""


class ShardedOptimizer:
    """Steps the local shard and rebuilds the full parameters on every rank."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: list[GroupShard],
        dp: DataParallelGroup,
        stats: CommStats,
        *,
        gradient_clipping: float,
        loss_scaler: LossScaler | None,
        check_overflow: bool,
        allgather_bucket_numel: int,
        allgather_partitions: bool,
    ) -> None:
        self.optimizer, self.groups, self.dp, self.stats = optimizer, groups, dp, stats
        self.gradient_clipping, self.loss_scaler, self.check_overflow = gradient_clipping, loss_scaler, check_overflow
        self.allgather_bucket_numel, self.allgather_partitions = allgather_bucket_numel, allgather_partitions
        self.sharded = any(g.plan.num_shards > 1 for g in groups)

    def switch_param_groups(self) -> None:
        """Points the optimizer's param groups at the master shards (one tensor per bucket)."""
        if self.optimizer.state:
            raise ValueError(
                "the optimizer already has state (was it stepped before accelerate_zero.initialize?): pass a fresh "
                "optimizer; its state would belong to the unsharded parameters"
            )
        for param_group, shard in zip(self.optimizer.param_groups, self.groups, strict=True):
            param_group["params"] = list(shard.master)

    # -------------------------------------------------------------------- step
    def step(self) -> StepOutcome:
        """Clips, unscales and steps the shard, copies it into the 16-bit parameters and all-gathers them."""
        grads = [bucket.reduced_shard() for shard in self.groups for bucket in shard.buckets]
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        norm = self._global_norm(grads) / scale
        overflow = self.check_overflow and not math.isfinite(norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        if overflow:
            return StepOutcome(grad_norm=norm, overflow=True)
        coefficient = 1.0 / scale
        if self.gradient_clipping > 0:
            # Same coefficient as torch.nn.utils.clip_grad_norm_, folded into the unscale multiply.
            coefficient *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        self._attach_grads(coefficient)
        self.optimizer.step()
        self._detach_grads()
        self._publish_params()
        return StepOutcome(grad_norm=norm, overflow=False)

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        if not grads:
            return 0.0
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        sum_sq = torch.stack(norms).square().sum()
        if self.sharded:
            # Each element belongs to exactly one rank's shard: summing the squares over ranks gives the full norm.
            collectives.all_reduce(sum_sq, self.dp, self.stats)
        return sum_sq.sqrt().item()

    def _attach_grads(self, coefficient: float) -> None:
        for shard in self.groups:
            for bucket, master in zip(shard.buckets, shard.master, strict=True):
                grad = bucket.reduced_shard()
                if grad.dtype != master.dtype or grad.device != master.device:
                    grad = grad.to(dtype=master.dtype, device=master.device)
                if coefficient != 1.0:
                    grad.mul_(coefficient)
                master.grad = grad

    def _detach_grads(self) -> None:
        for shard in self.groups:
            for master in shard.master:
                master.grad = None

    def _publish_params(self) -> None:
        in_flight: collections.deque[tuple[Pending, int]] = collections.deque()
        live = 0
        for shard in self.groups:
            for index in range(len(shard.buckets)):
                if not shard.master_aliases_params:
                    shard.param_shard(index).copy_(shard.master[index])
                if not self.sharded:
                    continue
                for pending in self._gather_bucket(shard, index):
                    in_flight.append((pending, shard.plan.buckets[index].numel))
                    live += shard.plan.buckets[index].numel
                # allgather_bucket_size bounds the elements being gathered at once.
                while live > self.allgather_bucket_numel and len(in_flight) > 1:
                    pending, numel = in_flight.popleft()
                    pending.wait()
                    live -= numel
        for pending, _ in in_flight:
            pending.wait()

    def _gather_bucket(self, shard: GroupShard, index: int) -> list[Pending]:
        full = shard.bucket_params(index)
        if self.allgather_partitions:
            return [collectives.all_gather(full, shard.param_shard(index), self.dp, self.stats, async_op=True)]
        # allgather_partitions=false: DeepSpeed's alternative, one broadcast per owner.
        bucket = shard.plan.buckets[index]
        pendings = []
        for owner in range(self.dp.world_size):
            lo, hi = bucket.shard_range(owner)
            pendings.append(collectives.broadcast(full[lo:hi], owner, self.dp, self.stats, async_op=True))
        return pendings

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Master weights and optimizer state tensors (for memory accounting)."""
        masters = [m for shard in self.groups if not shard.master_aliases_params for m in shard.master]
        states = [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        return {"master_weights": masters, "optimizer_states": states}
