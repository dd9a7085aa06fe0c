"""How a loss over cut sequences is normalised: one rule for every trainer whose ranks share sequences (the SFT loss
here; a GRPO or DPO loss under sequence parallelism reuses `group_loss` with its own items and count).

[Note: loss normalisation under sequence parallelism]
Without sequence parallelism, transformers' Trainer (and TRL's SFT) normalise by the whole optimizer step: each
rank's loss is the sum of its token losses divided by `num_items_in_batch`, the labelled tokens of every
micro-batch of the step on every rank, times the number of ranks (the gradients are then averaged over them).
The step's gradient is the gradient of (sum of the step's token losses) / (their count), whatever the lengths
and the accumulation. Turning sp on must not change that.

Under sp a rank holds a slice of a sequence; the engine averages gradients over all W ranks, and the p ranks of a
group each hold 1/p of the group's tokens. `group_loss` turns a rank's sum of item losses into the value to back-
propagate: its part is `local_sum * dp / normalizer` (dp = W / p), and the group adds the parts with an
all-reduce whose backward is an all-reduce too, so each rank's backward reaches every slice and the group's
gradient is p times its parts'. The engine's mean over W then leaves exactly
    d(sum over every rank's local_sum) / normalizer,
and every rank of a group reports the same value (the group's sum, times dp / normalizer); averaged over the
ranks, as the Trainer logs it, it is (sum of the step's losses) / normalizer.

The rules (`LossNormalization`) differ only in the normalizer:
* `accumulated_tokens`, the default: the labelled tokens of the whole step on every rank (transformers'
  `num_items_in_batch`, counted on the cut micro-batches: each rank's slices are disjoint, so nothing is counted
  twice). Equal to the Trainer without sp. With `average_tokens_across_devices=False`, transformers normalises
  each rank by its own tokens; under sp a group stands for a rank: dp x the group's tokens of the step.
* `deepspeed_alst`, only when asked for by name: dp x the group's labelled tokens of this micro-batch, and the
  Trainer divides by the accumulation steps: each micro-batch's token mean, averaged over the micro-batches and
  the groups (DeepSpeed ALST's rule, transformers' `deepspeed_sp_compute_loss`). With uneven lengths and
  accumulation it weighs a token of a short micro-batch more than one of a long micro-batch.
A loop of one's own (`ZeroAccelerator.sequence_parallel_loss` without `num_items_in_batch`) takes the micro-batch
normalizer: each micro-batch's token mean, as `model(**batch).loss` is without sp, so there too sp changes
nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.sequence.loader import IGNORE_INDEX


class LossNormalization(str, enum.Enum):
    """What the loss of cut sequences is divided by ([Note: loss normalisation under sequence parallelism])."""

    ACCUMULATED_TOKENS = "accumulated_tokens"
    """The labelled tokens of the whole optimizer step on every rank: transformers' rule, as without sp."""
    DEEPSPEED_ALST = "deepspeed_alst"
    """Each micro-batch's token mean, averaged over the accumulation steps: DeepSpeed ALST's rule (opt-in)."""

    @classmethod
    def parse(
        cls, value: str | LossNormalization, name: str = "sequence_parallel_loss_normalization"
    ) -> LossNormalization:
        """`value` as a `LossNormalization`.

        Raises:
            ValueError: `value` names no rule; the message names `name` and the choices.
        """
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(rule.value) for rule in cls)
            raise ValueError(f"{name}={value!r}: choose one of {choices}") from None


def labelled_tokens(batches: Iterable[dict[str, Any]]) -> torch.Tensor:
    """This rank's labelled tokens (`shift_labels` not -100) over `batches` (cut micro-batches), as a 0-d tensor."""
    counts = [(batch["shift_labels"] != IGNORE_INDEX).sum() for batch in batches if "shift_labels" in batch]
    return torch.stack(counts).sum() if counts else torch.tensor(0)


def summed(count: torch.Tensor, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
    """`count` summed over `group` (a new float64 tensor; at least 1, so that a step with no label gives a loss of
    0, not 0 / 0)."""
    total = count.detach().reshape(1).to(torch.float64).clone()
    collectives.all_reduce(total, group, stats, kind="all_reduce_sequence")
    return total[0].clamp(min=1)


def micro_batch_normalizer(
    shift_labels: torch.Tensor, group: DataParallelGroup, stats: CommStats, data_parallel_size: int
) -> torch.Tensor:
    """dp x the group's labelled tokens of this micro-batch: `group_loss` is then the micro-batch's token mean
    (the `deepspeed_alst` rule, and a loop's loss without `num_items_in_batch`)."""
    return summed((shift_labels != IGNORE_INDEX).sum(), group, stats) * data_parallel_size


def normalizer_for(
    shift_labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | float | None,
    group: DataParallelGroup,
    stats: CommStats,
    data_parallel_size: int,
) -> torch.Tensor:
    """`num_items_in_batch` (the step's normaliser) as a float64 tensor, or, None, this micro-batch's
    (`micro_batch_normalizer`)."""
    if num_items_in_batch is None:
        return micro_batch_normalizer(shift_labels, group, stats, data_parallel_size)
    return torch.as_tensor(num_items_in_batch, dtype=torch.float64, device=shift_labels.device).clamp(min=1)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        total = part.detach().clone()
        collectives.all_reduce(total, group, stats, kind="all_reduce_sequence")
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        collectives.all_reduce(grad, ctx.group, ctx.stats, kind="all_reduce_sequence")
        return grad, None, None


def group_loss(
    local_sum: torch.Tensor,
    normalizer: torch.Tensor | float,
    group: DataParallelGroup,
    stats: CommStats,
    data_parallel_size: int,
) -> torch.Tensor:
    """The loss to back-propagate on every rank of `group` so that the engine's gradient (its mean over all ranks)
    is d(sum over every rank's `local_sum`) / `normalizer` ([Note: loss normalisation under sequence
    parallelism]). Every rank of the group gets the same value.

    Args:
        local_sum: this rank's sum of item losses (tokens of its slice; a GRPO/DPO loss: its own items).
        normalizer: what the sum over every rank is divided by (the same on every rank of the group).
        group: the sequence-parallel group (a one-rank group without Ulysses).
        stats: the traffic counter.
        data_parallel_size: the number of groups (world size / group size).
    """
    part = local_sum * (data_parallel_size / normalizer)
    return _SumOverGroup.apply(part, group, stats)
