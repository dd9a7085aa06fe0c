"""The engine's global gradient norm on a 25M-element layer equals the exact norm of the unsharded gradient.

The gradients themselves agree to fp32 summation order (~1e-7 relative); the norm must agree as closely, at every
stage, whatever the size of the flat buffers ([Note: the norm of a large flat buffer]). The reference is taken in
fp64: `clip_grad_norm_`'s own fp32 norm of one 25M-element CPU tensor is ~1.7e-3 low here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed


WIDTH, BATCH_PER_RANK = 5000, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(WIDTH, WIDTH)


def _batch(world_size: int) -> torch.Tensor:
    return torch.randn(BATCH_PER_RANK * world_size, WIDTH, generator=torch.Generator().manual_seed(1))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return (output + 0.5).pow(2).mean()  # an offset keeps the gradient's mean away from zero


def _engine_norms(rank: int, world_size: int) -> dict[int, float | None]:
    import accelerate_zero

    norms = {}
    x = _batch(world_size).chunk(world_size)[rank]
    for stage in (1, 2, 3):
        model = _model()
        config = {"gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}
        engine = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), config)
        engine.backward(_loss(engine(x)))
        engine.step()
        norms[stage] = engine.get_global_grad_norm()
        engine.destroy()
    return norms


@pytest.fixture(scope="module")
def norms() -> list[dict[int, float | None]]:
    return run_distributed(_engine_norms, 2)


def test_global_grad_norm_is_exact_to_fp32_rounding(norms: list[dict[int, float | None]]) -> None:
    model = _model()
    for part in _batch(2).chunk(2):
        (_loss(model(part)) / 2).backward()
    reference = sum(p.grad.double().square().sum() for p in model.parameters()).sqrt().item()
    for rank, by_stage in enumerate(norms):
        for stage, norm in by_stage.items():
            assert norm is not None
            assert abs(norm - reference) / reference < 2e-6, (rank, stage, norm, reference)
