"""Our TRL trainers against TRL's own, in numbers: `ZeroSFTTrainer`, `ZeroDPOTrainer` and `ZeroGRPOTrainer` on 2 ranks
at stages 2 and 3 train on the same distinct examples as TRL's `SFTTrainer`, `DPOTrainer` and `GRPOTrainer` in one
process (the ranks' shards together are its batch at every micro-step; accumulation 2, TRL's bf16 default), and
must end with the same weights and log the same losses, gradient norms and reference-model terms. Then what
`ZeroDistributedBackend.gather_params` gives TRL. What each process runs: tests/integration/trl_numerics.py.

[Note: tolerances of the TRL comparison]
The runs are the same arithmetic up to bf16 (the reference autocasts over fp32 weights, the engine computes with bf16
copies of fp32 masters) and padding (the ranks pad shorter batches). Each tolerance is >= 10x the largest deviation
("noise") measured on this CPU over trainers, stages and steps, and below what the bugs it is there for gave. The
bugs were made by monkeypatching accelerate or the engine inside the ranks (stages 2 and 3; E at stage 3):
A rank 1 reads rank 0's data shard; B each micro-step's reduced gradient replaces the one before (a dropped
micro-step); C gradients summed over ranks, not averaged; D the engine divides the loss by the accumulation steps
again; E rank 1's shard of the frozen reference model is zeros (the gather_params test sees it too). "-": the check
does not see it.

| check (relative)   | noise  | tolerance | A         | B                | C       | D         | E           |
| ------------------ | ------ | --------- | --------- | ---------------- | ------- | --------- | ----------- |
| weight change (L2) | 0.018  | 0.2       | 0.60-1.0  | 0.67-0.79        | 1.0 (*) | 0.45-0.52 | -           |
| logged grad_norm   | 5.8e-4 | 0.01      | 0.10-0.49 | 0.26-0.41        | 1.0     | 0.5       | -           |
| logged loss        | 3.3e-5 | 1e-3      | 2e-3-0.09 | 2e-3-9e-3 step 2 | -       | -         | 6.6e-3-0.02 |
| ref terms (abs.)   | 1.3e-4 | 2e-3      | -         | -                | -       | -         | 4.7e-3-0.02 |

"ref terms": DPO's rewards/chosen, rejected, margins and GRPO's kl, 0 at the first step (policy == reference).

(*) DPO and GRPO; SFT's gradient norm is above TRL's clipping (1.0) in both runs, so a gradient twice too large is
clipped to the same update: the logged grad_norm is what catches it there. Counts (tokens seen, GRPO rewards and
completion lengths, learning rates) are compared exactly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed


pytest.importorskip("trl")

RUNS = [f"{trainer}-{stage}" for stage in (2, 3) for trainer in ("sft", "dpo", "grpo")]
WEIGHT_RTOL = 0.2
RELATIVE = {"loss": 1e-3, "grad_norm": 1e-2, "logps/chosen": 1e-3, "logps/rejected": 1e-3}  # logps: noise 3e-5
# Values near 0 (0 at the first step, when the policy is still the reference model): compared absolutely.
ABSOLUTE = {"rewards/chosen": 2e-3, "rewards/rejected": 2e-3, "rewards/margins": 2e-3, "kl": 2e-3}
EXACT = ("num_tokens", "reward", "reward_std", "completions/mean_length", "completions/max_length", "learning_rate")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from tests.integration import trl_numerics

    folder = str(tmp_path_factory.mktemp("trl_numerics"))
    reference = run_distributed(trl_numerics.reference, 1, folder)[0]
    return reference, run_distributed(trl_numerics.zero_runs, 2, folder)


def _update_deviation(zero: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], initial: dict) -> tuple:
    assert zero.keys() == ref.keys() == initial.keys()
    ours = torch.cat([(zero[k] - initial[k]).flatten() for k in initial])
    theirs = torch.cat([(ref[k] - initial[k]).flatten() for k in initial])
    return ((ours - theirs).norm() / theirs.norm()).item(), theirs.norm().item()


@pytest.mark.parametrize("name", RUNS)
def test_weights_match_trl(runs: Any, name: str) -> None:
    reference, ranks = runs
    trainer, stage = name.split("-")
    ours, theirs = ranks[0][name], reference[trainer]
    assert ours["bf16"] and theirs["bf16"]  # TRL's default
    assert ours["stage"] == int(stage) and ours["steps"] == theirs["steps"] == 2
    deviation, moved = _update_deviation(ours["weights"], theirs["weights"], reference["initial"])
    message = f"{name}: weight change {moved:.3g}, its relative deviation from TRL's {deviation:.3g}"
    print(message)  # pytest -s shows the margin
    assert moved > 0.1 and deviation < WEIGHT_RTOL, message  # [Note: tolerances of the TRL comparison]


@pytest.mark.parametrize("name", RUNS)
def test_logged_metrics_match_trl(runs: Any, name: str) -> None:
    reference, ranks = runs
    theirs = reference[name.split("-")[0]]["logs"]
    for rank, results in enumerate(ranks):
        ours = results[name]["logs"]
        assert len(ours) == len(theirs) == 2
        for step, (mine, ref) in enumerate(zip(ours, theirs, strict=True)):
            _check_logged(f"{name} rank {rank} step {step + 1}", mine, ref)


def _check_logged(where: str, mine: dict[str, float], ref: dict[str, float]) -> None:
    def message(key: str) -> str:
        return f"{where}: {key} {mine.get(key)} vs TRL's {ref[key]}"

    for key, rtol in RELATIVE.items():
        if key in ref:
            assert math.isclose(mine[key], ref[key], rel_tol=rtol), message(key)
    for key, atol in ABSOLUTE.items():
        if key in ref:
            assert abs(mine[key] - ref[key]) <= atol, message(key)
    for key in EXACT:
        if key in ref:
            assert mine[key] == ref[key], message(key)


@pytest.mark.parametrize("stage", [2, 3])
def test_gather_params_gives_full_trained_weights(runs: Any, stage: int) -> None:
    reference, ranks = runs
    masters = ranks[0][f"grpo-{stage}"]["weights"]
    for rank in ranks:
        seen = rank[f"gather-{stage}"]
        assert (seen["backend"], seen["is_zero3"]) == ("ZeroDistributedBackend", False)  # no deepspeed import path
        full = {name: tuple(t.shape) for name, t in masters.items()}
        if stage == 3:  # sharded outside the context, and again after it
            assert all(seen["shapes_before"][n] != shape for n, shape in full.items()), seen["shapes_before"]
            assert seen["shapes_after"] == seen["shapes_before"]
        # Inside: the full parameters, the engine's fp32 masters rounded to the bf16 the model computes in.
        for name, master in masters.items():
            assert torch.equal(seen["policy"][name], master.to(torch.bfloat16)), name
        for name, value in seen["one"].items():
            assert torch.equal(value, masters[name].to(torch.bfloat16)), name
        # The frozen reference model (sharded at stage 3 too) is still the initial model.
        for name, initial in reference["initial"].items():
            assert torch.equal(seen["ref"][name], initial.to(torch.bfloat16)), name
