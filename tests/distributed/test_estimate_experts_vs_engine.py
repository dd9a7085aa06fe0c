"""`accelerate-zero estimate --expert_parallel` is honest: what it predicts per rank is what the engine holds.

One spawned group of 4 ranks builds a tiny Qwen3-MoE (4 experts per layer) and a tiny Mixtral, for expert-parallel
sizes 2 (the experts' states partitioned over 2 peers) and 4 (one peer: nothing partitioned), ZeRO stages 1-3 (stage
3 with every parameter partitioned, and with the default persistence threshold), in fp32 and bf16 with AdamW, with
the default bucket size and with a small one (several buckets, each padded to the peers), takes one optimizer step
and one more backward, and returns `engine.memory_breakdown()` (the whole state held: the gradient shards live
until the step) beside `estimate_expert_parallel(...)` for the same rank ([Note: what expert parallelism holds, per
rank] in debug/estimate_experts.py). The model states must be equal byte for byte, kind by kind. At ep 2, stage 3
(the experts cut over their peers) the engine also holds what flat stage 3 holds for the same model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.test_expert_parallel import _model


WORLD_SIZE = 4
MODEL_STATES = ("parameters", "gradients", "master_weights", "optimizer_states")
SMALL_BUCKETS = {"reduce_bucket_size": 3000}
CASES = [
    ("qwen3_moe", ep, stage, precision, zero)
    for ep in (2, 4)
    for stage in (1, 2, 3)
    for precision in ("no", "bf16")
    for zero in ("default", "small_buckets")
] + [
    ("qwen3_moe", 2, 3, "no", "default_persistence"),
    ("mixtral", 2, 3, "bf16", "small_buckets"),
    ("mixtral", 4, 2, "no", "default"),
]


def _zero(stage: int, zero: str) -> dict[str, Any]:
    out: dict[str, Any] = {"stage": stage}
    if zero == "small_buckets":
        out.update(SMALL_BUCKETS)
    if stage == 3 and zero != "default_persistence":
        out["stage3_param_persistence_threshold"] = 0
    return out


def _flat_stage_3(rank: int) -> dict[str, int]:
    """What the same Qwen3-MoE holds at stage 3 without expert parallelism (every parameter partitioned)."""
    import accelerate_zero

    model = _model("qwen3_moe")
    config = {"zero_optimization": _zero(3, "default")}
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    generator = torch.Generator().manual_seed(rank)
    for step in range(2):
        tokens = torch.randint(0, 64, (2, 9), generator=generator)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        if step == 0:
            engine.step()
    measured = engine.memory_breakdown()
    engine.destroy()
    return measured


def _one(case: tuple, rank: int) -> dict[str, Any]:
    import accelerate_zero
    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.debug.estimate import TrainingSetup
    from accelerate_zero.debug.estimate_experts import estimate_expert_parallel, expert_shapes_from_module

    kind, ep, stage, precision, zero = case
    model = _model(kind)
    config = {
        "zero_optimization": _zero(stage, zero),
        "bf16": {"enabled": precision == "bf16"},
        "expert_parallel": {"enabled": True, "autoep_size": ep},
    }
    zero_config = ZeroConfig.from_any(config).zero_optimization
    setup = TrainingSetup(WORLD_SIZE, precision, "adamw", zero=zero_config)
    # Shapes before initialize: the engine splits the experts and flattens (at stage 3 empties) the parameters.
    estimate = estimate_expert_parallel(expert_shapes_from_module(model, ep, zero_config), setup, stage, rank=rank)
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):  # a step makes the optimizer states; the second backward holds every gradient shard
        tokens = torch.randint(0, 64, (2, 9), generator=generator)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        if _ == 0:
            engine.step()
    measured = engine.memory_breakdown()
    engine.destroy()
    return {"measured": measured, "estimated": dict(estimate.device)}


def _all(rank: int, world_size: int) -> dict[Any, Any]:
    return {**{case: _one(case, rank) for case in CASES}, "flat stage 3": _flat_stage_3(rank)}


@pytest.fixture(scope="module")
def by_rank() -> list[dict[Any, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_all, WORLD_SIZE)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, case)) for case in CASES])
def test_model_state_bytes_match_the_engine(by_rank: list[dict[Any, Any]], case: tuple) -> None:
    for rank, results in enumerate(by_rank):
        got = results[case]
        for kind in MODEL_STATES:
            assert got["estimated"][kind] == got["measured"][kind], (rank, kind, got)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, case)) for case in CASES])
def test_reduce_buffers_bound_what_the_engine_used(by_rank: list[dict[Any, Any]], case: tuple) -> None:
    for results in by_rank:
        got = results[case]
        assert got["estimated"]["communication_buffers"] >= got["measured"]["communication_buffers_peak"], got


def test_experts_below_one_ep_th_hold_what_flat_stage_3_holds(by_rank: list[dict[Any, Any]]) -> None:
    """At ep 2 on 4 ranks, stage 3 cuts each rank's experts over their 2 peers ([Note: experts below 1/ep at stage
    3] in engine/experts/gather_units.py): the parameters and gradients held are flat stage 3's, byte for byte (no
    padding in this model); the optimizer states differ by AdamW's `step` scalar of each extra unit only."""
    for results in by_rank:
        split, flat = results[("qwen3_moe", 2, 3, "no", "default")]["measured"], results["flat stage 3"]
        for kind in ("parameters", "gradients", "master_weights"):
            assert split[kind] == flat[kind], (kind, split, flat)
        assert 0 <= split["optimizer_states"] - flat["optimizer_states"] <= 2 * 4, (split, flat)
