"""ShardSlice: a run of this rank's shard that the optimizer steps as one tensor (a data type every layer reads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from accelerate_zero.engine.buckets import GradBucket


@dataclass(frozen=True)
class ShardSlice:
    """A contiguous run of this rank's shard that one optimizer param group steps as one tensor."""

    bucket: GradBucket
    """Where the averaged gradient of this run comes from."""
    start: int
    end: int
    """The run, relative to the bucket's reduced shard."""
    master: torch.Tensor  # fp32, end - start; the same tensor as `params` when training in fp32
    params: torch.Tensor  # compute dtype, end - start: the stored shard of the parameters

    @property
    def aliased(self) -> bool:
        return self.master is self.params
