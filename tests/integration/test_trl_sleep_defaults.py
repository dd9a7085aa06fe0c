"""GRPO with `offload_states_during_generation` under DeepSpeed's default stage-3 reuse distance, with an evaluation
set (issue 44, item 5): a `no_grad` forward, a generation or an evaluation leaves units gathered there, and the
sleep before the next generation once refused ("while stage-3 parameters are gathered") at the second evaluation
batch. `offload_states` now releases them first, as DeepSpeed does: the run trains and evaluates to the end, and
a frozen reference model prepared on its own engine can sleep after its forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist import plain_torchrun_environment, run_distributed


pytest.importorskip("trl")

DEFAULT_REUSE = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
"""Every parameter sharded; `stage3_max_reuse_distance` left at DeepSpeed's default (1e9 elements)."""


def _grpo_with_evaluation(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer

    from accelerate_zero.integrations.trl import GRPOConfig, GRPOTrainer
    from tests.integration.trl_trainer_checks import MODEL, PROMPTS, common, load

    plain_torchrun_environment()
    settings = {**common(str(Path(folder) / "grpo")), "zero_config": DEFAULT_REUSE, "max_steps": 1}
    args = GRPOConfig(
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        num_generations=2,
        num_generations_eval=2,
        max_completion_length=6,
        beta=0.1,  # a frozen reference model on its own engine
        offload_states_during_generation=True,
        eval_strategy="steps",
        eval_steps=1,
        **settings,
    )
    prompts = Dataset.from_list([{"prompt": p} for p in PROMPTS * 4])
    trainer = GRPOTrainer(
        model=load(),
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=prompts,
        eval_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS * 2]),  # two evaluation batches
        processing_class=AutoTokenizer.from_pretrained(MODEL, padding_side="left"),
    )
    trainer.train()
    ref = trainer.accelerator.prepared_model_of(trainer.ref_model).engine
    ref.offload_states()  # the reference model ran forwards (scoring): it sleeps all the same
    asleep = ref.memory_breakdown()["total"]
    ref.reload_states()
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry or "eval_reward" in entry]
    return {"steps": trainer.state.global_step, "evaluations": len(evaluations), "ref_asleep": asleep}


def test_grpo_sleeps_and_evaluates_under_the_default_reuse_distance(tmp_path: Path) -> None:
    for got in run_distributed(_grpo_with_evaluation, 2, str(tmp_path)):
        assert got["steps"] == 1 and got["evaluations"] >= 1, got
        assert got["ref_asleep"] == 0, got
