"""`sequence_parallel_token_values` on a one-rank group against TRL's fused LM head on the padded batch ([Note: per-token
values under sequence parallelism] in accelerate_zero/sequence/token_logps.py): left-padded prompts and right-padded
completions of uneven lengths become one sequence per row starting at position 0, and every value (and gradient)
comes back at its column. The group of several ranks: tests/distributed/test_sequence_parallel_rl.py."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.sequence.tiled_values import tiled_token_values
from accelerate_zero.sequence.token_logps import sequence_parallel_token_values
from tests.helpers.models import tiny_llama_config


pytest.importorskip("trl")


def _model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(attn_implementation="sdpa"))
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompts of 2, 5 and 3 tokens left-padded to 5; completions of 4, 1 and 3 tokens right-padded to 4."""
    generator = torch.Generator().manual_seed(3)
    prompt_mask = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    ids = torch.randint(1, 64, mask.shape, generator=generator).masked_fill(mask == 0, 0)
    return ids, mask, completion_mask.shape[1]


@pytest.mark.parametrize("tiled", [False, True], ids=["fused_head", "tiles_of_2"])
def test_values_of_justified_rows_equal_the_fused_head_on_the_padded_batch(tiled: bool) -> None:
    model = _model()
    ids, mask, keep = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    weights = torch.randn(ids.shape[0], keep, generator=torch.Generator().manual_seed(1))

    entropy_weights = torch.randn(ids.shape[0], keep, generator=torch.Generator().manual_seed(2))
    reference = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    # the entropy's gradient too: GRPO's entropy bonus back-propagates through it
    (reference.log_probs[:, -keep:] * weights + reference.entropy[:, -keep:] * entropy_weights).sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def score(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        assert batch["position_ids"][:, 0].eq(0).all(), "each row starts at its first real token"
        if tiled:  # the config's logits_tile_tokens: TRL's fields from tiles of 2 positions
            labels = batch.pop("shift_labels")
            return tiled_token_values(model, batch.pop("input_ids"), labels, 2, 0.7, **batch)
        out = model(**batch, fused_lm_head=True)
        return {"log_probs": out.log_probs, "entropy": out.entropy}

    values = sequence_parallel_token_values(
        score, ids, mask, labels != -100, DataParallelGroup(None, 0, 1), CommStats()
    )
    logps, entropy = (values[name][:, 1:][:, -keep:] for name in ("log_probs", "entropy"))
    scored = (labels != -100)[:, -keep:]
    assert torch.equal(logps[~scored], torch.zeros_like(logps[~scored])), "0 where nothing is scored, as TRL's"
    assert (logps - reference.log_probs[:, -keep:]).abs().max().item() <= 1e-5
    assert (entropy - reference.entropy[:, -keep:]).abs().max().item() <= 1e-5
    (logps * weights + entropy * entropy_weights).sum().backward()
    for name, param in model.named_parameters():
        assert (param.grad - expected_grads[name]).abs().max().item() <= 1e-5, name
