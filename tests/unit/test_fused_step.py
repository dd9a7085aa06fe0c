"""The engine steps with torch's fused kernel where the user left the choice to torch (optim/fused.py)."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.optim.fused import prefer_fused_step


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(7, 15)), torch.nn.Parameter(torch.randn(15))]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad])
def test_unset_choice_becomes_fused_and_steps_like_the_default(cls: type) -> None:
    default_params, fused_params = _params(), _params()
    for a, b in zip(default_params, fused_params, strict=True):
        b.data.copy_(a.data)
    default, fused = cls(default_params, lr=0.01), cls(fused_params, lr=0.01)
    assert prefer_fused_step(fused, fused_params)
    assert all(g["fused"] is True and g["foreach"] is False for g in fused.param_groups)
    for _ in range(3):
        for a, b in zip(default_params, fused_params, strict=True):
            a.grad = torch.full_like(a, 0.3)
            b.grad = torch.full_like(b, 0.3)
        default.step()
        fused.step()
    for a, b in zip(default_params, fused_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("choice", [{"foreach": True}, {"foreach": False}, {"fused": False}])
def test_an_explicit_choice_is_kept(choice: dict) -> None:
    params = _params()
    optimizer = torch.optim.AdamW(params, lr=0.01, **choice)
    assert not prefer_fused_step(optimizer, params)
    for key, value in choice.items():
        assert optimizer.param_groups[0][key] is value


def test_optimizers_without_a_fused_kernel_are_left_alone() -> None:
    params = _params()
    optimizer = torch.optim.RMSprop(params, lr=0.01)
    assert not prefer_fused_step(optimizer, params)
    assert optimizer.param_groups[0]["foreach"] is None
