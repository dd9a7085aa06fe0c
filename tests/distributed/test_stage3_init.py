"""Stage 3 places a model built anywhere on the device unit by unit, one broadcast per unit.

[Note: stage 3 initialisation, unit by unit] in engine/stage3/build.py. Each rank builds a tiny Llama with its own
seed (a different init per rank); after `initialize` every rank's gathered weights are rank 0's. While the engine
initialises, every broadcast is recorded: a unit's parameters travel in one broadcast of the unit's padded flat
buffer (never one per parameter), and the model is not moved to the device as a whole before its units are
sharded (on a GPU that move is what would put the whole model on every device).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import tiny_llama_config


def _build(seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3))


def _init_and_record(rank: int, world_size: int) -> dict[str, Any]:
    import accelerate_zero
    from accelerate_zero.engine import collectives
    from accelerate_zero.engine.stage3 import build

    events: list[tuple[str, int]] = []
    real_broadcast, real_place_rest = collectives.broadcast, build._place_rest

    def recording_broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        events.append(("broadcast", tensor.numel()))
        return real_broadcast(tensor, *args, **kwargs)

    def recording_place_rest(*args: Any, **kwargs: Any) -> None:
        events.append(("module.to", 0))
        real_place_rest(*args, **kwargs)

    model = _build(seed=rank)  # different on every rank: rank 0's must win
    collectives.broadcast, build._place_rest = recording_broadcast, recording_place_rest
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zero = {"stage": 3, "stage3_param_persistence_threshold": 64}
        engine = accelerate_zero.initialize(model, optimizer, config={"zero_optimization": zero})
    finally:
        collectives.broadcast, build._place_rest = real_broadcast, real_place_rest  # the rank serves other tests
    reference = _build(seed=0)
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = dict(reference.named_parameters())
    unit_numels = sorted(flat.plan.numel for unit in engine.units for flat in unit.flats)
    unit_params = [p for unit in engine.units for flat in unit.flats for p in flat.params]
    return {
        "max_diff": max((gathered[n] - expected[n].detach()).abs().max().item() for n in gathered),
        "events": events,
        "unit_numels": unit_numels,
        "unit_param_numels": sorted(
            {slot.numel for unit in engine.units for flat in unit.flats for slot in flat.plan.slots}
        ),
        "num_unit_params": len(unit_params),
    }


@pytest.fixture(scope="module", params=[2, 3])
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_distributed(_init_and_record, request.param)


def test_every_rank_starts_from_rank_0s_weights(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, by_rank = results
    for rank, got in enumerate(by_rank):
        assert got["max_diff"] == 0.0, (rank, got["max_diff"])


def test_one_broadcast_per_unit_and_the_model_moved_only_after_its_units(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    _, by_rank = results
    for got in by_rank:
        sizes = [numel for kind, numel in got["events"] if kind == "broadcast"]
        # every unit flat is broadcast whole, once
        for numel in got["unit_numels"]:
            assert sizes.count(numel) >= 1, (numel, sizes)
        assert len([s for s in sizes if s in got["unit_numels"]]) >= len(got["unit_numels"])
        # ... and none of the units' parameters on its own (sizes of unit parameters that are no unit's size)
        assert got["num_unit_params"] > len(got["unit_numels"])
        strays = [s for s in sizes if s in got["unit_param_numels"] and s not in got["unit_numels"] and s > 64]
        assert not strays, strays
        # the whole-model move (`module.to`) comes after the last unit was broadcast
        kinds = [kind for kind, _ in got["events"]]
        last_unit = max(i for i, (kind, numel) in enumerate(got["events"]) if numel in got["unit_numels"])
        assert kinds.index("module.to") > last_unit, got["events"]
