"""DCP checkpoints between a real FSDP2 run and our engines, both ways ([Note: DCP checkpoints in] in
accelerate_zero/checkpoint/dcp_load.py, [Note: DCP checkpoints out] in dcp_save.py).

On 2 and on 3 gloo ranks, FSDP2 (`fully_shard` per Linear and on the root, AdamW, StepLR) trains 2 steps, saves
`{"model": get_model_state_dict, "optim": get_optimizer_state_dict, "lr_scheduler": ...}` with `dcp.save`, and trains 2
more: the run that never moved; at step 2 it also saves the same state in torchtitan's layout (model keys at the top
level, the optimizer flattened by parameter name, `train_state.step`). Our engines at stages 1, 2 and 3 then load that folder (and the 3-rank group also
the 2-rank folder) with `engine.load_checkpoint(folder)` and train the same 2 steps: the weights must match FSDP2's
to fp32 rounding, with the step counter and learning rate carried over; the 2-rank group also through
`ZeroAccelerator.load_state(folder)`. A folder of another model (missing, extra
and reshaped keys) and a folder missing a rank's file are refused naming the keys and the file. Out: our engines
(stages 2 and 3) train SAVED_AT steps, save with `checkpoint_format="dcp"` and train on; FSDP2 on the same ranks
(and on 3 ranks, what our 2-rank stage-3 engine saved) loads it with `dcp.load` + `set_model_state_dict` /
`set_optimizer_state_dict` and the scheduler's `load_state_dict`, and must end where our run ended.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed
from tests.helpers.models import gathered_flat, make_batches, make_model, train_steps


STEPS, GLOBAL_BATCH, SAVED_AT = 4, 6, 2


def _scheduler(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _fsdp2_run(rank: int, world_size: int, folder: str) -> torch.Tensor:
    """FSDP2 trains STEPS steps, saving a DCP checkpoint after SAVED_AT; returns its full weights at the end."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = make_model(seed=0)
    mesh = init_device_mesh("cpu", (world_size,))
    for module in (model.inp, model.mid, model.out):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = _scheduler(optimizer)
    batches = make_batches(STEPS, 1, GLOBAL_BATCH)
    for step in range(STEPS):
        if step == SAVED_AT:
            state = {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, optimizer),
                "lr_scheduler": scheduler.state_dict(),
            }
            dcp.save(state, checkpoint_id=folder)
            # torchtitan's layout: the model's keys at the top level, the optimizer flattened by parameter name
            # (its OptimizersContainer), the step in train_state (a tensor, as its TrainState saves it)
            flat = StateDictOptions(flatten_optimizer_state_dict=True)
            titan = {
                **get_model_state_dict(model),
                "optimizer": get_optimizer_state_dict(model, optimizer, options=flat),
                "lr_scheduler": scheduler.state_dict(),
                "train_state": {"step": torch.tensor(SAVED_AT, dtype=torch.int32)},
            }
            dcp.save(titan, checkpoint_id=f"{folder}_torchtitan")
        x, y = batches.rank_slice(step, 0, rank, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Every rank gets the full state dict here (cpu_offload alone keeps it on rank 0 only).
    return torch.cat([full[name].float().reshape(-1) for name, _ in make_model().named_parameters()]) if full else None


def _engine(stage: int, seed: int = 5) -> tuple[Any, nn.Module]:
    """seed 5: other weights than FSDP2's (a load must replace them); seed 0: FSDP2's initial weights."""
    import accelerate_zero

    model = make_model(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zero = {"stage": stage, "reduce_bucket_size": 60}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 20
    config = {"zero_optimization": zero, "gradient_clipping": 0.0}  # FSDP2's run does not clip
    return accelerate_zero.initialize(model, optimizer, config=config, lr_scheduler=_scheduler(optimizer)), model


def _ours(rank: int, world_size: int, folder: str, stage: int) -> dict[str, Any]:
    engine, model = _engine(stage)
    loaded, _ = engine.load_checkpoint(folder)
    out = {"loaded": loaded, "steps": engine.global_steps, "lr": engine.get_lr()}
    train_steps(engine, make_batches(STEPS, 1, GLOBAL_BATCH), rank, world_size, range(SAVED_AT, STEPS))
    out["params"] = gathered_flat(model)
    return out


def _through_accelerator(rank: int, world_size: int, folder: str) -> torch.Tensor:
    """`ZeroAccelerator.load_state(folder)` of the FSDP2 folder, then the same 2 steps through accelerate."""
    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin
    from tests.helpers.dist import plain_torchrun_environment

    plain_torchrun_environment()
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size, "gradient_clipping": 0.0}
    config["zero_optimization"] = {"stage": 2}
    # One scheduler step per optimizer step, as in the FSDP2 run (accelerate otherwise steps it once per process).
    accelerator = ZeroAccelerator(ZeroPlugin(config=config), step_scheduler_with_optimizer=False)
    model = make_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, _scheduler(optimizer))
    accelerator.load_state(folder)
    batches = make_batches(STEPS, 1, GLOBAL_BATCH)
    for step in range(SAVED_AT, STEPS):
        x, y = batches.rank_slice(step, 0, rank, world_size)
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    params = gathered_flat(model)
    accelerator.free_memory()
    return params


def _ours_out(rank: int, world_size: int, folder: str, stage: int) -> torch.Tensor:
    """Our engine trains SAVED_AT steps, saves a DCP checkpoint, trains on: the run that never moved."""
    engine, model = _engine(stage, seed=0)
    batches = make_batches(STEPS, 1, GLOBAL_BATCH)
    train_steps(engine, batches, rank, world_size, range(SAVED_AT))
    engine.save_checkpoint(folder, tag="dcp", checkpoint_format="dcp")
    train_steps(engine, batches, rank, world_size, range(SAVED_AT, STEPS))
    return gathered_flat(model)


def _fsdp2_resume(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """FSDP2 loads our DCP checkpoint with the standard calls and trains the remaining steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed=5)
    mesh = init_device_mesh("cpu", (world_size,))
    for module in (model.inp, model.mid, model.out):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = _scheduler(optimizer)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
        "lr_scheduler": scheduler.state_dict(),
    }
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    scheduler.load_state_dict(state["lr_scheduler"])
    out = {"lr": scheduler.get_last_lr()}
    batches = make_batches(STEPS, 1, GLOBAL_BATCH)
    for step in range(SAVED_AT, STEPS):
        x, y = batches.rank_slice(step, 0, rank, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    names = [name for name, _ in make_model().named_parameters()]
    out["params"] = torch.cat([full[name].float().reshape(-1) for name in names]) if full else None
    return out


def _refusals(rank: int, world_size: int, root: str) -> dict[str, str]:
    out = {}
    for case in ("other_model", "missing_file"):
        engine, _ = _engine(2) if case == "missing_file" else _other_engine()
        try:
            engine.load_checkpoint(f"{root}/{case}")
            out[case] = "loaded"
        except ValueError as error:
            out[case] = str(error)
    return out


class _Other(nn.Module):
    """ToyModel's names but for `mid` (another shape) and `norm` (absent), and an extra layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.mid = nn.Linear(15, 9)
        self.out = nn.Linear(9, 3)
        self.head = nn.Linear(3, 3)


def _other_engine() -> tuple[Any, nn.Module]:
    import accelerate_zero

    model = _Other()
    engine = accelerate_zero.initialize(
        model, torch.optim.AdamW(model.parameters()), config={"zero_optimization": {"stage": 2}}
    )
    return engine, model


def _body(rank: int, world_size: int, root: str, other_folder: str | None) -> dict[str, Any]:
    folder = f"{root}/fsdp2_w{world_size}"
    out: dict[str, Any] = {"reference": _fsdp2_run(rank, world_size, folder)}
    for stage in (1, 2, 3):
        out[stage] = _ours(rank, world_size, folder, stage)
    out["torchtitan"] = _ours(rank, world_size, f"{folder}_torchtitan", 3)
    if other_folder is not None:
        out["from_other_world_size"] = _ours(rank, world_size, other_folder, 3)
    for stage in (2, 3):  # and out: FSDP2 resumes what our engines saved
        saved = f"{root}/ours_w{world_size}_s{stage}"
        out[f"out{stage}"] = {"ours": _ours_out(rank, world_size, saved, stage)}
        out[f"out{stage}"]["fsdp2"] = _fsdp2_resume(rank, world_size, f"{saved}/dcp")
    if other_folder is not None:  # saved by our 2-rank stage-3 engine, resumed by FSDP2 on 3 ranks
        out["out_other_world_size"] = _fsdp2_resume(rank, world_size, f"{root}/ours_w2_s3/dcp")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list]:
    root = tmp_path_factory.mktemp("dcp")
    two = run_distributed(_body, 2, str(root), None)
    # A body of its own: accelerate must not have been initialised before the ZeroAccelerator.
    for rank, params in enumerate(run_distributed(_through_accelerator, 2, str(root / "fsdp2_w2"))):
        two[rank]["accelerator"] = params
    three = run_distributed(_body, 3, str(root), str(root / "fsdp2_w2"))
    return root, two, three


def test_fsdp2_checkpoint_resumes_in_our_engines(runs: tuple) -> None:
    _, two, three = runs
    for world_size, results in ((2, two), (3, three)):
        reference = results[0]["reference"]
        assert reference is not None
        for rank, result in enumerate(results):
            for stage in (1, 2, 3):
                got = result[stage]
                where = f"W={world_size} stage {stage} rank {rank}"
                assert got["steps"] == SAVED_AT, where
                assert got["lr"] == [pytest.approx(1e-2 * 0.5**SAVED_AT)], where
                torch.testing.assert_close(got["params"], reference, rtol=0, atol=1e-6, msg=where)
            titan = result["torchtitan"]  # the same state in torchtitan's layout, at stage 3
            assert titan["steps"] == SAVED_AT and titan["lr"] == [pytest.approx(1e-2 * 0.5**SAVED_AT)], titan
            torch.testing.assert_close(titan["params"], reference, rtol=0, atol=1e-6, msg=f"torchtitan {rank}")
    for result in two:  # ZeroAccelerator.load_state of the FSDP2 folder
        torch.testing.assert_close(result["accelerator"], two[0]["reference"], rtol=0, atol=1e-6)
    # The 2-rank FSDP2 checkpoint, resumed on 3 ranks at stage 3, continues as the 2-rank FSDP2 run did.
    for result in three:
        torch.testing.assert_close(result["from_other_world_size"]["params"], two[0]["reference"], rtol=0, atol=1e-6)


def test_our_dcp_checkpoint_resumes_in_fsdp2(runs: tuple) -> None:
    _, two, three = runs
    for world_size, results in ((2, two), (3, three)):
        for stage in (2, 3):
            ours = results[0][f"out{stage}"]["ours"]
            fsdp2 = results[0][f"out{stage}"]["fsdp2"]
            where = f"W={world_size} stage {stage}"
            assert fsdp2["lr"] == [pytest.approx(1e-2 * 0.5**SAVED_AT)], where
            torch.testing.assert_close(fsdp2["params"], ours, rtol=0, atol=1e-6, msg=where)
    torch.testing.assert_close(three[0]["out_other_world_size"]["params"], two[0]["out3"]["ours"], rtol=0, atol=1e-6)


def test_foreign_or_partial_dcp_folders_are_refused_by_name(runs: tuple) -> None:
    root, _, _ = runs
    shutil.copytree(root / "fsdp2_w2", root / "other_model")
    shutil.copytree(root / "fsdp2_w2", root / "missing_file")
    (root / "missing_file" / "__1_0.distcp").unlink()
    results = run_distributed(_refusals, 1, str(root))[0]
    other = results["other_model"]
    assert "missing 2 parameters of the model: head.bias, head.weight" in other, other
    assert "mid.weight: checkpoint [15, 15], model [9, 15]" in other, other
    assert "tensors the model lacks: norm.bias, norm.weight" in other, other
    assert "__1_0.distcp is missing" in results["missing_file"], results["missing_file"]


class _Runs:
    """Unpickling it would run `os.system`: what a crafted `.metadata` could do to a plain `pickle.load`."""

    def __reduce__(self) -> tuple:
        import os

        return (os.system, ("true",))


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    import pickle

    from accelerate_zero.checkpoint import dcp_read

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Runs()))
    assert dcp_read.is_dcp_folder(tmp_path)
    with pytest.raises(
        ValueError, match=r"\.metadata is not a DCP metadata file \(.*system is not a DCP metadata type"
    ):
        dcp_read.read_metadata(tmp_path)
