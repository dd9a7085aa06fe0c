"""PipelinedHostStep: the host optimizer step of `offload_optimizer: cpu`, chunk by chunk, each chunk's upload
running while the next chunk steps.

[Note: the pipelined host step]
Stepping every master at once and only then copying them into the device parameters leaves the GPU idle for the whole
host AdamW and the host idle for the whole upload. Here the slices are cut, in the order of the parameters' buckets
(the order the next forward reads them in), into chunks of at most `sub_group_size` elements (DeepSpeed's tile of the
offloaded step, capped at `CHUNK_NUMEL` so that a model under a billion parameters is cut too); each chunk is stepped
with the user's optimizer (its param groups narrowed to the chunk, as the NVMe sub-groups are) and its masters are
copied into the parameters at once: the copy is asynchronous from pinned memory (engine/host_copies.py `into_device`),
so it runs on the GPU while the host steps the next chunk. The arithmetic is the same as one step over every slice:
each master is stepped once, with the same gradient, coefficient and per-parameter state, and per-element optimizers
(AdamW, SGD, Adagrad, ...) do not look across parameters. Optimizer step hooks run once per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.engine.stores import StepsInMemory


if TYPE_CHECKING:
    from accelerate_zero.engine.stores import SliceStepper


CHUNK_NUMEL = 1 << 24
"""The most elements a chunk holds whatever `sub_group_size` says (64 MiB of fp32 masters; ~60 chunks at 1B)."""


def cut_chunks(slices_by_group: list[list[ShardSlice]], chunk_numel: int) -> list[list[tuple[int, ShardSlice]]]:
    """(param group index, slice) runs of at most `chunk_numel` elements (a larger slice is a chunk of its own), in
    the order of the buckets: a bucket's slices in every param group together, buckets in the order they first
    appear in `slices_by_group` (at stage 3 a unit's weights and its biases or norms in another group are stepped
    together, in the next forward's order: [Note: the host step across the step boundary] in
    engine/step_in_flight.py)."""
    entries = [(group, shard_slice) for group, slices in enumerate(slices_by_group) for shard_slice in slices]
    first: dict[int, int] = {}
    for _, shard_slice in entries:
        first.setdefault(id(shard_slice.bucket), len(first))
    entries.sort(key=lambda entry: first[id(entry[1].bucket)])  # stable: a bucket's slices keep their order
    chunks: list[list[tuple[int, ShardSlice]]] = []
    filled = 0
    for group, shard_slice in entries:
        size = shard_slice.end - shard_slice.start
        if chunks and filled + size <= chunk_numel:
            chunks[-1].append((group, shard_slice))
            filled += size
        else:
            chunks.append([(group, shard_slice)])
            filled = size
    return chunks


class PipelinedHostStep(StepsInMemory):
    """A `StepRunner` (engine/stores.py) for masters in host memory ([Note: the pipelined host step]): held in
    memory like `StepsInMemory`'s, stepped chunk by chunk."""

    on_host = True

    def __init__(self, slices_by_group: list[list[ShardSlice]], sub_group_size: int) -> None:
        super().__init__([s for group in slices_by_group for s in group])
        self.chunks = cut_chunks(slices_by_group, max(1, min(sub_group_size, CHUNK_NUMEL)))

    def step(self, sharded: SliceStepper, coefficient: float) -> None:
        self.step_where(sharded, coefficient, None)

    def step_where(self, sharded: SliceStepper, coefficient: float, keep: Callable[[ShardSlice], bool] | None) -> None:
        """Steps the slices `keep` accepts (None: all), chunk by chunk; the others are left as they are."""
        chunks = self.chunks if keep is None else [[(g, s) for g, s in c if keep(s)] for c in self.chunks]
        chunks = [chunk for chunk in chunks if chunk]
        if len(chunks) < 2 and keep is None:
            sharded.step_slices(self.slices, coefficient)
            return
        groups = sharded.optimizer.param_groups
        every = [group["params"] for group in groups]
        try:
            for chunk in chunks:
                for index, group in enumerate(groups):
                    group["params"] = [s.master for g, s in chunk if g == index]
                # steps the chunk, then issues its upload, which runs while the loop steps the next chunk
                sharded.step_slices([s for _, s in chunk], coefficient)
        finally:
            for group, params in zip(groups, every, strict=True):
                group["params"] = params
