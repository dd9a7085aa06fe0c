"""Every mixture-of-experts model type of the installed transformers under expert parallelism (issue 52): split
and exact, or refused by name at `initialize` (tests/helpers/moe_models.py places each type).

One pooled group of 2 ranks builds each type's tiny text model once (the same weights on both ranks), runs each
rank's own tokens through it unsplit, splits its experts at ep 2 (`split_experts`, what `initialize` runs first) and
runs the same tokens again: the outputs agree (the experts compute on other batches, so to fp32 rounding). A type
the helper refuses must raise the refusal naming its module. A model type transformers adds later is in the walk
(its modeling code mentions experts) and fails it until it is placed. The calling conventions (Llama-4's
replicated rows, gpt-oss's argument names and biases, DBRX's experts in `[E * F, H]` matrices) are also trained
against one process in tests/distributed/test_expert_parallel.py.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch


WORLD_SIZE, TOKENS = 2, (2, 6)


def _output(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=False)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _walk(rank: int, world_size: int) -> dict[str, Any]:
    from accelerate_zero.engine.collectives import CommStats
    from accelerate_zero.engine.experts.parallel import split_experts
    from accelerate_zero.engine.groups import init_data_parallel_group
    from tests.helpers.moe_models import REFUSED, moe_model_types, tiny_moe

    world = init_data_parallel_group(torch.device("cpu"))
    tokens = torch.randint(3, 64, (world_size, *TOKENS), generator=torch.Generator().manual_seed(7))[rank]
    out: dict[str, Any] = {}
    for model_type in moe_model_types():
        try:
            model = tiny_moe(model_type)
            if model_type in REFUSED:
                try:
                    split_experts(model, world, CommStats())
                    out[model_type] = ("split", None)
                except (ValueError, NotImplementedError) as error:
                    out[model_type] = ("refused", str(error))
                continue
            unsplit = _output(model, tokens)
            placement = split_experts(model, world, CommStats())
            error = (_output(model, tokens) - unsplit).abs().max().item()
            out[model_type] = ("split", (error, len(placement.layers), unsplit.abs().max().item()))
        except Exception:  # noqa: BLE001 (reported per type: one broken model must not hide the others)
            out[model_type] = ("error", traceback.format_exc(limit=-4))
    return out


@pytest.fixture(scope="module")
def walked() -> list[dict[str, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_walk, WORLD_SIZE, timeout=600)


def test_every_moe_model_type_is_split_exactly_or_refused_by_name(walked: list[dict[str, Any]]) -> None:
    from tests.helpers.moe_models import REFUSED

    for rank, results in enumerate(walked):
        assert len(results) >= len(REFUSED) + 60, sorted(results)  # the walk found transformers' MoE models
        failures = {}
        for model_type, (what, detail) in results.items():
            if model_type in REFUSED:
                if what != "refused" or REFUSED[model_type] not in detail:
                    failures[model_type] = (what, detail)
            elif what != "split" or detail[0] > 1e-4 or detail[1] == 0 or detail[2] == 0:
                failures[model_type] = (what, detail)  # add its tiny config to OVERRIDES, or refuse it by name
        assert not failures, f"rank {rank}:\n" + "\n".join(f"{k}: {v}" for k, v in failures.items())
