"""DeepSpeed's own scripts, run with DeepSpeed 0.19.8 (on CPU) and with `accelerate_zero.deepspeed`: the same
losses and weights.

One pooled body per world size runs every script with both frameworks, one after the other in the same ranks
(tests/helpers/deepspeed_scripts.py): DeepSpeed's tutorial shape at stages 1-3 (accumulation, clipping, a client
AdamW over param groups, a LambdaLR, `training_data`), a DeepSpeed-Chat SFT step (a causal LM under `zero.Init`,
weights loaded with `GatheredParameters(modifier_rank=0)`) and an OpenRLHF-style actor step beside a frozen
reference engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import deepspeed_scripts
from tests.helpers.dist import run_distributed
from tests.helpers.models import tiny_llama_config


pytest.importorskip("deepspeed")

TOLERANCE = 1e-5


def _tutorial_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _llama_config(stage: int, accumulation: int = 2) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _cases(world_size: int) -> list[tuple[str, str, tuple]]:
    """(case, script, its arguments after the module)."""
    cases = [(f"tutorial stage {s}", "tutorial", (_tutorial_config(s),)) for s in (1, 2, 3)]
    cases += [(f"chat_sft stage {s}", "chat_sft", (_llama_config(s),)) for s in ((2, 3) if world_size == 2 else (3,))]
    if world_size == 2:
        cases.append(("rlhf actor stage 3", "rlhf_actor", (_llama_config(3, 1), _llama_config(3, 1))))
    return cases


def _both_frameworks(rank: int, world_size: int, folder: str, reference: dict) -> dict[str, dict[str, Any]]:
    import accelerate_zero.deepspeed as ours
    from tests.distributed.deepspeed_runs import deepspeed as import_deepspeed

    # for the CPU, and without the process-group caches of an earlier DeepSpeed body on this pooled rank
    deepspeed = import_deepspeed()

    # No compiled DeepSpeed op: its CPU process group would otherwise JIT-build the shared-memory all-reduce (used by
    # inference only) with g++ on first use, minutes on this machine, behind a file lock other processes share.
    deepspeed.ops.__compatible_ops__ = {}
    assert deepspeed.accelerator.get_accelerator().device_name() == "cpu"
    results: dict[str, dict[str, Any]] = {}
    for case, script, arguments in _cases(world_size):
        for label, module in (("deepspeed", deepspeed), ("ours", ours)):
            torch.manual_seed(0)
            run = getattr(deepspeed_scripts, script)
            extra = (folder,) if script == "tutorial" else (reference,)
            results[f"{case} / {label}"] = run(module, *arguments, *extra, rank)
    for stage in _resume_stages(world_size):  # DeepSpeed's checkpoint continued by DeepSpeed, and by ours
        config = {**_tutorial_config(stage), "gradient_clipping": 0.0}
        for label, reader in (("deepspeed", deepspeed), ("ours", ours)):
            place = str(Path(folder) / f"resume_{stage}_{label}")
            results[f"resume stage {stage} / {label}"] = deepspeed_scripts.resumed(
                deepspeed, reader, config, place, rank
            )
    return results


def _resume_stages(world_size: int) -> tuple[int, ...]:
    return (1, 2, 3) if world_size == 2 else (3,)


def _reference_weights() -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    return {name: p.detach().clone() for name, p in LlamaForCausalLM(tiny_llama_config()).named_parameters()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_deepspeed_scripts_train_the_same_with_both_frameworks(world_size: int, tmp_path: Path) -> None:
    results = run_distributed(_both_frameworks, world_size, str(tmp_path), _reference_weights(), timeout=600)
    cases = [case for case, _, _ in _cases(world_size)]
    for case in cases:
        theirs = [r[f"{case} / deepspeed"] for r in results]
        mine = [r[f"{case} / ours"] for r in results]
        for rank, (a, b) in enumerate(zip(theirs, mine, strict=True)):
            assert len(a["losses"]) == len(b["losses"]) > 1, (case, rank)
            diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
            assert diff < TOLERANCE, f"{case}: rank {rank} losses {a['losses']} (DeepSpeed) vs {b['losses']} (ours)"
            for key in ("lr", "steps", "boundary"):
                assert a.get(key) == pytest.approx(b.get(key)), (case, key)
        weights_a, weights_b = theirs[0]["weights"], mine[0]["weights"]
        assert weights_a.keys() == weights_b.keys()
        worst = max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)
        assert worst < TOLERANCE, f"{case}: weights differ by {worst}"
        moved = max((weights_a[k] - _initial(case, k)).abs().max().item() for k in weights_a)
        assert moved > 1e-3, f"{case}: training did not move the weights"
    for stage in _resume_stages(world_size):  # issue 49: a DeepSpeed run moves to us mid-training
        for rank, r in enumerate(results):
            theirs, mine = r[f"resume stage {stage} / deepspeed"], r[f"resume stage {stage} / ours"]
            diff = max(abs(x - y) for x, y in zip(theirs["losses"], mine["losses"], strict=True))
            assert diff < TOLERANCE, (stage, rank, theirs["losses"], mine["losses"])
            assert (mine["steps"], mine["client_state"]) == (theirs["steps"], {"epoch": 1}) == (4, {"epoch": 1})
            assert mine["lr"] == pytest.approx(theirs["lr"]), (stage, rank)
        theirs, mine = results[0][f"resume stage {stage} / deepspeed"], results[0][f"resume stage {stage} / ours"]
        worst = max((theirs["weights"][k] - mine["weights"][k]).abs().max().item() for k in theirs["weights"])
        assert worst < TOLERANCE, f"resume stage {stage}: weights differ by {worst}"
    rlhf = [r.get("rlhf actor stage 3 / ours") for r in results]
    assert all(r is None or r["ref_optimizer"] for r in rlhf)  # no optimizer for the reference engine


def _initial(case: str, key: str) -> torch.Tensor:
    if case.startswith("tutorial"):
        return dict(deepspeed_scripts.make_model().named_parameters())[key].detach()
    return _reference_weights()[key]
