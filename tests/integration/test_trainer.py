"""The transformers Trainer on the ZeRO engine (`accelerate_zero.Trainer` / `TrainingArguments(zero_config=...)`),
against the plain Trainer in one process on the full batch.

The shared 2 ranks of tests/helpers/dist.py run, one body per part (tests/integration/trainer_checks.py):
training at stages 1, 2 and 3, evaluation before training at stage 3, transformers' own DeepSpeed test configs
unchanged, the config's optimizer/scheduler blocks, save_model -> from_pretrained, checkpoint + resume, LoRA with
gradient checkpointing at stages 2 and 3.
A group of 3 ranks then resumes the 2-rank checkpoint; `accelerate-zero consolidate` turns it into weights.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed, shared_parts
from tests.integration import trainer_checks as checks


WORLD_SIZE = 2
MICRO = 2


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Over the keys of `b` (a reference's trainable parameters, or a whole state dict)."""
    assert set(b) <= set(a), sorted(set(b) - set(a))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def ranks(folder: Path) -> list[Any]:
    """`ranks[r][part]`: rank r's result of the 2-rank check `part` (trainer_checks.PARTS), run when first read."""
    return shared_parts(checks.run_part, WORLD_SIZE, str(folder))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return checks.reference(WORLD_SIZE, MICRO, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_training_matches_the_single_process_trainer(ranks: Any, reference: Any, stage: int) -> None:
    run = ranks[0][f"stage{stage}"]
    assert run["accelerator"] == "ZeroAccelerator" and run["engine_stage"] == stage
    assert _max_diff(run["state"], reference["state"]) < 1e-6
    assert run["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert len(run["norms"]) == checks.STEPS and all(math.isfinite(n) for n in run["norms"])
    assert {t.device.type for t in ranks[1][f"stage{stage}"]["state"].values()} == {"meta"}  # values: main only
    # hidden-size "auto" values (h = 32), batch size from the arguments
    filled = run["filled"]
    assert filled["reduce_bucket_size"] == 32 * 32 and filled["train_batch_size"] == WORLD_SIZE * MICRO * 2
    assert filled["persistence"] == (320 if stage == 3 else 100_000)  # below stage 3 the key keeps its default


def test_save_model_reloads_with_identical_logits(ranks: Any) -> None:
    run = ranks[0]["stage3"]
    assert "model.safetensors" in run["saved_files"] and "config.json" in run["saved_files"]
    assert torch.equal(run["loaded_logits"], run["engine_logits"])


def test_evaluate_before_training_at_stage_3(ranks: Any, reference: Any) -> None:
    for rank in ranks:
        run = rank["eval_first"]
        assert run["sharded_for_eval"]  # the model was prepared (sharded) for inference
        assert run["eval"] == pytest.approx(reference["eval"], abs=1e-5)
    assert _max_diff(ranks[0]["eval_first"]["state"], reference["state"]) < 1e-6  # then trained from full weights


def _deepspeed_lrs(cls: type, params: dict[str, Any], steps: int) -> list[float]:
    """The learning rate after each of `steps` scheduler steps of our DeepSpeed-equal scheduler `cls`."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=params.get("warmup_max_lr", 0.1))
    scheduler, lrs = cls(optimizer, **params), []
    for _ in range(steps):
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_transformers_deepspeed_test_configs_unchanged(ranks: Any) -> None:
    from accelerate_zero.optim.lr_schedules import WarmupLR

    zero2, zero3 = ranks[0]["reference_configs"]["zero2"], ranks[0]["reference_configs"]["zero3"]
    # zero2: every "auto" from the arguments (AdamW defaults, lr 0.1 from args_kwargs, fp32, no warmup -> 1 step)
    assert zero2["optimizer"] == "AdamW" and zero2["scheduler"] == "WarmupLR"
    assert zero2["optimizer_params"]["betas"] == (0.9, 0.999) and zero2["optimizer_params"]["eps"] == 1e-8
    assert zero2["optimizer_params"]["weight_decay"] == 0.0
    assert zero2["scheduler_params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 1}
    assert (zero2["micro"], zero2["accumulation"], zero2["clipping"]) == (MICRO, 2, 1.0)
    assert zero2["offload"] == ("cpu", "none") and zero2["fp16"] is False
    # zero3: its written values; fp16; CPU offload of optimizer and parameters; keys it leaves out from the arguments
    assert zero3["offload"] == ("cpu", "cpu") and zero3["fp16"] is True
    assert zero3["optimizer_params"]["betas"] == (0.8, 0.999) and zero3["optimizer_params"]["weight_decay"] == 3e-7
    assert (zero3["micro"], zero3["accumulation"]) == (MICRO, 2)
    for run in (zero2, zero3):
        assert run["global_steps"] == 3 and all(math.isfinite(x) for x in run["losses"])
        stepped = run["global_steps"] - run["skipped_steps"]  # fp16 overflow steps do not step the scheduler
        expected = _deepspeed_lrs(WarmupLR, run["scheduler_params"], stepped)[-1] if stepped else None
        assert expected is None or run["optimizer_params"]["lr"] == pytest.approx(expected, rel=1e-9)


def test_config_optimizer_and_scheduler_blocks(ranks: Any) -> None:
    from accelerate_zero.optim.lr_schedules import WarmupDecayLR

    only = ranks[0]["optimizer_blocks"]["optimizer_only"]
    # SGD from the config under the Trainer's own linear schedule (warmup 1 step)
    assert only["scheduler"] == "LambdaLR"
    assert only["lrs"] == pytest.approx([0.1 * (checks.STEPS - s) / (checks.STEPS - 1) for s in range(1, 5)])
    both = ranks[0]["optimizer_blocks"]["both"]
    assert both["scheduler"] == "WarmupDecayLR"
    params = both["scheduler_params"]
    assert params == {"warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 1, "total_num_steps": 4}
    assert both["lrs"] == pytest.approx(_deepspeed_lrs(WarmupDecayLR, params, checks.STEPS))
    assert both["engine_lr"] == pytest.approx(both["lrs"][-1])


def test_resume_continues_exactly(ranks: Any) -> None:
    run = ranks[0]["resume"]
    assert {"trainer_state.json", "zero_model", "model.safetensors", "config.json", "latest"} <= set(run["files"])
    assert run["b"]["losses"] == run["a"]["losses"]  # b's first two come from the checkpoint's trainer state
    assert _max_diff(run["b"]["state"], run["a"]["state"]) == 0.0


def test_resume_on_a_different_number_of_processes(ranks: Any, folder: Path) -> None:
    uninterrupted = ranks[0]["resume"]["a"]  # the 2-rank run whose checkpoint is resumed
    results = run_distributed(checks.resume_on_three, 3, str(folder))
    assert results[0]["engine_world_size"] == 3
    assert results[0]["losses"] == pytest.approx(uninterrupted["losses"], abs=1e-5)
    assert _max_diff(results[0]["state"], uninterrupted["state"]) < 1e-6


def test_consolidate_equals_the_gathered_weights(ranks: Any, folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    ranks[0]["resume"]  # the 2-rank run that wrote the checkpoint
    checkpoint = folder / "resume" / "a" / "checkpoint-2"
    result = subprocess.run(
        [sys.executable, "-m", "accelerate_zero.cli.main", "consolidate", str(checkpoint), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,  # a few seconds idle: a hang fails this test, not the whole session
    )
    assert result.returncode == 0, result.stderr
    gathered = load_file(checkpoint / "model.safetensors")  # save_model's gathered weights at that step
    consolidated = LlamaForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert _max_diff({k: consolidated[k] for k in gathered}, gathered) == 0.0
    # The engine state alone (no config.json next to it): the shapes come from the checkpoint itself.
    shutil.copytree(checkpoint / "zero_model", tmp_path / "bare" / "zero_model")
    from accelerate_zero.checkpoint.consolidate import consolidated_state_dict

    bare = consolidated_state_dict(tmp_path / "bare")
    assert _max_diff(bare, {k: v for k, v in gathered.items() if k in bare}) == 0.0
    assert set(gathered) - set(bare) <= {"lm_head.weight"}  # tied to the embedding: saved once


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_with_gradient_checkpointing(ranks: Any, stage: int, tmp_path: Path) -> None:
    expected = checks.reference(WORLD_SIZE, MICRO, tmp_path, peft=True, gradient_checkpointing=True)
    run = ranks[0]["lora"][stage]
    assert run["finite"] and run["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    assert _max_diff(run["state"], expected["state"]) < 1e-6
    assert "adapter_model.safetensors" in run["files"] and "model.safetensors" not in run["files"]
    assert torch.allclose(run["reloaded_logits"], run["logits"], atol=1e-6)
    # save_model gathered onto rank 0 only the adapter and the embeddings peft may add, never the whole base model
    (saved,) = run["saved_keys"]
    embeddings = {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"}
    assert set(run["trainable"]) <= set(saved) <= set(run["trainable"]) | embeddings
    assert len(saved) < len(run["all_keys"]) / 2


def test_hyperparameter_search_trials_use_their_values(ranks: Any) -> None:
    # optuna drives the trials from rank 0 and broadcasts them; each trial's "auto" learning rate reaches the engine
    for rank in ranks:
        used = rank["hp_search"]["used"]
        assert sorted(used) == [(1e-3, 1e-3), (5e-2, 5e-2)], used
    assert ranks[0]["hp_search"]["best"] is not None
