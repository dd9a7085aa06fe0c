"""The gradient norm of a large flat buffer is exact to fp32 rounding ([Note: the norm of a large flat buffer])."""

from __future__ import annotations

import torch

from accelerate_zero.engine.norms import sum_of_squares


def test_sum_of_squares_of_50m_elements_matches_fp64() -> None:
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(50_000_000, generator=gen) * 1e-3 + 1e-3  # a non-zero mean makes fp32 accumulation drift
    exact = flat.double().square().sum().sqrt().item()
    # torch's own fp32 norm of one 50M-element CPU tensor is ~3e-3 low: the case this module exists for.
    assert abs(torch.linalg.vector_norm(flat).item() - exact) / exact > 1e-4
    # 64K-element chunks normed in fp32 (relative error ~ a few fp32 ulps each), squares summed in fp64.
    ours = sum_of_squares([flat[:12_345_678], flat[12_345_678:]]).sqrt().item()
    assert abs(ours - exact) / exact < 1e-6


def test_sum_of_squares_of_16_bit_and_empty_tensors() -> None:
    values = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    result = sum_of_squares([values, torch.empty(0)])
    assert result.dtype == torch.float64 and result.item() == 25.0
    assert sum_of_squares([]).item() == 0.0
