"""Tiled MLP and tiled logits + loss (accelerate_zero/sequence/tiling.py) on one process: the same loss and
gradients as the whole sequence, and what autograd keeps for backward at most half of it."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.sequence import tile_mlp, tiled_causal_lm_loss
from tests.helpers.models import tiny_llama_config


def _llama(**overrides: object) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def _shift(tokens: torch.Tensor) -> torch.Tensor:
    shift = torch.full_like(tokens, -100)
    shift[:, :-1] = tokens[:, 1:]
    return shift


@pytest.mark.parametrize("tile", [1, 5, 16, 64])
def test_tiles_give_the_whole_sequence_loss_and_gradients(tile: int) -> None:
    model = _llama()
    tokens = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens, labels=tokens).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = model(input_ids=tokens, labels=tokens).loss.item()
    model.zero_grad()
    assert tile_mlp(model, tile) == 2
    shift = _shift(tokens)
    loss = tiled_causal_lm_loss(model, tokens, shift, (shift != -100).sum(), tile)
    loss.backward()
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert max((p.grad - reference[n]).abs().max().item() for n, p in model.named_parameters()) < 1e-6


@pytest.mark.parametrize("head", ["tied", "untied", "with_bias"])
def test_a_linear_head_runs_once_for_all_tiles_and_others_per_tile(head: str) -> None:
    """[Note: one head call for every tile]: a linear head without bias (tied or not) is called once in forward and
    gives the same loss and gradients as the whole sequence; a head with a bias runs per tile, as before."""
    model = _llama(tie_word_embeddings=head == "tied")
    if head == "with_bias":
        torch.manual_seed(3)
        model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    tokens = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(4))
    model(input_ids=tokens, labels=tokens).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = model(input_ids=tokens, labels=tokens).loss.item()
    model.zero_grad()
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    shift = _shift(tokens)
    loss = tiled_causal_lm_loss(model, tokens, shift, (shift != -100).sum(), 5)
    loss.backward()
    assert len(calls) == (1 if head != "with_bias" else 2 * 5), "one call, or a call per tile and its recomputation"
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert max((p.grad - reference[n]).abs().max().item() for n, p in model.named_parameters()) < 1e-6
    assert model(input_ids=tokens).logits.shape == (2, 23, 64), "called without a loss, the head gives logits"


def _saved_bytes(run: object) -> int:
    """Bytes of the tensors autograd keeps for backward while `run()` builds the graph (each storage once)."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run()
    loss.backward()
    return sum(seen.values())


def test_tiling_keeps_at_most_half_of_what_the_whole_sequence_keeps() -> None:
    # A vocabulary of 4096 and 512 tokens: the logits and their loss dominate, as at long context.
    tokens = torch.randint(0, 4096, (1, 512), generator=torch.Generator().manual_seed(2))
    shift = _shift(tokens)
    model = _llama(vocab_size=4096, intermediate_size=128)
    whole = _saved_bytes(lambda: model(input_ids=tokens, labels=tokens).loss)
    tile_mlp(model, 64)
    tiled = _saved_bytes(lambda: tiled_causal_lm_loss(model, tokens, shift, (shift != -100).sum(), 64))
    assert tiled * 2 <= whole, (tiled, whole)


def test_bad_tiles_are_refused() -> None:
    with pytest.raises(ValueError, match="tile_tokens=0"):
        tile_mlp(_llama(), 0)
