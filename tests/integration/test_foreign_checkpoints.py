"""Resuming, in our Trainer, the `checkpoint-N` folders transformers' own Trainer writes under DeepSpeed (a
`global_stepN/` and `latest` beside its files) and under FSDP (FULL_STATE_DICT, its default: `pytorch_model_fsdp.bin`
and `optimizer.bin`; SHARDED_STATE_DICT: the DCP folders `pytorch_model_fsdp_0/` and `optimizer_0/`), with one
changed line: `resume_from_checkpoint=` the folder, on the writer's 2 ranks and on 3. The resumed run must end where
the run that never stopped ended (tests/integration/foreign_checks.py): the same losses and learning rates at steps 3
and 4, the same weights. Then accelerate's FSDP `save_state` folders through `ZeroAccelerator.load_state`, and the
other way: our `save_state(checkpoint_format="fsdp")` and Trainer checkpoints resumed by accelerate's FSDP2 and by
the transformers FSDP Trainer."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.dist import run_distributed
from tests.integration import foreign_checks


TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def trainers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("foreign_trainer")
    out = {}
    runs = {
        "deepspeed": (foreign_checks.deepspeed_trainer, 3),
        "fsdp_full": (foreign_checks.fsdp_trainer, "FULL_STATE_DICT"),
        "fsdp_sharded": (foreign_checks.fsdp_trainer, "SHARDED_STATE_DICT"),
    }
    for name, (body, option) in runs.items():
        theirs = run_distributed(body, 2, str(root / name), option, timeout=600)
        checkpoint = str(root / name / f"checkpoint-{foreign_checks.SAVE_AT}")
        out[name] = {"theirs": theirs, "ours": run_distributed(foreign_checks.our_trainer_resumes, 2, checkpoint, 3)}
        if name != "fsdp_sharded":  # on 3 ranks: another world size than the writer's
            out[name]["ours_on_3"] = run_distributed(foreign_checks.our_trainer_resumes, 3, checkpoint, 3)
    return out


def _same_end(theirs: list[dict[str, Any]], ours: list[dict[str, Any]], ours_on_3: list | None = None) -> None:
    for got in [ours[0], ours[1]] + (ours_on_3 or []):
        assert got["step"] == theirs[0]["step"] == 4
        # the steps after the resume: the same batches (loss) and learning rate
        for step in (3, 4):
            loss, lr = got["log"][step]
            assert loss == pytest.approx(theirs[0]["log"][step][0], rel=1e-5), (step, got["log"])
            assert lr == pytest.approx(theirs[0]["log"][step][1], rel=1e-12), (step, got["log"])
    if ours_on_3 is not None:
        _close(ours_on_3[0]["state"], theirs[0]["state"])
    _close(ours[0]["state"], theirs[0]["state"])


def _close(got: dict[str, Any], reference: dict[str, Any]) -> None:
    shared = [name for name in reference if name in got]
    assert len(shared) >= len(got) - 1  # lm_head.weight is tied to the embedding
    diff = max((got[name] - reference[name]).abs().max().item() for name in shared)
    assert diff < TOLERANCE, diff


def test_our_trainer_resumes_a_deepspeed_trainer_checkpoint(trainers: dict[str, Any]) -> None:
    files = trainers["deepspeed"]["theirs"][0]["files"]
    assert "global_step2" in files and "latest" in files, files
    _same_end(**trainers["deepspeed"])


@pytest.mark.parametrize("kind", ["fsdp_full", "fsdp_sharded"])
def test_our_trainer_resumes_an_fsdp_trainer_checkpoint(trainers: dict[str, Any], kind: str) -> None:
    files = trainers[kind]["theirs"][0]["files"]
    expected = (
        ("pytorch_model_fsdp.bin", "optimizer.bin") if kind == "fsdp_full" else ("pytorch_model_fsdp_0", "optimizer_0")
    )
    assert set(expected) <= set(files), files
    _same_end(**trainers[kind])


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    root = tmp_path_factory.mktemp("foreign_accelerate")
    out = {}
    for world_size, version, stage in ((2, 2, 2), (3, 2, 3), (2, 1, 3)):
        folder = str(root / f"fsdp{version}_w{world_size}")
        theirs = run_distributed(foreign_checks.accelerate_fsdp, world_size, folder, version, timeout=600)
        ours = run_distributed(foreign_checks.zero_accelerator_resumes, world_size, folder, stage, timeout=600)
        out[(world_size, version, stage)] = {"theirs": theirs, "ours": ours}
    # the 2-rank FSDP2 save on 3 ranks: another world size
    ours = run_distributed(foreign_checks.zero_accelerator_resumes, 3, str(root / "fsdp2_w2"), 3, timeout=600)
    out[(3, "fsdp2_w2", 3)] = {"theirs": out[(2, 2, 2)]["theirs"], "ours": ours}
    return out


def test_zero_accelerator_loads_accelerate_fsdp_save_state(accelerate_runs: dict[Any, Any]) -> None:
    """FSDP2 at 2 and 3 ranks, FSDP1 (SHARDED_STATE_DICT) at 2, resumed by our stages 2 and 3: the weights, the
    warmup LambdaLR (accelerate's scheduler.bin) and the registered object carry over, and FSDP2's continuation is
    matched. FSDP1 under accelerate on this CPU trains each rank alone (accelerate counts one process and refuses
    cpu=True for it), so its continuation is no reference: its folder is checked as loaded (the same layout)."""
    for key, runs in accelerate_runs.items():
        theirs, ours = runs["theirs"], runs["ours"]
        for rank, got in enumerate(ours):
            assert got["counter"] == 5, (key, rank)
            assert got["lr"] == pytest.approx(theirs[0]["lr"], rel=1e-12), (key, rank)
            assert got["lr_loaded"] > 0, key  # the warmup did not restart at step 0
        saved, at_load = ours[0]["saved"], ours[0]["at_load"]
        assert max((at_load[n] - saved[n]).abs().max().item() for n in saved if n in at_load) == 0.0, key
        if key[1] != 1:
            reference, state = theirs[0]["state"], ours[0]["state"]
            diff = max((state[name] - reference[name]).abs().max().item() for name in reference if name in state)
            assert diff < TOLERANCE, (key, diff)


@pytest.fixture(scope="module")
def fsdp_out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp_out")
    out: dict[str, Any] = {}
    for stage in (2, 3):
        folder = str(root / f"zero{stage}")
        ours = run_distributed(foreign_checks.zero_accelerator_saves_fsdp, 2, folder, stage, timeout=600)
        out[f"accelerate{stage}"] = {
            "ours": ours,
            "fsdp": run_distributed(foreign_checks.accelerate_fsdp_resumes, 2, folder),
        }
    for fmt, state_dict_type in (("fsdp_full", "FULL_STATE_DICT"), ("fsdp", "SHARDED_STATE_DICT")):
        folder = root / f"trainer_{fmt}"
        ours = run_distributed(foreign_checks.our_trainer_saves, 2, str(folder), fmt, timeout=600)
        checkpoint = str(folder / f"checkpoint-{foreign_checks.SAVE_AT}")
        fsdp = run_distributed(foreign_checks.fsdp_trainer_resumes, 2, checkpoint, state_dict_type, timeout=600)
        out[f"trainer_{fmt}"] = {"ours": ours, "fsdp": fsdp}
    return out


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in b if name in a)


def test_accelerate_fsdp_resumes_our_save_state(fsdp_out: dict[str, Any]) -> None:
    """`ZeroAccelerator.save_state(dir, checkpoint_format="fsdp")` at stages 2 and 3, then accelerate's FSDP2
    `load_state(dir)`: it ends where our run ended, with the same learning rate and the registered object."""
    for stage in (2, 3):
        ours, fsdp = fsdp_out[f"accelerate{stage}"]["ours"], fsdp_out[f"accelerate{stage}"]["fsdp"]
        assert {"pytorch_model_fsdp_0", "optimizer_0", "scheduler.bin"} <= set(ours[0]["files"]), ours[0]["files"]
        for rank in range(2):
            assert fsdp[rank]["counter"] == 5 and fsdp[rank]["lr"] == pytest.approx(ours[rank]["lr"], rel=1e-12)
        assert _max_diff(fsdp[0]["state"], ours[0]["state"]) < TOLERANCE, stage


@pytest.mark.parametrize("fmt", ["fsdp_full", "fsdp"])
def test_the_fsdp_trainer_resumes_our_trainer_checkpoint(fsdp_out: dict[str, Any], fmt: str) -> None:
    """`save_checkpoint_format="fsdp_full"` (FULL_STATE_DICT, the FSDP Trainer's default) or "fsdp" (SHARDED): the
    transformers FSDP Trainer resumes checkpoint-2 and ends where our Trainer ended."""
    ours, fsdp = fsdp_out[f"trainer_{fmt}"]["ours"], fsdp_out[f"trainer_{fmt}"]["fsdp"]
    expected = (
        ("pytorch_model_fsdp.bin", "optimizer.bin") if fmt == "fsdp_full" else ("pytorch_model_fsdp_0", "optimizer_0")
    )
    assert set(expected) <= set(ours[0]["files"]) and "zero_model" not in ours[0]["files"], ours[0]["files"]
    _same_end(ours, fsdp)
