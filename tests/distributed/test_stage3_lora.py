"""LoRA at stage 3 with every parameter sharded: frozen base weights share units with trainable adapters.

A unit must stay gathered until autograd no longer needs any of its weights: its trainable gradients can all be
ready while a frozen weight of the same unit (the base projection beside an adapter, a frozen norm) is still needed
for the gradient of the unit's input. Training at 2 and 3 ranks (gradient accumulation 2, frozen embeddings and
trainable ones, activation checkpointing reentrant and not) equals a one-process reference that averages the
ranks' sub-batch gradients, and units are released during backward (the peak of gathered parameters stays below the
whole model).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import tiny_llama_config


STEPS, ACCUM, PER_RANK, SEQ, VOCAB, LR = 2, 2, 2, 10, 64, 0.1
# A prefetch budget of one element: only the next unit is gathered ahead, so the peak shows when units are released.
ZERO3 = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 1,
}
LAYERS = 4
CASES = {
    # adapters on every projection, everything else frozen: the input of layer 0 needs no gradient
    "lora-all-linear": {
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    },
    # adapters on attention only, the MLP and norms of each layer frozen; embeddings trainable, so every layer's
    # input needs a gradient through its frozen weights
    "lora-attention-embeddings": {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["embed_tokens"]},
    # peft's usual QLoRA setup: checkpointed layers, the embeddings' output made to require a gradient
    "lora-checkpoint-reentrant": {"target_modules": ["q_proj", "v_proj", "down_proj"], "checkpointing": "reentrant"},
    "lora-checkpoint-nonreentrant": {"target_modules": ["q_proj", "v_proj", "down_proj"], "checkpointing": "plain"},
}


def _model(case: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    options = dict(CASES[case])
    checkpointing = options.pop("checkpointing", "")
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=False, num_hidden_layers=LAYERS))
    if checkpointing:
        base.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **options))
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make the adapters matter from the first step
            torch.nn.init.normal_(param, std=0.02)
    return model


def _batches(world_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (PER_RANK * world_size, SEQ), generator=gen) for _ in range(STEPS * ACCUM)]


def _reference(case: str, world_size: int) -> dict[str, torch.Tensor]:
    model = _model(case)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    batches = _batches(world_size)
    for step in range(STEPS):
        for micro in range(ACCUM):
            for part in batches[step * ACCUM + micro].chunk(world_size):
                (model(input_ids=part, labels=part).loss / (ACCUM * world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _train(rank: int, world_size: int) -> dict[str, Any]:
    import accelerate_zero

    out = {}
    for case in CASES:
        model = _model(case)
        model_numel = sum(p.numel() for p in model.parameters())
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        config = {"gradient_accumulation_steps": ACCUM, "zero_optimization": ZERO3}
        engine = accelerate_zero.initialize(model, optimizer, config)
        for tokens in _batches(world_size):
            mine = tokens.chunk(world_size)[rank]
            engine.backward(engine(input_ids=mine, labels=mine).loss)
            engine.step()
        peak_live = engine.scheduler.peak_live_numel  # before the gathered state dict below
        full = engine.full_state_dict(only=trainable)
        out[case] = {"trainable": full, "peak_live": peak_live, "model_numel": model_numel}
        engine.destroy()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def trained(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_distributed(_train, request.param)


@pytest.mark.parametrize("case", list(CASES))
def test_lora_training_equals_the_reference(trained: tuple, case: str) -> None:
    world_size, results = trained
    reference = _reference(case, world_size)
    got = results[0][case]["trainable"]
    assert set(got) == set(reference)
    diff = max((got[n] - reference[n]).abs().max().item() for n in reference)
    assert diff < 1e-6, (world_size, case, diff)


@pytest.mark.parametrize("case", list(CASES))
def test_units_are_released_during_backward(trained: tuple, case: str) -> None:
    _, results = trained
    for rank, by_case in enumerate(results):
        got = by_case[case]
        assert 0 < got["peak_live"] < 0.8 * got["model_numel"], (rank, case, got["peak_live"], got["model_numel"])
