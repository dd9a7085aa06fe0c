"""The estimate is honest: what `accelerate-zero estimate` predicts per rank is what the engine holds.

One spawned group of 2 ranks builds the toy model and a tiny Llama for stages 0-3 (stage 3 with every parameter
partitioned and with the default persistence threshold), in fp32 and bf16 with AdamW, takes one optimizer step and
one more backward, and returns `engine.memory_breakdown()` (the whole state held: the gradient shard lives until the
step) beside `estimate_stage(...)` for the same rank. The "-accum4" case runs
gradient accumulation 4 and reads the engine between micro-steps (after the first optimizer step and three
more micro-steps): the estimate does not depend on accumulation, and neither may what stage 3 holds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.models import IN_FEATURES, OUT_FEATURES, make_model


WORLD_SIZE = 2
MODEL_STATES = ("parameters", "gradients", "master_weights", "optimizer_states")
# vocab 1600 x hidden 64 = 102,400 elements: above the default stage3_param_persistence_threshold (1e5), so with
# the default the embeddings and head are partitioned (the root unit) while every layer tensor stays persistent.
LLAMA = {
    "vocab_size": 1600,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
CONFIGS = {
    "s0": {"stage": 0},
    "s1": {"stage": 1},
    "s2": {"stage": 2},
    "s3-partition-all": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "s3-default": {"stage": 3},
    "s3-partition-all-accum4": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
ACCUMULATION = 4


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def _loss(name: str, engine: Any, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    if name == "llama":
        tokens = torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=gen)
        return engine(input_ids=tokens, labels=tokens).loss
    x, y = torch.randn(4, IN_FEATURES, generator=gen), torch.randn(4, OUT_FEATURES, generator=gen)
    return torch.nn.functional.mse_loss(engine(x.to(engine.compute_dtype)).float(), y)


def _one(name: str, key: str, precision: str, rank: int, world_size: int) -> dict[str, Any]:
    import accelerate_zero
    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.debug.estimate import TrainingSetup, estimate_stage, shapes_from_module

    model = _tiny_llama() if name == "llama" else make_model()
    zero = CONFIGS[key]
    accumulation = ACCUMULATION if key.endswith("-accum4") else 1
    config = {
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "gradient_accumulation_steps": accumulation,
    }
    zero_config = ZeroConfig.from_any(config).zero_optimization
    setup = TrainingSetup(world_size, precision, "adamw", zero=zero_config)
    # Shapes before initialize: the engine flattens (and at stage 3 empties) the parameters.
    estimate = estimate_stage(shapes_from_module(model, zero_config), setup, zero["stage"], rank=rank)
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    # Read where the whole training state is held: after a backward, before its optimizer step (stages 2-3 free the
    # gradient shard after the step), and after a first step made the optimizer states: one step then a backward,
    # or with accumulation between micro-steps.
    micro_steps = 1 if accumulation == 1 else accumulation + 3
    for _ in range(micro_steps):
        engine.backward(_loss(name, engine, rank))
        engine.step()
    if accumulation == 1:
        engine.backward(_loss(name, engine, rank))
    measured = engine.memory_breakdown()
    peak_live = engine.scheduler.peak_live_numel * (2 if precision == "bf16" else 4) if engine.scheduler else 0
    engine.destroy()
    return {"measured": measured, "estimated": dict(estimate.device), "gathered_peak": peak_live}


def _all(rank: int, world_size: int) -> dict[str, Any]:
    return {
        (name, key, precision): _one(name, key, precision, rank, world_size)
        for name in ("toy", "llama")
        for key in CONFIGS
        for precision in ("no", "bf16")
    }


@pytest.fixture(scope="module")
def by_rank() -> list[dict[str, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_all, WORLD_SIZE)


CASES = [(name, key, precision) for name in ("toy", "llama") for key in CONFIGS for precision in ("no", "bf16")]


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_model_state_bytes_match_the_engine(by_rank: list[dict[str, Any]], case: tuple[str, str, str]) -> None:
    for rank, results in enumerate(by_rank):
        got = results[case]
        # README: "the tests check it equals engine.memory_breakdown() byte for byte": equal, kind by kind.
        for kind in MODEL_STATES:
            assert got["estimated"][kind] == got["measured"][kind], (rank, kind, got)


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_transient_buffers_bound_what_the_engine_used(
    by_rank: list[dict[str, Any]], case: tuple[str, str, str]
) -> None:
    for results in by_rank:
        got = results[case]
        assert got["estimated"]["communication_buffers"] >= got["measured"]["communication_buffers_peak"], got
        assert got["estimated"]["gathered_parameters"] >= got["gathered_peak"], got
