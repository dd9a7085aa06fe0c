"""Expert parallelism under the trainers users run (issue 52): transformers' Trainer through
`TrainingArguments(zero_config=...)`, and TRL's GRPOTrainer with a MoE policy and its reference model, each against
the same trainer in one process on the full batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.test_expert_parallel_engine import LENGTH, MICRO, WORLD_SIZE, _built


# ----------------------------------------------------------------------------------------------------- the Trainer
# `TrainingArguments(zero_config=...)` with the expert_parallel block, the way Trainer users reach it: 4 ranks, ep 2,
# stage 3 (every other value "auto", filled by the Trainer), against transformers' own Trainer in one process on the
# full batch: the logged losses and the trained weights (SGD, clipping at 1.0, accumulation 2, fp32).
def _trainer_data(world_size: int) -> list[dict[str, torch.Tensor]]:
    from tests.integration import trainer_checks as checks

    rows = torch.randint(0, 64, (checks.STEPS * checks.GRAD_ACCUM * world_size, LENGTH),
                         generator=torch.Generator().manual_seed(9))  # fmt: skip
    return [{"input_ids": row, "labels": row} for row in rows]


def _trainer_reference(folder: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """transformers' Trainer in this (the test's, not distributed) process on the full batch."""
    from transformers import Trainer, TrainingArguments

    from tests.integration import trainer_checks as checks

    args = TrainingArguments(**checks.args_kwargs(folder, MICRO * WORLD_SIZE))
    reference = Trainer(model=_built("qwen3_moe"), args=args, train_dataset=_trainer_data(WORLD_SIZE))
    reference.train()
    return checks.losses(reference), {n: p.detach().clone() for n, p in reference.model.named_parameters()}


def _trainer(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from accelerate_zero import Trainer, TrainingArguments
    from tests.helpers.dist import plain_torchrun_environment
    from tests.integration import trainer_checks as checks

    plain_torchrun_environment()
    expert = {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}
    args = TrainingArguments(
        **checks.args_kwargs(folder, MICRO), zero_config={**checks.zero_config(3), "expert_parallel": expert}
    )
    ours = Trainer(model=_built("qwen3_moe"), args=args, train_dataset=_trainer_data(world_size))
    ours.train()
    engine = ours.zero_engine
    return {
        "ours": (checks.losses(ours), engine.full_state_dict()),
        "split": engine.experts is not None and engine.layout.expert.world_size == 2,
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Any]:
    from tests.helpers.dist import run_distributed

    folder = tmp_path_factory.mktemp("ep_trainer")
    by_rank = run_distributed(_trainer, WORLD_SIZE, str(folder / "ours"), timeout=600)
    return by_rank, _trainer_reference(str(folder / "reference"))


def test_trainer_with_expert_parallel_equals_transformers_trainer(trained: tuple[list[dict[str, Any]], Any]) -> None:
    by_rank, (reference_losses, reference_weights) = trained
    assert all(results["split"] for results in by_rank)
    losses, weights = by_rank[0]["ours"]
    assert len(losses) == len(reference_losses) > 0
    assert max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True)) < 1e-5, (losses, reference_losses)
    worst = max(((n, (weights[n].float() - w).abs().max().item()) for n, w in reference_weights.items()),
                key=lambda item: item[1])  # fmt: skip
    assert worst[1] < 1e-5, worst
