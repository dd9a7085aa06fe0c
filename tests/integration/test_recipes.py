"""The recipes run end to end: 2-process `accelerate-zero launch`es of recipes/sft.py and recipes/grpo.py at ZeRO
stages 2 and 3, with few steps set on the command line (the demo configs otherwise). Each launch is planned by the
launcher and run on the pooled ranks (tests/integration/planned_launch.py); the README's demo launches the SFT
recipe for real (tests/integration/test_readme_commands.py).

The ranks write their results as JSON in the output folder (`eval_results.json`, `grpo_results.json`); the saved
models are loaded here with `from_pretrained`. The GRPO runs start from the stage-2 SFT run's model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.dist import scaled_seconds
from tests.integration.planned_launch import planned_environment, run_as_planned


REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
CONFIGS = REPO / "accelerate_configs"
SFT_STEPS = 100  # the embedded model reaches ~30% held-out exact match (from 0%) at stage 2


@pytest.fixture(scope="module", autouse=True)
def _launch_env() -> Any:
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_ZERO_", "ACCELERATE_DEEPSPEED_", "ACCELERATE_USE_")):
            del os.environ[name]
    os.environ["ACCELERATE_ZERO_PG_TIMEOUT"] = scaled_seconds(60)
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    yield
    os.environ.clear()
    os.environ.update(saved)


def launch(stage: int, script: str, config: str, *overrides: str) -> None:
    flags = ["--config_file", str(CONFIGS / f"zero{stage}.yaml"), "--main_process_port", "0"]
    args = ["--config", str(RECIPES / "configs" / config), *overrides]
    run_as_planned(RECIPES / script, [(planned_environment(flags, RECIPES / script), args)])


def sft(stage: int, out: Path, *overrides: str) -> dict[str, Any]:
    launch(stage, "sft.py", "sft_demo.yaml", "--output_dir", str(out), "--logging_steps", "25", *overrides)
    return json.loads((out / "eval_results.json").read_text())


@pytest.fixture(scope="module")
def sft_stage2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("sft_stage2")
    return out, sft(2, out, "--max_steps", str(SFT_STEPS), "--eval_samples", "100")


def test_sft_beats_the_untrained_model_and_saves_a_loadable_model(sft_stage2: Any) -> None:
    out, results = sft_stage2
    untrained, trained = results["untrained"], results["trained"]
    assert trained["n"] == untrained["n"] == 100
    assert trained["accuracy"] >= untrained["accuracy"] + 0.1, results
    # The saved folder is a transformers model that answers as the trained engine did (greedy, one process).
    sys.path.insert(0, str(RECIPES))
    try:
        from common import EMBEDDED_EVAL, exact_match, load_rows
    finally:
        sys.path.remove(str(RECIPES))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    reloaded = exact_match(model, tokenizer, load_rows(EMBEDDED_EVAL).select(range(100)), batch_size=100)
    assert reloaded["accuracy"] == pytest.approx(trained["accuracy"])


def test_sft_stage3_with_packing(tmp_path: Path) -> None:
    results = sft(3, tmp_path, "--max_steps", "8", "--packing", "true", "--eval_samples", "8")
    assert results["trained"]["n"] == 8
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert sum(p.numel() for p in model.parameters()) == 825_600


@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_reward_rises_from_the_sft_model(sft_stage2: Any, tmp_path: Path, stage: int) -> None:
    sft_out, _ = sft_stage2
    steps = {2: "8", 3: "4"}[stage]
    overrides = ["--model_name_or_path", str(sft_out), "--output_dir", str(tmp_path), "--max_steps", steps]
    overrides += ["--learning_rate", "1e-4", "--eval_samples", "16", "--probe_prompts", "32"]
    launch(stage, "grpo.py", "grpo_demo.yaml", *overrides)
    results = json.loads((tmp_path / "grpo_results.json").read_text())
    assert len(results["rewards"]) == int(steps)
    assert results["after"]["sampled_reward"] > results["before"]["sampled_reward"], results
    AutoModelForCausalLM.from_pretrained(tmp_path)
