"""One stage-3 unit's lifecycle on a one-rank group: sharded -> gathering -> gathered -> sharded, asserted."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.stage3.flat_unit import build_flat
from accelerate_zero.engine.stage3.param_unit import ParamUnit, UnitState


def _unit() -> tuple[ParamUnit, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 3)
    original = {n: p.detach().clone() for n, p in layer.named_parameters()}
    flat = build_flat(list(layer.parameters()), 0, 1, torch.float32, torch.device("cpu"))
    return ParamUnit(0, "layer", layer, flat, None, None), original


def test_gather_and_release_restore_the_parameters() -> None:
    unit, original = _unit()
    dp = DataParallelGroup(group=None, rank=0, world_size=1)
    assert unit.state is UnitState.SHARDED and unit.module.weight.numel() == 0
    unit.unshard(dp, CommStats())
    assert unit.state is UnitState.GATHERING
    unit.wait_for_unshard()
    assert unit.state is UnitState.GATHERED
    for name, param in unit.module.named_parameters():
        assert torch.equal(param, original[name])
    unit.reshard()
    assert unit.state is UnitState.SHARDED and unit.module.weight.numel() == 0


@pytest.mark.parametrize(
    ("action", "words"),
    [
        (
            lambda unit: unit.wait_for_unshard(),
            "cannot wait for its gather in state sharded (expected gathering or gathered)",
        ),
        (
            lambda unit: unit.refresh_shards_from_full(),
            "cannot refresh its shards from the full parameters in state sharded",
        ),
    ],
)
def test_a_transition_from_the_wrong_state_raises_naming_the_unit(action: object, words: str) -> None:
    unit, _ = _unit()
    with pytest.raises(AssertionError, match="layer") as error:
        action(unit)  # type: ignore[operator]
    assert words in str(error.value)
