"""Rank 0 cuts a stage-3 unit into the ranks' shards without holding it whole ([Note: rank 0's weights, cut on rank
0] in engine/stage3/flat_unit.py; issue 44, item 12): a unit of several parameters is scattered in rounds of at most
`SCATTER_ROUND_NUMEL` elements, a unit of one parameter from views of it, and every rank receives its exact slice
(padding zeroed, cast to the compute dtype)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_zero.engine.stage3 import flat_unit
from accelerate_zero.engine.stage3.flat_unit import SCATTER_ROUND_NUMEL, build_flat


CPU = torch.device("cpu")


class _RecordingScatter:
    """Stands in for the collective on the rank that cuts: keeps what each call would send to every rank."""

    def __init__(self) -> None:
        self.calls: list[list[torch.Tensor]] = []
        self.storage_bytes: list[dict[int, int]] = []
        self.sizes: list[int] = []

    def receive(self, output: torch.Tensor, shards: list[torch.Tensor] | None) -> None:
        """What a rank that does not cut sees: only its output."""
        assert shards is None
        self.sizes.append(output.numel())

    def __call__(self, output: torch.Tensor, shards: list[torch.Tensor] | None) -> None:
        assert shards is not None
        self.calls.append([s.clone() for s in shards])
        # What a round costs the cutting rank: the storage its pieces live in, unless they are the parameter's own.
        self.storage_bytes.append({s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in shards})
        output.copy_(shards[0])


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(*shape, generator=gen, dtype=dtype)) for shape in shapes]


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_a_unit_of_several_parameters_is_cut_round_by_round(world: int, compute: torch.dtype) -> None:
    # 1.6M elements (not a multiple of 3: padding), larger than one round
    params = _params([(1000, 1200), (400, 1001), (7,)])
    values = [p.detach().reshape(-1).to(compute) for p in params]
    own = {id(p.untyped_storage()) for p in params}
    scatter = _RecordingScatter()
    flat = build_flat(params, 0, world, compute, CPU, scatter=scatter, cuts=True)
    assert len(scatter.calls) > 1
    for storages in scatter.storage_bytes:
        # never a unit-sized buffer: today's rank 0 flattened the whole unit (6.4 MB here) before scattering it
        assert sum(storages.values()) <= SCATTER_ROUND_NUMEL * 4, storages
    assert not own & {id(s) for s in storages}
    per_rank = [torch.cat([call[r] for call in scatter.calls]) for r in range(world)]
    padded = torch.zeros(flat.plan.numel, dtype=compute)  # the unit as the plan lays it out
    for slot in flat.plan.slots:
        padded[slot.offset : slot.offset + slot.numel] = values[slot.param_index]
    assert flat.plan.padding > 0 or world == 4
    for r in range(world):
        lo, hi = flat.plan.shard_range(r)
        assert torch.equal(per_rank[r], padded[lo:hi]), r
    assert torch.equal(flat.shard, padded[slice(*flat.plan.shard_range(0))])


def test_a_unit_of_one_parameter_is_sent_from_views_of_it() -> None:
    (param,) = _params([(2048, 1024)])
    storage = param.untyped_storage().data_ptr()
    expected = param.detach().reshape(-1).clone()
    scatter = _RecordingScatter()
    flat = build_flat([param], 0, 4, torch.float32, CPU, scatter=scatter, cuts=True)
    assert all(set(storages) == {storage} for storages in scatter.storage_bytes)
    shard = flat.plan.shard_numel
    for r in range(4):
        assert torch.equal(torch.cat([call[r] for call in scatter.calls]), expected[r * shard : (r + 1) * shard])


def test_the_receiving_ranks_run_the_same_rounds_as_the_cutting_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flat_unit, "SCATTER_ROUND_NUMEL", 64)
    shapes = [(30, 20), (11,)]
    sent = _RecordingScatter()
    build_flat(_params(shapes), 0, 4, torch.float32, CPU, scatter=sent, cuts=True)
    (single,) = _params([(40, 16)])
    sent_views = _RecordingScatter()
    build_flat([single], 0, 4, torch.float32, CPU, scatter=sent_views, cuts=True)
    for recorded, shapes_of in ((sent, shapes), (sent_views, [(40, 16)])):
        received = _RecordingScatter()
        build_flat(_params(shapes_of), 1, 4, torch.float32, CPU, scatter=received.receive)
        assert received.sizes == [call[0].numel() for call in recorded.calls]
