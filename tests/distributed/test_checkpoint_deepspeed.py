"""DeepSpeed's checkpoints resumed by our engines ([Note: DeepSpeed's ZeRO layouts] in
accelerate_zero/checkpoint/deepspeed_read.py, [Note: DeepSpeed's universal layout] in deepspeed_universal.py).

On 2 and on 3 gloo ranks, DeepSpeed 0.19.8 itself (tests/distributed/deepspeed_runs.py) trains a tiny Llama with
AdamW (weight decay) and a linear WarmupLR at ZeRO stages 1, 2 and 3 for 2 steps, saves (`global_step2`, `latest`),
trains 2 more and saves again: the run that never moved, its final fp32 masters consolidated by DeepSpeed's own
zero_to_fp32. Our engines at stages 1, 2 and 3 then `load_checkpoint(folder)` and train the same 2 steps: the
weights must match DeepSpeed's within 1e-5, with its step count and learning rate; the 3-rank group also resumes
the 2-rank folders (another world size) and ds_to_universal's conversion of one. Everything runs in one pooled
body per world size (importing deepspeed costs seconds).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed


TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2
"""bf16: the masters loaded are DeepSpeed's exactly (checked at 0); two steps of bf16 compute in two engines that
reduce in different orders then move them apart by 3.9e-3 (measured), against 7e-2 for weights not loaded (the
engine starts 7e-2 away)."""


def _resume(
    rank: int, world_size: int, folder: Path, stage: int, dtype: str = "fp32", lora: bool = False, **load: Any
) -> dict[str, Any]:
    """Our engine at `stage` loads `folder` and trains to STEPS; its state at the end (rank 0), lr and steps."""
    from tests.distributed import deepspeed_runs as runs

    engine = runs.ours(world_size, stage, dtype, lora)
    loaded, _ = engine.load_checkpoint(str(folder), **load)
    out = {"loaded": Path(loaded).name, "steps_loaded": engine.global_steps, "at_load": runs.full_state(engine)}
    out["scale_at_load"] = engine.loss_scale
    runs.train(engine, range(runs.SAVED_AT, runs.STEPS), rank, world_size)
    out |= {"state": runs.full_state(engine), "lr": engine.get_lr()[0], "steps": engine.global_steps}
    return out


def _compare(rank: int, got: dict[str, Any], folder: Path, ran: dict[str, Any]) -> dict[str, Any]:
    """`got` against DeepSpeed's own run: its masters when it saved (`at_load`) and at the end."""
    from tests.distributed import deepspeed_runs as runs

    at_load, state = got.pop("at_load"), got.pop("state")
    if rank == 0:
        got["diff_at_load"] = runs.max_diff(at_load, runs.deepspeed_masters(folder, f"global_step{runs.SAVED_AT}"))
        got["diff"] = runs.max_diff(state, runs.deepspeed_masters(folder, runs.FINAL))
    return {
        **got,
        "reference_lr": ran["lr"],
        "reference_steps": ran["steps"],
        "reference_scale": ran.get("scale_at_save"),
    }


def _body(rank: int, world_size: int, root: str, other: str | None) -> dict[str, Any]:
    from tests.distributed import deepspeed_runs as runs

    out: dict[str, Any] = {}
    ran: dict[str, Any] = {}
    for stage in (1, 2, 3):
        folder = Path(root) / f"ds_w{world_size}_z{stage}"
        ran[folder.name] = runs.deepspeed_run(rank, world_size, folder, stage)
        for ours in (1, 2, 3) if world_size == 2 else (stage,):
            out[("zero", stage, ours)] = _compare(
                rank, _resume(rank, world_size, folder, ours), folder, ran[folder.name]
            )
    if world_size == 2:
        out |= _variants(rank, world_size, Path(root))
        out["faults"] = _faults(rank, world_size, Path(root) / "ds_w2_z2")
    if other is not None:  # the 2-rank folders, on 3 ranks: another world size, as saved and made universal
        for stage in (1, 3):
            folder = Path(other) / f"ds_w2_z{stage}"
            ran_there = {"lr": ran[f"ds_w3_z{stage}"]["lr"], "steps": runs.STEPS}  # the same schedule
            out[("other", stage)] = _compare(rank, _resume(rank, world_size, folder, 4 - stage), folder, ran_there)
            if rank == 0:
                runs.to_universal(folder / f"global_step{runs.SAVED_AT}")
            torch.distributed.barrier()
            got = _resume(rank, world_size, folder, 4 - stage, tag=f"global_step{runs.SAVED_AT}_universal")
            out[("universal", stage)] = _compare(rank, got, folder, ran_there)
        out["faults"] = _damaged_universal(rank, world_size, Path(other) / "ds_w2_z3" / "global_step2_universal")
    return out


def _variants(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """bf16, and LoRA runs saved with and without DeepSpeed's exclude_frozen_parameters (the Trainer's choice for a
    PEFT model), at stages 2 and 3."""
    from tests.distributed import deepspeed_runs as runs

    out: dict[Any, Any] = {}
    folder = root / "ds_bf16_z2"
    ran = runs.deepspeed_run(rank, world_size, folder, 2, "bf16")
    out[("bf16", 2, 2)] = _compare(rank, _resume(rank, world_size, folder, 2, "bf16"), folder, ran)
    folder = root / "ds_fp16_z2"  # fp16 with dynamic loss scaling: DeepSpeed's loss scaler comes along
    ran = runs.deepspeed_run(rank, world_size, folder, 2, "fp16")
    out[("fp16", 2, 2)] = _compare(rank, _resume(rank, world_size, folder, 2, "fp16"), folder, ran)
    folder = root / "accelerate_deepspeed"  # the tag accelerate's DeepSpeed save_state writes
    out["accelerate_ran"] = runs.deepspeed_run(rank, world_size, folder, 2, tag="pytorch_model")
    for stage, exclude in ((2, True), (3, True), (3, False)):
        folder = root / f"ds_lora_z{stage}_{exclude}"
        ran = runs.deepspeed_run(rank, world_size, folder, stage, lora=True, exclude_frozen_parameters=exclude)
        got = _resume(rank, world_size, folder, 5 - stage, lora=True)
        out[("lora", stage, exclude)] = _compare(rank, got, folder, ran)
    return out


def _through_accelerator(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """`ZeroAccelerator.load_state` of the folder accelerate's DeepSpeed `save_state` writes (`pytorch_model/` and
    `latest`), the optimizer and WarmupLR built from the config blocks (DummyOptim / DummyScheduler), 2 more steps."""
    from accelerate.utils import DummyOptim, DummyScheduler

    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin
    from tests.distributed import deepspeed_runs as runs
    from tests.helpers.dist import plain_torchrun_environment

    plain_torchrun_environment()
    accelerator = ZeroAccelerator(ZeroPlugin(config=runs.config(world_size, 2)))
    model = runs.tiny_llama()
    optimizer = DummyOptim(list(model.parameters()))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, DummyScheduler(optimizer))
    accelerator.load_state(folder)
    for step in range(runs.SAVED_AT, runs.STEPS):
        batch = runs.tokens(step, rank, world_size)
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    state = {name: value.float() for name, value in accelerator.get_state_dict(model).items()}
    out = {"lr": scheduler.get_last_lr()[0], "diff": None}
    if rank == 0:
        out["diff"] = runs.max_diff(state, runs.deepspeed_masters(Path(folder), runs.FINAL))
    accelerator.free_memory()
    return out


class _SystemCall:
    """Pickled as a call of os.system: what loading a foreign file must never do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import os

        return (os.system, (f"touch {self.marker}",))


def _load_error(rank: int, world_size: int, folder: Path, stage: int = 2, **load: Any) -> str:
    from tests.distributed import deepspeed_runs as runs

    engine = runs.ours(world_size, stage)
    try:
        engine.load_checkpoint(str(folder), **load)
    except (ValueError, FileNotFoundError) as error:
        return str(error)
    return "loaded"


def _faults(rank: int, world_size: int, saved: Path) -> dict[str, Any]:
    """Copies of a DeepSpeed folder with one optimizer file replaced by a pickle that calls os.system, or removed."""
    tag = f"global_step{runs_saved_at()}"
    out: dict[str, Any] = {}
    for case in ("foreign_class", "missing_file"):
        folder = saved.parent / f"{saved.name}_{case}"
        victim = folder / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        if rank == 0:
            shutil.copytree(saved, folder)
            if case == "foreign_class":
                torch.save({"optimizer_state_dict": _SystemCall(saved.parent / "ran")}, victim)
            else:
                victim.unlink()
        torch.distributed.barrier()
        out[case] = {"error": _load_error(rank, world_size, folder), "victim": str(victim)}
    out["ran"] = (saved.parent / "ran").exists()
    return out


def _damaged_universal(rank: int, world_size: int, universal: Path) -> dict[str, Any]:
    """One parameter's fp32.pt truncated: only the ranks whose ranges hold that parameter read it."""
    folder = universal.parent.parent / "damaged"
    victim = folder / universal.name / "zero" / "model.layers.1.mlp.up_proj.weight" / "fp32.pt"
    if rank == 0:
        shutil.copytree(universal.parent, folder)
        victim.write_bytes(victim.read_bytes()[:300])
    torch.distributed.barrier()
    return {"error": _load_error(rank, world_size, folder, 2, tag=universal.name), "victim": str(victim)}


def runs_saved_at() -> int:
    from tests.distributed import deepspeed_runs as runs

    return runs.SAVED_AT


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list]:
    root = tmp_path_factory.mktemp("deepspeed")
    two = run_distributed(_body, 2, str(root), None, timeout=600)
    # a body of its own: accelerate must not have been initialised before the ZeroAccelerator
    for rank, got in enumerate(run_distributed(_through_accelerator, 2, str(root / "accelerate_deepspeed"))):
        two[rank]["accelerate"] = got
    three = run_distributed(_body, 3, str(root), str(root), timeout=600)
    return root, two, three


def test_deepspeed_zero_checkpoints_resume_in_our_engines(runs: tuple) -> None:
    _, two, three = runs
    checked = 0
    for world_size, results in ((2, two), (3, three)):
        for rank, result in enumerate(results):
            for key, got in ((k, v) for k, v in result.items() if isinstance(k, tuple)):
                where = f"W={world_size} {key} rank {rank}"
                assert got["loaded"].startswith("global_step2") and got["steps_loaded"] == 2, where
                assert got["steps"] == got["reference_steps"] == 4, where
                assert got["lr"] == pytest.approx(got["reference_lr"], rel=1e-12), where
                if rank == 0:
                    assert got["diff_at_load"] == 0.0, (where, got["diff_at_load"])  # the masters, exactly
                    bound = BF16_TOLERANCE if key[0] in ("bf16", "fp16") else TOLERANCE
                    assert got["diff"] < bound, (where, got["diff"])
                    checked += 1
                if key[0] == "fp16":  # DeepSpeed's dynamic scale when it saved (grown from 2**10 by the good steps)
                    assert got["scale_at_load"] == got["reference_scale"] > 2.0**10, (where, got["reference_scale"], got)
    assert checked == 9 + 2 + 3 + 3 + 2 * 2  # every case ran


def test_foreign_classes_damaged_and_missing_files_are_refused_on_every_rank(runs: tuple) -> None:
    _, two, three = runs
    assert not two[0]["faults"]["ran"], "a pickled os.system call ran while loading"
    for result in two:
        faults = result["faults"]
        error = faults["foreign_class"]["error"]
        assert faults["foreign_class"]["victim"] in error and "system" in error and "nothing it names ran" in error
        error = faults["missing_file"]["error"]
        assert "no optim_states file for rank(s) [1]" in error and "zero_pp_rank_1_mp_rank_00" in error, error
    errors = [result["faults"]["error"] for result in three]
    victim = three[0]["faults"]["victim"]
    assert all(victim in error and "truncated or corrupted" in error for error in errors), errors
    # not every rank read the file: the others raise what the reading rank found
    assert any("found by rank" in error for error in errors) and not all("found by rank" in e for e in errors), errors


def test_zero_accelerator_loads_accelerate_deepspeed_save_state(runs: tuple) -> None:
    _, two, _ = runs
    for result in two:
        assert result["accelerate"]["lr"] == pytest.approx(result["accelerate_ran"]["lr"], rel=1e-12)
    assert two[0]["accelerate"]["diff"] < TOLERANCE, two[0]["accelerate"]["diff"]
