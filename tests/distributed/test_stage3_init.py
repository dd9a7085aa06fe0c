"""Stage 3 places a model built anywhere on the device unit by unit, one scatter from rank 0 per unit.

[Note: stage 3 initialisation, unit by unit] in engine/stage3/build.py and [Note: rank 0's weights, cut on rank 0]
in engine/stage3/flat_unit.py. Each rank builds a tiny Llama with its own seed (a different init per rank); after
`initialize` every rank's gathered weights are rank 0's. While the engine initialises, every collective is
recorded: a unit's parameters travel in one scatter of the unit's padded flat buffer (never one per parameter, and
never a broadcast of the whole unit), and the model is not moved to the device as a whole before its units are
sharded (on a GPU that move is what would put the whole model on every device). Ranks other than 0 never read
their own parameters: built on the meta device there, the model trains as the one built everywhere.
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
    real_broadcast, real_scatter, real_place_rest = collectives.broadcast, collectives.scatter, build._place_rest

    def recording_broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        events.append(("broadcast", tensor.numel()))
        return real_broadcast(tensor, *args, **kwargs)

    def recording_scatter(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        events.append(("scatter", output.numel() * world_size))
        return real_scatter(output, *args, **kwargs)

    def recording_place_rest(*args: Any, **kwargs: Any) -> None:
        events.append(("module.to", 0))
        real_place_rest(*args, **kwargs)

    model = _build(seed=rank)  # different on every rank: rank 0's must win
    collectives.broadcast, collectives.scatter = recording_broadcast, recording_scatter
    build._place_rest = recording_place_rest
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zero = {"stage": 3, "stage3_param_persistence_threshold": 64}
        engine = accelerate_zero.initialize(model, optimizer, config={"zero_optimization": zero})
    finally:  # the rank serves other tests
        collectives.broadcast, collectives.scatter, build._place_rest = real_broadcast, real_scatter, real_place_rest
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


def test_one_scatter_per_unit_and_the_model_moved_only_after_its_units(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    _, by_rank = results
    for got in by_rank:
        scattered = sorted(numel for kind, numel in got["events"] if kind == "scatter")
        broadcast = [numel for kind, numel in got["events"] if kind == "broadcast"]
        # every unit flat is scattered whole, once, and no unit travels whole to every rank
        assert scattered == got["unit_numels"], (scattered, got["unit_numels"])
        assert not [s for s in broadcast if s in got["unit_numels"]], broadcast
        # ... and none of the units' parameters on its own (sizes of unit parameters that are no unit's size)
        assert got["num_unit_params"] > len(got["unit_numels"])
        strays = [s for s in broadcast if s in got["unit_param_numels"] and s not in got["unit_numels"] and s > 64]
        assert not strays, strays
        # the whole-model move (`module.to`) comes after the last unit was broadcast
        kinds = [kind for kind, _ in got["events"]]
        last_unit = max(i for i, (kind, numel) in enumerate(got["events"]) if numel in got["unit_numels"])
        assert kinds.index("module.to") > last_unit, got["events"]


def _train_one_step(rank: int, world_size: int, meta_beyond_rank_0: bool) -> dict[str, Any]:
    """Rank 0 builds the model; the others too, or (`meta_beyond_rank_0`) only on the meta device, as accelerate's
    FSDP `cpu_ram_efficient_loading` does. One step; the trained weights and the buffers come back."""
    from transformers import LlamaForCausalLM

    import accelerate_zero

    if rank == 0 or not meta_beyond_rank_0:
        model = _build(seed=0)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64},
    }
    engine = accelerate_zero.initialize(model, config=config)
    batch = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"trained": trained, "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def test_ranks_other_than_0_may_build_on_the_meta_device() -> None:
    meta = run_distributed(_train_one_step, 3, True)
    everywhere = run_distributed(_train_one_step, 3, False)
    expected = everywhere[0]["trained"]
    for rank, got in enumerate(meta):
        for name, value in got["trained"].items():
            assert torch.equal(value, expected[name]), (rank, name)
        for name, value in got["buffers"].items():
            assert torch.equal(value, meta[0]["buffers"][name]), (rank, name)


def _meta_on_rank_0(rank: int, world_size: int) -> str:
    from transformers import LlamaForCausalLM

    import accelerate_zero

    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1))
    try:
        accelerate_zero.initialize(
            model, torch.optim.AdamW(model.parameters()), config={"zero_optimization": {"stage": 3}}
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_rank_0_on_the_meta_device_is_refused_by_name() -> None:
    for message in run_distributed(_meta_on_rank_0, 2):
        assert "meta device on rank 0" in message, message


def test_below_stage_3_a_meta_parameter_is_refused_by_name() -> None:
    from accelerate_zero.engine.flat_buffer import flatten_params
    from accelerate_zero.engine.shard_plan import plan_group

    with torch.device("meta"):
        params = [torch.nn.Parameter(torch.empty(3, 5))]
    with pytest.raises(ValueError, match=r"shape \(3, 5\) is on the meta device.*only stage 3"):
        flatten_params(params, plan_group([(3, 5)], 100, 2), torch.float32, torch.device("cpu"))
