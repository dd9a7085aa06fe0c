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


# ---- every entry point while asleep, the calls RL frameworks make (issue 44, items 1, 2, 5, 6, 7) ----------------
ENTRY_STAGES = (0, 1, 2, 3)


def _entry_points(engine: Any, model: Any, tmp: str) -> dict[str, Any]:
    """Every engine call that reads or writes a sleeping kind, and a sub-module forward and state_dict()."""
    return {
        "full_state_dict": engine.full_state_dict,
        "named_full_parameters": lambda: list(engine.named_full_parameters()),
        "save_16bit_model": lambda: engine.save_16bit_model(f"{tmp}/w16"),
        "save_checkpoint": lambda: engine.save_checkpoint(f"{tmp}/ckpt"),
        "load_checkpoint": lambda: engine.load_checkpoint(f"{tmp}/ckpt"),
        "sub_module_forward": lambda: model.mid(torch.zeros(2, 15)),
        "state_dict": lambda: model.state_dict(),
        "destroy": engine.destroy,
    }


def _asleep_entry_points(stage: int, rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Each entry point refuses while asleep, naming the sleep (no segfault, no storage error); after waking they
    all work and training goes on bit-identical to a run that never slept."""
    tmp = f"{tmp}/s{stage}"
    batches = make_batches(3, 1, 2 * world_size)
    model, engine = _engine(stage, "fp32")
    train_steps(engine, batches, rank, world_size, range(3))
    straight = gathered_flat(model)

    model, engine = _engine(stage, "fp32")
    train_steps(engine, batches, rank, world_size, range(1))
    engine.save_checkpoint(f"{tmp}/ckpt")
    engine.offload_states()
    said = {}
    for name, call in _entry_points(engine, model, tmp).items():
        try:
            call()
            said[name] = "no error"
        except RuntimeError as error:
            said[name] = str(error)
    try:  # gradients are held between steps only at some stages: zero_grad needs them awake only then
        engine.zero_grad()
        said["zero_grad"] = "lp_grads" not in {kind.value for kind in engine.sleeping.asleep_kinds()}
    except RuntimeError as error:
        said["zero_grad"] = str(error)
    engine.reload_states()
    engine.full_state_dict(), list(engine.named_full_parameters()), model.mid(torch.zeros(2, 15))
    if stage < 3:  # at stage 3 model.state_dict() refuses anyway: the parameters are partitioned
        model.state_dict()
    train_steps(engine, batches, rank, world_size, range(1, 3))
    return {"said": said, "identical": torch.equal(straight, gathered_flat(model))}


def _deepspeed_calls(stage: int, rank: int, world_size: int) -> dict[str, Any]:
    """OpenRLHF's offload/reload helpers, verbatim in their calls, after a no_grad forward (stage 3 keeps the units
    gathered under the default reuse distance), then a second offload that adds the parameters, mid-accumulation
    with the gradients alone moved first."""
    batches = make_batches(3, 2, 2 * world_size)
    out: dict[str, Any] = {}
    for slept in (False, True):
        torch.manual_seed(0)
        model = make_model()
        import accelerate_zero

        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "none"}},  # OpenRLHF's keys
        }
        if stage == 3:  # partitioned, with DeepSpeed's default reuse distance
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        engine = accelerate_zero.initialize(model, config=config)
        out["reload_without_offload"] = engine.reload_states() is None
        for step in range(3):
            for micro in range(2):
                x, y = batches.rank_slice(step, micro, rank, world_size)
                if slept and step == 1 and micro == 1:  # mid-accumulation: the gradients alone, then back
                    engine.offload_states(include=["lp_grads"])
                    out["grads_alone"] = engine.memory_breakdown()
                    engine.reload_states()
                    engine.offload_states(include=["contiguous_grad_buffer"])
                    out["buffer_alone"] = engine.memory_breakdown()
                    engine.reload_states()
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
            if slept and step == 0:
                out["awake"] = engine.memory_breakdown()
                with torch.no_grad():
                    engine(x)  # an evaluation or a frozen reference's forward: stage 3 keeps its units gathered
                out["gathered"] = engine.memory_breakdown()
                out["stage"] = engine.zero_optimization_stage()
                out["config_stage"] = engine.config["zero_optimization"]["stage"]
                out["adam_offload"] = engine.config["zero_optimization"]["offload_optimizer"]["device"]
                engine.optimizer.offload_states(
                    include=["optim_states", "contiguous_grad_buffer", "hp_params"],
                    device="cpu",
                    pin_memory=True,
                    non_blocking=True,
                )
                engine.empty_partition_cache()
                out["optimizer_asleep"] = engine.memory_breakdown()
                engine.offload_states(include=["lp_params"])  # a second call adds kinds
                out["all_asleep"] = engine.memory_breakdown()
                engine.reload_states(non_blocking=True)
        out["slept" if slept else "straight"] = gathered_flat(model)
    out["identical"] = torch.equal(out.pop("straight"), out.pop("slept"))
    return out


def _frontier(rank: int, world_size: int, tmp: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for stage in ENTRY_STAGES:
        out[("entry", stage)] = _asleep_entry_points(stage, rank, world_size, tmp)
        out[("deepspeed", stage)] = _deepspeed_calls(stage, rank, world_size)
    return out


@pytest.fixture(scope="module")
def frontier_by_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_distributed(_frontier, 3, str(tmp_path_factory.mktemp("asleep")))


@pytest.mark.parametrize("stage", ENTRY_STAGES)
def test_every_entry_point_refuses_while_asleep_naming_the_sleep(
    frontier_by_rank: list[dict[Any, Any]], stage: int
) -> None:
    for rank, results in enumerate(frontier_by_rank):
        got = results[("entry", stage)]
        zero_grad = got["said"].pop("zero_grad")
        assert zero_grad is True or "lp_grads" in zero_grad and "reload_states()" in zero_grad, (rank, zero_grad)
        for name, said in got["said"].items():
            assert "offload_states()" in said and "reload_states()" in said, (rank, stage, name, said)
        assert got["identical"], (rank, stage)


@pytest.mark.parametrize("stage", ENTRY_STAGES)
def test_the_calls_rl_frameworks_make_work_and_training_stays_bit_identical(
    frontier_by_rank: list[dict[Any, Any]], stage: int
) -> None:
    for rank, results in enumerate(frontier_by_rank):
        got = results[("deepspeed", stage)]
        assert got["identical"], (rank, stage)
        assert got["reload_without_offload"]
        assert got["stage"] == got["config_stage"] == stage and got["adam_offload"] == "none"
        awake, optimizer_asleep, all_asleep = got["awake"], got["optimizer_asleep"], got["all_asleep"]
        assert awake["optimizer_states"] > 0 and optimizer_asleep["optimizer_states"] == 0, (rank, stage)
        assert optimizer_asleep["parameters"] == awake["parameters"] > 0  # kept: generation still runs
        if stage == 3:  # what the no_grad forward left gathered was released by offload_states, as DeepSpeed does
            assert got["gathered"]["parameters"] > awake["parameters"], (rank, got["gathered"], awake)
        assert all_asleep["total"] == 0, (rank, stage, all_asleep)
        # The host copies are counted while asleep: everything the device held is in host memory.
        assert all_asleep["host_total"] == awake["host_total"] + awake["total"], (rank, stage, awake, all_asleep)
        for alone in ("grads_alone", "buffer_alone"):  # either name moves the one gradient storage
            assert got[alone]["gradients"] == 0 < got[alone]["host_gradients"], (rank, stage, alone, got[alone])
