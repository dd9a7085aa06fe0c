"""Ulysses attention on a group of one rank (accelerate_zero/sequence/ulysses.py): the model's own attention, and
what it cannot compute refused by name."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.sequence import register_ulysses_attention, shard_sequence
from tests.helpers.models import tiny_mistral_config


def _loss(model: torch.nn.Module, tokens: torch.Tensor, group: DataParallelGroup) -> torch.Tensor:
    shard = shard_sequence(tokens, tokens, group)
    labels = shard["shift_labels"]
    return model(
        input_ids=shard["input_ids"], position_ids=shard["position_ids"], labels=labels, shift_labels=labels
    ).loss


def test_a_sliding_window_longer_than_the_sequence_is_no_window() -> None:
    from transformers import MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(tiny_mistral_config())
    tokens = torch.randint(0, 64, (1, 13), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=tokens, labels=tokens).loss.item()
    group = DataParallelGroup(None, 0, 1)
    model.set_attn_implementation(register_ulysses_attention(group))
    assert _loss(model, tokens, group).item() == pytest.approx(expected, abs=1e-6)


def test_a_window_shorter_than_the_sequence_is_refused_by_name() -> None:
    from transformers import MistralForCausalLM

    model = MistralForCausalLM(tiny_mistral_config(sliding_window=4))
    group = DataParallelGroup(None, 0, 1)
    model.set_attn_implementation(register_ulysses_attention(group))
    with pytest.raises(ValueError, match=r"13 tokens; got \{'sliding_window': 4\}"):
        _loss(model, torch.randint(0, 64, (1, 13)), group)
