"""The engine's collectives on gloo, where it runs its own algorithms ([Note: reduce-scatter on gloo], [Note:
all-gather on gloo], [Note: a reduce-scatter of pieces] in engine/collectives.py): results equal the definition at 2
and 3 ranks, in place or not, as one buffer or as pieces, synchronous or not, and the bytes recorded are the ring
convention's. A stage-2/3 bucket that keeps autograd's gradients ([Note: a bucket that keeps autograd's gradients] in
engine/buckets.py) reduces them without copying, to the same bits as the bucket that copies.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed


SHARD = 37  # odd, so slices do not line up with anything


def _checks(rank: int, world_size: int) -> dict[str, Any]:
    from accelerate_zero.engine import collectives
    from accelerate_zero.engine.collectives import CommStats
    from accelerate_zero.engine.groups import init_data_parallel_group

    dp = init_data_parallel_group(torch.device("cpu"))
    assert dp.backend == "gloo"
    everyone = [torch.arange(SHARD, dtype=torch.float32) + 1000 * r for r in range(world_size)]
    expected_gather = torch.cat(everyone)
    partial = [torch.linspace(-1, 1, SHARD * world_size) * (r + 1) for r in range(world_size)]
    expected_sum = sum(partial)
    out: dict[str, Any] = {}
    for async_op in (False, True):
        for in_place in (False, True):
            stats = CommStats()
            full = torch.full((SHARD * world_size,), float("nan"))
            source = full[rank * SHARD : (rank + 1) * SHARD] if in_place else everyone[rank].clone()
            if in_place:
                source.copy_(everyone[rank])
            pending = collectives.all_gather(full, source, dp, stats, async_op=async_op)
            pending.wait()
            gathered = torch.equal(full, expected_gather)
            reduced = 0.0
            # In rounds of 10 elements (3 or 5 columns per rank, the last round partial) as in one.
            for round_numel in (collectives.GLOO_ROUND_NUMEL, 10):
                default, collectives.GLOO_ROUND_NUMEL = collectives.GLOO_ROUND_NUMEL, round_numel
                try:
                    buffer = partial[rank].clone()
                    shard = buffer[rank * SHARD : (rank + 1) * SHARD] if in_place else torch.empty(SHARD)
                    collectives.reduce_scatter(shard, buffer, dp, stats, async_op=async_op).wait()
                finally:  # the rank serves other tests
                    collectives.GLOO_ROUND_NUMEL = default
                reduced = max(reduced, (shard - expected_sum[rank * SHARD : (rank + 1) * SHARD]).abs().max().item())
            counts = stats.as_dict()
            key = f"{'async' if async_op else 'sync'}-{'in_place' if in_place else 'copy'}"
            out[key] = {"gathered": gathered, "reduced": reduced, "counts": counts}
    received = torch.full((SHARD,), float("nan"))
    collectives.scatter(received, everyone if rank == 0 else None, dp, CommStats())
    out["scatter"] = torch.equal(received, everyone[rank])
    # The temporary a reduce-scatter receives into: the W - 1 other partial sums of one round, a round being at most
    # a 1/GLOO_MIN_ROUNDS of the chunk ([Note: reduce-scatter on gloo]).
    scratch = _RecordingScratch()
    buffer = partial[rank].clone()
    own = buffer[rank * SHARD : (rank + 1) * SHARD]
    collectives.reduce_scatter(own, buffer, dp, CommStats(), scratch=scratch).wait()
    out["temporaries"] = scratch.taken
    return out


class _RecordingScratch:
    """ScratchBuffers that records the sizes taken."""

    def __init__(self) -> None:
        from accelerate_zero.engine.scratch import ScratchBuffers

        self.inner, self.taken = ScratchBuffers(torch.device("cpu")), []

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.taken.append(numel)
        return self.inner.take(numel, dtype)

    def give(self, tensor: torch.Tensor) -> None:
        self.inner.give(tensor)


# Piece sizes that cut chunks anywhere: inside a chunk, exactly at a chunk's end, an empty piece, one that spans
# several chunks (W * 37 elements in all at W = 2 and 3: the last piece takes what is left).
PIECES = [5, 32, 0, 1, 29]


def _pieces_checks(rank: int, world_size: int) -> dict[str, Any]:
    from accelerate_zero.engine import collectives
    from accelerate_zero.engine.collectives import CommStats
    from accelerate_zero.engine.groups import init_data_parallel_group

    dp = init_data_parallel_group(torch.device("cpu"))
    total = SHARD * world_size
    sizes = [*PIECES, total - sum(PIECES)]
    partial = [torch.linspace(-1, 1, total) * (r + 1) + r / 7 for r in range(world_size)]
    expected = sum(partial)[rank * SHARD : (rank + 1) * SHARD]
    out: dict[str, Any] = {}
    for round_numel in (collectives.GLOO_ROUND_NUMEL, 10):  # one round per chunk, or rounds cut inside pieces
        default, collectives.GLOO_ROUND_NUMEL = collectives.GLOO_ROUND_NUMEL, round_numel
        try:
            pieces = [piece.clone() for piece in partial[rank].split(sizes)]
            stats = CommStats()
            collectives.reduce_scatter_pieces(pieces, dp, stats, async_op=True).wait()
        finally:  # the rank serves other tests
            collectives.GLOO_ROUND_NUMEL = default
        got = torch.cat(pieces)[rank * SHARD : (rank + 1) * SHARD]
        others = torch.cat(pieces)[: rank * SHARD], torch.cat(pieces)[(rank + 1) * SHARD :]
        out[f"exact at {round_numel}"] = torch.equal(got, expected)
        out[f"others untouched at {round_numel}"] = torch.equal(
            torch.cat(others), torch.cat([partial[rank][: rank * SHARD], partial[rank][(rank + 1) * SHARD :]])
        )
        out["bytes"] = stats.as_dict()["reduce_scatter"]["payload_bytes"]
    try:
        collectives.reduce_scatter_pieces([torch.zeros(total + 1)], dp, CommStats())
        out["uneven"] = "accepted"
    except ValueError as error:
        out["uneven"] = str(error)
    out["bucket"] = _bucket_checks(rank, world_size, dp)
    return out


def _bucket_checks(rank: int, world_size: int, dp: Any) -> dict[str, Any]:
    """Two micro-steps into a stage-2/3 bucket of uneven parameters, one keeping autograd's gradients and reducing
    pieces, one copying them into a buffer; rank 1 gives no gradient to one parameter in the second micro-step."""
    from accelerate_zero.engine.buckets import GradBucket, GradScaling, ReduceMode
    from accelerate_zero.engine.collectives import CommStats
    from accelerate_zero.engine.shard_plan import plan_group

    shapes = [(7, 15), (5,), (3, 4)]
    (plan,) = plan_group(shapes, 10**6, world_size).buckets
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    mode, fp32 = ReduceMode.SCATTER_TO_SHARD, torch.float32
    keeping = GradBucket(plan, mode, rank, fp32, fp32, torch.device("cpu"), None, params)
    copying = GradBucket(plan, mode, rank, fp32, fp32, torch.device("cpu"), None, params)
    scaling = GradScaling(world_size, False, 1.0, fp32)
    gen = torch.Generator().manual_seed(10 + rank)
    kept_without_copy = []
    for micro in range(2):
        for slot in plan.slots:
            if micro == 1 and rank == 1 and slot.param_index == 1:
                continue
            grad = torch.randn(slot.shape, generator=gen)
            keeping.add_grad(slot, grad, keep=True)
            copying.add_grad(slot, grad.clone())
            kept_without_copy.append(any(t.data_ptr() == grad.data_ptr() for t in keeping.transient_tensors()))
        no_buffer = keeping.grad is None
        keeping.start_reduce(dp, CommStats(), scaling, True, async_op=True, pieces=True)
        copying.start_reduce(dp, CommStats(), scaling, True, async_op=True)
        keeping.finish_reduce()
        copying.finish_reduce()
    return {
        "same bits": torch.equal(keeping.reduced_shard(), copying.reduced_shard()),
        "kept without copy": all(kept_without_copy) and no_buffer,
        "released": keeping.transient_tensors() == [],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_reduce_scatter_of_pieces_and_a_bucket_keeping_autograds_gradients_are_exact(world_size: int) -> None:
    for rank, r in enumerate(run_distributed(_pieces_checks, world_size)):
        assert "do not split into" in r.pop("uneven"), rank
        assert r.pop("bytes") == 4 * SHARD * world_size, rank
        assert r.pop("bucket") == {"same bits": True, "kept without copy": True, "released": True}, rank
        assert all(r.values()), (rank, r)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_all_gather_and_reduce_scatter_equal_their_definitions(world_size: int) -> None:
    ring = (world_size - 1) / world_size
    for r in run_distributed(_checks, world_size):
        assert r.pop("scatter")  # rank 0's list, one tensor to each rank
        # gloo's all-to-all received every rank's chunk, its own included, in one round: W x 37 elements here.
        assert r.pop("temporaries") == [(world_size - 1) * -(-SHARD // 4)]
        for key, result in r.items():
            assert result["gathered"], key
            # In place it is ours, summed in rank order as `sum(partial)` is; otherwise torch's own (another order).
            assert result["reduced"] <= (0.0 if key.endswith("in_place") else 1e-6), (key, result["reduced"])
            full_bytes = 4 * SHARD * world_size
            assert result["counts"]["all_gather"]["bytes_per_rank"] == pytest.approx(full_bytes * ring), key
            assert result["counts"]["reduce_scatter"]["bytes_per_rank"] == pytest.approx(2 * full_bytes * ring), key
