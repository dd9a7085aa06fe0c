"""Block quantization of ZeRO++ (engine/quantized_comm.py): round trips within the stated bound, packing, sizes."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.engine.quantized_comm import BlockQuantization, dequantize, error_bound, quantize


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4099])
def test_round_trip_within_half_a_step_of_its_block(bits: int, numel: int) -> None:
    q = BlockQuantization(bits, block=256)
    gen = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=gen) * torch.logspace(-3, 2, numel)  # blocks of very different scales
    codes, scales = quantize(values, q)
    assert codes.dtype == torch.uint8 and codes.numel() == q.code_bytes(numel)
    assert scales.numel() == q.num_scales(numel)
    back = dequantize(codes, scales, numel, q)
    error = (back - values).abs()
    bound = error_bound(values, q)
    assert bool((error <= bound * (1 + 1e-6) + 1e-30).all()), (error / bound).max()
    if numel > 16:  # the bound is tight: some element is off by more than a fifth of it (one element is exact)
        assert (error / bound.clamp_min(1e-30)).max() > 0.2


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_and_the_block_maximum_come_back_exact(bits: int) -> None:
    q = BlockQuantization(bits, block=4)
    values = torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, -1.5, 0.0, -3.0])
    back = dequantize(*quantize(values, q), values.numel(), q)
    assert torch.equal(back[:4], torch.zeros(4))
    assert back[4].item() == pytest.approx(3.0) and back[7].item() == pytest.approx(-3.0)


def test_int4_packs_two_codes_per_byte_low_nibble_first() -> None:
    q = BlockQuantization(4, block=2)
    codes, scales = quantize(torch.tensor([-7.0, 7.0]), q)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [0x0 | (0xE << 4)]  # -7 -> code 0, +7 -> code 14


def test_bad_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="8 or 4 bits"):
        BlockQuantization(2)
