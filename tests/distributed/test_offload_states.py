"""`engine.offload_states()` / `reload_states()` (issue 33, item 1; [Note: sleeping moves storages, not tensors] in
engine/sleep.py): DeepSpeed's API, as TRL, OpenRLHF and verl call it between rollouts.

One spawned group per world size runs, for stages 0-3 in fp32 and bf16 (and stage 3 with optimizer offload):
a run that trains 3 steps straight, and a run that trains 1 step, offloads everything (no arguments, as TRL and
OpenRLHF call it), checks that the engine holds no training state on its device (`memory_breakdown()` counts
every storage the engine holds: all zero), that a forward, a backward and a step refuse while asleep, reloads and
trains 2 more steps: the weights after are bit-identical to the straight run's. A run with `include` moves only
the optimizer state and keeps the parameters; bad arguments are refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import gathered_flat, make_batches, make_model, train_steps


STATE_KINDS = ("parameters", "gradients", "master_weights", "optimizer_states")
CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (3, "offload")]


def _engine(stage: int, precision: str) -> Any:
    import accelerate_zero

    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if precision == "offload":
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": zero,
    }
    model = make_model()
    return model, accelerate_zero.initialize(model, config=config)


def _refusals(engine: Any, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    said = []
    for action in (lambda: engine(x), lambda: engine.backward(torch.zeros((), requires_grad=True)), engine.step):
        try:
            action()
        except RuntimeError as error:
            said.append(str(error))
    return said


def _case(stage: int, precision: str, rank: int, world_size: int) -> dict[str, Any]:
    batches = make_batches(3, 1, 2 * world_size)
    model, engine = _engine(stage, precision)
    train_steps(engine, batches, rank, world_size, range(3))
    straight = gathered_flat(model)

    model, engine = _engine(stage, precision)
    train_steps(engine, batches, rank, world_size, range(1))
    awake = engine.memory_breakdown()
    engine.offload_states()
    asleep = engine.memory_breakdown()
    refusals = _refusals(engine, *batches.rank_slice(1, 0, rank, world_size))
    engine.reload_states()
    train_steps(engine, batches, rank, world_size, range(1, 3))
    slept = gathered_flat(model)

    model, engine = _engine(stage, precision)
    train_steps(engine, batches, rank, world_size, range(1))
    engine.offload_states(include=["optim_states"], pin_memory=False)
    only_optimizer = engine.memory_breakdown()
    engine.reload_states()
    train_steps(engine, batches, rank, world_size, range(1, 3))
    return {
        "identical": torch.equal(straight, slept),
        "identical_include": torch.equal(straight, gathered_flat(model)),
        "awake": awake,
        "asleep": asleep,
        "only_optimizer": only_optimizer,
        "refusals": refusals,
    }


def _bad_arguments(rank: int, world_size: int) -> list[str]:
    _, engine = _engine(3, "fp32")
    said = []
    for kwargs in ({"include": ["optimizer_states"]}, {"device": "nvme"}):
        try:
            engine.offload_states(**kwargs)
        except ValueError as error:
            said.append(str(error))
    return said


def _all(rank: int, world_size: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {case: _case(*case, rank, world_size) for case in CASES}
    out["bad"] = _bad_arguments(rank, world_size)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def by_rank(request: pytest.FixtureRequest) -> list[dict[Any, Any]]:
    return run_distributed(_all, request.param)


@pytest.mark.parametrize("case", CASES, ids=[f"s{stage}-{precision}" for stage, precision in CASES])
def test_sleeping_leaves_no_state_on_the_device_and_training_resumes_bit_identical(
    by_rank: list[dict[Any, Any]], case: tuple[int, str]
) -> None:
    for rank, results in enumerate(by_rank):
        got = results[case]
        assert got["identical"], (rank, case)
        assert (
            got["awake"]["parameters"] > 0
            and got["awake"]["optimizer_states"] + got["awake"].get("host_optimizer_states", 0) > 0
        )
        for kind in STATE_KINDS:
            assert got["asleep"][kind] == 0, (rank, case, kind, got["asleep"])
        assert got["asleep"]["total"] == 0, got["asleep"]
        if case[1] == "offload":  # host memory the offload policy holds is not the device's: it stays
            assert got["asleep"]["host_optimizer_states"] == got["awake"]["host_optimizer_states"] > 0
        assert len(got["refusals"]) == 3 and all("reload_states()" in said for said in got["refusals"]), got


@pytest.mark.parametrize("case", CASES, ids=[f"s{stage}-{precision}" for stage, precision in CASES])
def test_include_moves_only_what_it_names(by_rank: list[dict[Any, Any]], case: tuple[int, str]) -> None:
    for results in by_rank:
        got = results[case]
        assert got["identical_include"], case
        assert got["only_optimizer"]["optimizer_states"] == 0
        assert got["only_optimizer"]["parameters"] == got["awake"]["parameters"] > 0


def test_unknown_states_and_devices_are_refused_by_name(by_rank: list[dict[Any, Any]]) -> None:
    for results in by_rank:
        unknown_state, unknown_device = results["bad"]
        assert "'optimizer_states'" in unknown_state and "optim_states" in unknown_state, unknown_state
        assert "'nvme'" in unknown_device and "'cpu'" in unknown_device, unknown_device
