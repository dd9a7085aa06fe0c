"""The stage-3 scheduler's training phase ([Note: the training phase] in engine/stage3/schedule.py) on one rank: a
forward runs in FORWARD, backward hooks in BACKWARD, a recomputation under activation checkpointing is seen as part of
backward, a plain `loss.backward()` the engine never sees ends in IDLE, and illegal transitions raise."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.stage3.flat_unit import build_flat
from accelerate_zero.engine.stage3.hooks import register_unit_hooks
from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.engine.stage3.schedule import TrainingPhase, UnitScheduler
from accelerate_zero.engine.stage3.units import find_unit_modules, layout_units


DP = DataParallelGroup(group=None, rank=0, world_size=1)


class _Model(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.head = nn.Parameter(torch.randn(4))  # the root unit's parameter
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        x = checkpoint(self.second, x, use_reentrant=True) if self.recompute else self.second(x)
        return x * self.head


def _scheduled(recompute: bool) -> tuple[_Model, UnitScheduler, list[tuple[str, TrainingPhase]]]:
    torch.manual_seed(0)
    model = _Model(recompute)
    layout = layout_units(model, find_unit_modules(model, [nn.Linear]), 0, sys.maxsize)
    units = [
        ParamUnit(
            i, spec.name, spec.module, build_flat(spec.trainable, 0, 1, torch.float32, torch.device("cpu")), None, None
        )
        for i, spec in enumerate(layout.units)
    ]
    scheduler = UnitScheduler(
        units, units[-1], DP, CommStats(), prefetch_numel=0, max_live_numel=sys.maxsize, max_reuse_distance=0
    )
    register_unit_hooks(units, scheduler)
    seen: list[tuple[str, TrainingPhase]] = []
    for name in ("first", "second"):
        module = getattr(model, name)
        module.register_forward_hook(lambda *_, name=name: seen.append((name, scheduler.phase)))
    return model, scheduler, seen


def test_forward_then_a_plain_backward_walk_idle_forward_backward_idle() -> None:
    model, scheduler, seen = _scheduled(recompute=False)
    assert scheduler.phase is TrainingPhase.IDLE
    out = model(torch.randn(2, 4, requires_grad=True))
    assert seen == [("first", TrainingPhase.FORWARD), ("second", TrainingPhase.FORWARD)]
    assert scheduler.phase is TrainingPhase.IDLE
    out.sum().backward()  # a plain backward: no engine tells the scheduler it ended
    assert scheduler.phase is TrainingPhase.IDLE, "autograd's end-of-pass callback returns the phase to IDLE"
    assert model.first.weight.grad is not None and model.first.weight.grad.abs().sum() > 0


def test_a_recomputation_during_backward_runs_in_the_backward_phase() -> None:
    model, scheduler, seen = _scheduled(recompute=True)
    out = model(torch.randn(2, 4, requires_grad=True))
    assert [phase for _, phase in seen] == [TrainingPhase.FORWARD, TrainingPhase.FORWARD]
    seen.clear()
    out.sum().backward()
    assert seen == [("second", TrainingPhase.BACKWARD)], seen
    assert scheduler.phase is TrainingPhase.IDLE


def test_ending_a_forward_that_never_began_is_refused() -> None:
    _, scheduler, _ = _scheduled(recompute=False)
    with pytest.raises(AssertionError, match="cannot enter idle from idle"):
        scheduler._end_forward()
