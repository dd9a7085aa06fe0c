"""A parameter that got a gradient in one cycle and none in the next ([Note: the first gradient of a cycle is copied,
not added] in engine/buckets.py): its slot must read as zero, not as the last cycle's value or as whatever memory
the buffer reused. Stages 0-3, accumulation 1 and 2 (the parameter used in one micro-step of two), 2 and 3 ranks,
against a one-process reference; buckets of a few parameters each, so an unused slot sits beside used ones. Plain SGD:
with momentum a zero gradient still moves a parameter, which the reference (gradient None: skipped) does not do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed


STEPS, PER_RANK = 4, 2


class Branchy(nn.Module):
    """`extra` takes part only when the step counter says so (the same decision on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.extra = nn.Linear(10, 10)
        self.out = nn.Linear(10, 3)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.out(h)


def _data(world_size: int, accumulation: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    shape = (STEPS, accumulation, PER_RANK * world_size)
    return torch.randn(*shape, 6, generator=gen), torch.randn(*shape, 3, generator=gen)


def _uses_extra(step: int, micro: int) -> bool:
    return step % 2 == 0 and micro == 0


def _reference(world_size: int, accumulation: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = Branchy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = _data(world_size, accumulation)
    for step in range(STEPS):
        for micro in range(accumulation):
            model.use_extra = _uses_extra(step, micro)
            loss = nn.functional.mse_loss(model(xs[step, micro]), ys[step, micro])
            (loss / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(rank: int, world_size: int) -> dict[str, float]:
    import accelerate_zero

    out = {}
    for stage in (0, 1, 2, 3):
        for accumulation in (1, 2):
            torch.manual_seed(0)
            model = Branchy()
            config = {
                "train_micro_batch_size_per_gpu": PER_RANK,
                "gradient_accumulation_steps": accumulation,
                "gradient_clipping": 0.0,
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 150},
            }
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            engine = accelerate_zero.initialize(model, optimizer, config=config, unit_classes=[nn.Linear])
            xs, ys = _data(world_size, accumulation)
            for step in range(STEPS):
                for micro in range(accumulation):
                    model.use_extra = _uses_extra(step, micro)
                    x = xs[step, micro].chunk(world_size)[rank]
                    y = ys[step, micro].chunk(world_size)[rank]
                    engine.backward(nn.functional.mse_loss(engine(x), y))
                    engine.step()
            with accelerate_zero.GatheredParameters(list(model.parameters())):
                trained = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out[f"stage{stage}-acc{accumulation}"] = (
                (trained - _reference(world_size, accumulation)).abs().max().item()
            )
            engine.destroy()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_parameter_without_gradient_in_a_cycle_reads_zero(world_size: int) -> None:
    for rank, diffs in enumerate(run_distributed(_train, world_size)):
        for key, diff in diffs.items():
            assert diff < 1e-6, (world_size, rank, key, diff)
