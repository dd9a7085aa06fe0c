"""Expert parallelism under the trainers users run (issue 52): transformers' Trainer through
`TrainingArguments(zero_config=...)`, and TRL's GRPOTrainer with a MoE policy and its reference model, each against
the same trainer in one process on the full batch.
"""

from __future__ import annotations

import json
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
    from tests.helpers.moe_models import held_expert_share
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
        "held": held_expert_share(engine),  # "auto" persistence (10 * hidden) leaves the experts in units: 1/W
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Any]:
    from tests.helpers.dist import run_distributed

    folder = tmp_path_factory.mktemp("ep_trainer")
    by_rank = run_distributed(_trainer, WORLD_SIZE, str(folder / "ours"), timeout=600)
    return by_rank, _trainer_reference(str(folder / "reference"))


def test_trainer_with_expert_parallel_equals_transformers_trainer(trained: tuple[list[dict[str, Any]], Any]) -> None:
    by_rank, (reference_losses, reference_weights) = trained
    assert all(results["split"] and results["held"] == pytest.approx(1 / WORLD_SIZE) for results in by_rank)
    losses, weights = by_rank[0]["ours"]
    assert len(losses) == len(reference_losses) > 0
    assert max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True)) < 1e-5, (losses, reference_losses)
    worst = max(((n, (weights[n].float() - w).abs().max().item()) for n, w in reference_weights.items()),
                key=lambda item: item[1])  # fmt: skip
    assert worst[1] < 1e-5, worst


# ------------------------------------------------------------------------------------------------------------ GRPO
# TRL's GRPOTrainer with a MoE policy and its (frozen, MoE) reference model: ours on 4 ranks at ep 2, stage 3, every
# tensor partitioned (the policy's and the reference's experts cut over their peers, [Note: experts below 1/ep at
# stage 3]), against TRL's own in one process on the whole batch, both in fp32. The completions are fixed after
# generation ran (tests/integration/trl_numerics.py: sampling differs between one process and four), so both runs
# score, normalise and learn from the same ones; beta > 0 reads the reference model. SGD, accumulation 2, 2 steps.
# Without the router's load-balancing loss, which TRL adds for a MoE model: it is a function of each forward's
# whole batch (the share of its tokens each expert gets), so one process and four ranks compute different losses.
GRPO_STEPS, GRPO_ACCUM, GRPO_PER_RANK, GRPO_LR = 2, 2, 1, 0.5
GRPO_PROMPTS = GRPO_STEPS * GRPO_ACCUM * GRPO_PER_RANK * WORLD_SIZE // 2
"""Each completed twice (`num_generations`), each used once."""


def _grpo_model(folder: str) -> str:
    """A tiny Qwen3-MoE (4 experts, top-2) with the recipes' tokenizer, saved (TRL builds the reference from it)."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.integration.trl_numerics import ASSETS

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    for name, param in model.named_parameters():
        if ".experts." in name:  # transformers initialises experts small: make them count
            torch.nn.init.normal_(param, std=0.2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _grpo_train(model_dir: str, output_dir: str, zero: bool) -> tuple[dict[str, Any], Any]:
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accelerate_zero.integrations import trl as zero_trl
    from tests.integration import trl_numerics

    values: dict[str, Any] = dict(
        output_dir=output_dir, max_steps=GRPO_STEPS, gradient_accumulation_steps=GRPO_ACCUM, optim="sgd",
        learning_rate=GRPO_LR, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0, bf16=False, num_generations=2, max_completion_length=4, beta=0.1, router_aux_loss_coef=0.0,
        per_device_train_batch_size=GRPO_PER_RANK * (1 if zero else WORLD_SIZE),
    )  # fmt: skip
    if zero:
        expert = {"enabled": True, "autoep_size": 2}
        stage3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
        args = zero_trl.ZeroGRPOConfig(zero_config={"zero_optimization": stage3, "expert_parallel": expert}, **values)
    else:
        args = trl.GRPOConfig(**values)
    run = trl_numerics.with_fixed_completions(zero_trl.ZeroGRPOTrainer if zero else trl.GRPOTrainer)(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=args,
        reward_funcs=trl_numerics.reward,
        train_dataset=_grpo_prompts(model_dir),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    run.train()
    logs = [
        {k: v for k, v in log.items() if k in ("loss", "kl", "reward", "grad_norm")} for log in run.state.log_history
    ]
    return {"steps": run.state.global_step, "logs": [log for log in logs if "loss" in log]}, run


def _grpo_prompts(model_dir: str) -> Any:
    """Distinct puzzles whose prompts are all 6 tokens: prompts are left-padded to the longest of the batch and the
    positions count the padding, so batches of other make-ups (one process's, each rank's) would see other positions."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from tests.integration.trl_numerics import LETTERS

    tokenizer, rows = AutoTokenizer.from_pretrained(model_dir), {}
    with open(LETTERS) as file:
        for line in map(json.loads, file):
            prompt = line["messages"][0]["content"]
            if len(tokenizer(prompt)["input_ids"]) == 6 and len(rows) < GRPO_PROMPTS:
                rows.setdefault(prompt, {"prompt": prompt, "answer": line["answer"]})
    return Dataset.from_list(list(rows.values()))


def _grpo_reference(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from tests.helpers.dist import plain_torchrun_environment

    plain_torchrun_environment()
    model_dir = _grpo_model(f"{folder}/model")
    initial = {n: p.detach().clone() for n, p in _load(model_dir).named_parameters()}
    out, run = _grpo_train(model_dir, f"{folder}/reference", zero=False)
    return {**out, "initial": initial, "weights": {n: p.detach().clone() for n, p in run.model.named_parameters()}}


def _grpo_ours(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from tests.helpers.dist import plain_torchrun_environment
    from tests.helpers.moe_models import held_expert_share

    plain_torchrun_environment()
    out, run = _grpo_train(f"{folder}/model", f"{folder}/ours", zero=True)
    engine, ref_engine = run.zero_engine, run.accelerator.prepared_model_of(run.ref_model).engine
    return {
        **out,
        "weights": engine.full_state_dict(),
        "held": (held_expert_share(engine), held_expert_share(ref_engine)),  # the policy's and the reference's
    }


def _load(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def grpo(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    pytest.importorskip("trl")
    from tests.helpers.dist import run_distributed

    folder = str(tmp_path_factory.mktemp("ep_grpo"))
    reference = run_distributed(_grpo_reference, 1, folder)[0]
    return reference, run_distributed(_grpo_ours, WORLD_SIZE, folder, timeout=600)


def test_grpo_with_a_moe_policy_and_reference_at_ep_2_equals_trl(grpo: tuple[dict[str, Any], list[dict]]) -> None:
    reference, by_rank = grpo
    moved = max((reference["weights"][n] - v).abs().max().item() for n, v in reference["initial"].items())
    assert reference["steps"] == GRPO_STEPS and moved > 1e-2, moved  # training moves the weights
    assert any(log["kl"] > 0 for log in reference["logs"]), reference["logs"]  # the reference model is read
    for rank, results in enumerate(by_rank):
        assert results["steps"] == GRPO_STEPS, results
        assert results["held"] == pytest.approx((1 / WORLD_SIZE, 1 / WORLD_SIZE)), results["held"]  # as flat stage 3
        for mine, theirs in zip(results["logs"], reference["logs"], strict=True):
            for key, value in theirs.items():
                assert abs(mine[key] - value) <= 1e-5 * max(1.0, abs(value)), (rank, key, mine, theirs)
    weights = by_rank[0]["weights"]
    worst = max(((n, (weights[n] - w).abs().max().item()) for n, w in reference["weights"].items()),
                key=lambda item: item[1])  # fmt: skip
    assert worst[1] < 1e-5, worst
