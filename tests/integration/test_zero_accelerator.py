"""ZeroAccelerator: accelerate training loops on the ZeRO engine, against a single-process reference.

The shared 2 ranks (tests/helpers/dist.py) run each check of tests/integration/zero_accelerator_checks.py as its own
body, in a torchrun-style environment without accelerate's variables: training with `accumulate()` at stages 1, 2
and 3 plus a frozen model prepared in the same call, save_state/load_state with fp16 at stage 3, save_model ->
from_pretrained, and bf16. The real `accelerate-zero launch` of recipes/accelerate_hello.py is README's, run by
tests/integration/test_readme_commands.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.dist import shared_parts
from tests.integration import zero_accelerator_checks as checks


WORLD_SIZE = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """`ranks[r][part]`: rank r's result of the 2-rank check `part` (zero_accelerator_checks.run_part)."""
    return shared_parts(checks.run_part, WORLD_SIZE, str(tmp_path_factory.mktemp("zero_accelerator")))


@pytest.fixture(scope="module")
def reference() -> tuple[torch.nn.Module, list[float]]:
    return checks.reference(WORLD_SIZE)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_training_matches_single_process_reference(ranks: Any, reference: Any, stage: int) -> None:
    model, norms = reference
    expected = model.state_dict()
    rank0 = ranks[0][f"stage{stage}"]
    assert list(rank0["state"]) == list(expected)
    diff = max((rank0["state"][k] - expected[k]).abs().max().item() for k in expected)
    assert diff < 1e-6, diff
    for run in (r[f"stage{stage}"] for r in ranks):
        assert run["engine_steps"] == checks.STEPS
        assert run["norms"] == pytest.approx(norms, rel=1e-5)  # clip_grad_norm_ returns the engine's global norm
        assert run["norms_match"]  # also with max_norm=inf
    other = ranks[1][f"stage{stage}"]["state"]  # get_state_dict: values on the main process only
    assert list(other) == list(expected) and {t.device.type for t in other.values()} == {"meta"}


def test_plain_torchrun_environment_forms_the_gloo_group(ranks: Any) -> None:
    for rank in ranks:
        assert rank["stage2"]["setup"] == {
            "distributed_type": True,
            "num_processes": WORLD_SIZE,
            "engine_world_size": WORLD_SIZE,
            "timeout_s": 60.0,  # ACCELERATE_ZERO_PG_TIMEOUT set by run_distributed
            "same_objects": True,
            "unwrap": True,
            "wrapper": "ZeroOptimizerWrapper",
            "config": [checks.MICRO * checks.GRAD_ACCUM * WORLD_SIZE, checks.GRAD_ACCUM, 32 * 32],  # "auto" filled
        }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_without_optimizer_is_prepared_for_inference(ranks: Any, stage: int) -> None:
    with torch.no_grad():
        expected = checks.tiny_llama(seed=1)(input_ids=checks.PROBE).logits
    for rank in ranks:
        run = rank[f"stage{stage}"]
        assert torch.equal(run["frozen_logits"], expected)
        assert run["frozen_trainable"] == 0 and run["frozen_stage"] == stage
        memory = run["frozen_memory"]
        assert memory["gradients"] == memory["master_weights"] == memory["optimizer_states"] == 0
    numel = sum(p.numel() for p in checks.tiny_llama().parameters())
    sharded = ranks[0]["stage3"]["frozen_memory"]["parameters"]
    assert sharded < 0.7 * 4 * numel  # stage 3 shards it (parameters under the persistence threshold stay whole)
    assert ranks[0]["stage2"]["frozen_memory"]["parameters"] == 4 * numel


def test_save_state_load_state_continues_bit_identically(ranks: Any) -> None:
    for rank in ranks:
        first, second = rank["resume"]["first"], rank["resume"]["second"]
        assert first["fp16"] and second["fp16"]
        for key in ("params", "masters", "adam"):  # an asynchronous save resumes to the same values
            for run in ("first_async", "second_async"):
                assert all(torch.equal(a, b) for a, b in zip(first[key], rank["resume"][run][key], strict=True))
        for key in ("params", "masters", "adam"):
            assert len(first[key]) == len(second[key]) > 0
            assert all(torch.equal(a, b) for a, b in zip(first[key], second[key], strict=True)), key
        assert torch.equal(first["rng"], second["rng"])
        for key in ("loss_scale", "skipped", "steps", "lr", "accelerator_step"):
            assert first[key] == second[key], key
        # fp16 overflows were skipped, and the scheduler did not step on them (2 scheduler steps per real step:
        # accelerate's AcceleratedScheduler steps once per process)
        assert 0 < first["skipped_at_save"] < first["steps"] == 4
        assert first["lr"] == pytest.approx(1e-2 * 0.9 ** (WORLD_SIZE * (first["steps"] - first["skipped"])))
    first = ranks[0]["resume"]["first"]
    assert {"zero_model", "random_states_0.pkl", "scheduler.bin"} <= set(first["files"])
    assert "Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save`" in first["error"]


def test_save_model_loads_with_from_pretrained(ranks: Any) -> None:
    rank0 = ranks[0]["save_model"]
    assert "model.safetensors.index.json" in rank0["files"] and "config.json" in rank0["files"]
    assert rank0["max_diff"] < 1e-6, rank0["max_diff"]
    assert all(rank["save_model"]["main_only"] for rank in ranks)


def test_bf16_is_the_engines_not_accelerates(ranks: Any) -> None:
    for rank in ranks:
        assert rank["bf16"] == {
            "accelerate_mixed_precision": "no",
            "native_amp": False,
            "scaler": True,
            "bf16_enabled": True,
            "micro_batch": checks.MICRO,
            "param_dtypes": ["torch.bfloat16"],
            "master_dtypes": ["torch.float32"],
            "loss_finite": True,
            "autocast": False,
            "dtype": torch.bfloat16,
        }


def test_errors_before_any_process_group_work() -> None:
    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.config import ZeroConfigError
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    with pytest.raises(ZeroConfigError, match="cannot be set to `fp16` when `bf16` is set"):
        ZeroAccelerator(
            ZeroPlugin(config={"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}), mixed_precision="fp16"
        )
    with pytest.raises(ValueError, match="remove \\['fsdp_plugin'\\]"):
        ZeroAccelerator(fsdp_plugin=object())
