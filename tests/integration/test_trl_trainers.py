"""The ready-made TRL trainers (`accelerate_zero.integrations.trl`) at stage 3 on 2 ranks, in memory and collectives:
the DPO/GRPO reference model stays sharded for the whole run; GRPO's generation gathers the policy once per generate
call with `ds3_gather_for_generation` (TRL's default) and per decoding step without it. That SFT, DPO and GRPO train
to TRL's own numbers is tests/integration/test_trl_numerics.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed


pytest.importorskip("trl")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.integration import trl_trainer_checks

    results = run_distributed(trl_trainer_checks.all_checks, 2, str(tmp_path_factory.mktemp("trl")))
    print("TRL measurements:", json.dumps(results, default=str))  # pytest -s shows them (times, bytes held)
    return results


def test_dpo_reference_model_stays_sharded(ranks: Any) -> None:
    for run in (r["dpo"] for r in ranks):
        assert run["steps"] == 2 and run["policy_stage"] == 3 and run["ref_prepared"]
        held = run["ref_held_during_training"]
        assert len(held) == 2  # after each step
        for seen in held:
            # every parameter is sharded over 2 ranks: about half of the fp32 weights (plus padding), nothing
            # materialised between steps
            assert seen["data"] + seen["shards"] <= 0.55 * seen["full_fp32"], seen


def test_grpo_generation_gathers_once_per_call(ranks: Any) -> None:
    for rank in ranks:
        once, per_step = rank["grpo_gather"], rank["grpo_no_gather"]
        assert once["steps"] == per_step["steps"] == 2 and once["ref_sharded"]
        assert once["generate"] and per_step["generate"]
        for call in once["generate"]:
            assert call["collectives"] <= once["units"]  # one gather per unit for the whole generate call
        assert min(c["collectives"] for c in per_step["generate"]) > once["units"]


def test_grpo_generates_with_the_training_state_asleep(ranks: Any) -> None:
    """`offload_states_during_generation`: while completions are generated the engine holds its parameters only;
    the run trains to the very weights of the run that kept everything on the device."""
    for rank in ranks:
        awake, asleep = rank["grpo_gather"], rank["grpo_asleep"]
        assert asleep["steps"] == 2 and asleep["generate"]
        assert awake["held_while_generating"]["optimizer_states"] > 0  # the second rollout follows a step
        for kind in ("optimizer_states", "master_weights", "gradients"):
            assert asleep["held_while_generating"][kind] == 0, (kind, asleep["held_while_generating"])
        assert asleep["held_while_generating"]["parameters"] > 0
        assert torch.equal(asleep["trained"], awake["trained"])
