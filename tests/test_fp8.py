"""moe_comm.quantize / dequantize (contract: FP8 format): the block-scaled e4m3 format against a
straightforward float32 computation, its edge values, and its errors."""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import InputError, fp8
from moe_comm.fp8 import BLOCK, FP8_MAX
import fp8_model


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scales_values_and_round_trip_match_a_float32_computation(round_scale, dtype):
    gen = torch.Generator().manual_seed(0)
    # Blocks of very different magnitudes, one of them all zeros.
    x = torch.randn(3, 4 * BLOCK, generator=gen) * torch.tensor([1e-3, 1.0, 300.0, 0.0]).repeat_interleave(BLOCK)
    x = x.to(dtype)
    x_fp8, scales = moe_comm.quantize(x, round_scale=round_scale)
    assert (x_fp8.dtype, x_fp8.shape, scales.dtype, scales.shape) == (torch.float8_e4m3fn, x.shape, torch.float32,
                                                                      (3, 4))
    # Bit for bit: the format is specified down to its roundings, so that every device gives the same bytes.
    want_codes, want_scales = fp8_model.quantize(x, round_scale)
    assert torch.equal(scales, want_scales)
    assert torch.equal(x_fp8.view(torch.uint8), want_codes)
    back = moe_comm.dequantize(x_fp8, scales, dtype=torch.float32)
    assert torch.equal(back, fp8_model.dequantize(want_codes, want_scales, torch.float32))
    # e4m3 keeps 3 mantissa bits: within half a unit in the last place (2^-4) of the block's largest value.
    blocks = x.float().reshape(3, 4, BLOCK)
    bound = blocks.abs().amax(dim=2, keepdim=True) * 2.0 ** -4 * (2 if round_scale else 1) + 1e-30
    assert torch.all((back.reshape(3, 4, BLOCK) - blocks).abs() <= bound)
    assert torch.all(back[:, 3 * BLOCK:] == 0), "an all-zero block must come back as zeros"


def test_scales_are_amax_times_the_float32_reciprocal_of_448_bit_for_bit():
    # 256 blocks of random magnitudes: a division by 448 instead (a different rounding) gives another
    # float32 for about half of them, which the first check shows these blocks do.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 4 * BLOCK, generator=gen) * torch.exp(torch.randn(64, 4 * BLOCK, generator=gen) * 4)
    amax = x.reshape(64, 4, BLOCK).abs().amax(dim=2).double()
    divided = (amax / FP8_MAX).float()
    _, want = fp8_model.quantize(x)
    assert (divided != want).float().mean() > 0.25, "these blocks would not tell a division from the multiply"
    _, scales = moe_comm.quantize(x)
    assert torch.equal(scales, want), f"{int((scales != want).sum())} of 256 scales differ"


def test_the_largest_value_of_a_block_lands_on_448_and_nothing_overflows():
    x = torch.zeros(1, BLOCK)
    x[0, :4] = torch.tensor([3.0e4, -3.0e4, 1.0, 1e-6])
    x_fp8, scales = moe_comm.quantize(x)
    assert x_fp8[0, :2].float().tolist() == [FP8_MAX, -FP8_MAX]
    assert not torch.isnan(x_fp8.float()).any()
    assert x_fp8[0, 3].float().item() == 0.0  # far below the block's scale: flushed to zero
    # Huge and tiny blocks stay finite: float32 scales cover them.
    for magnitude in (1e30, 1e-30):
        x_fp8, scales = moe_comm.quantize(torch.full((1, BLOCK), magnitude))
        assert torch.isfinite(scales).all() and x_fp8.float().abs().max().item() <= FP8_MAX


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_makes_its_block_nan_and_leaves_the_others(bad):
    x = torch.ones(2, 2 * BLOCK)
    x[1, BLOCK + 5] = bad
    x_fp8, scales = moe_comm.quantize(x)
    back = moe_comm.dequantize(x_fp8, scales)
    assert torch.isnan(back[1, BLOCK:]).all(), "the block holding it"
    assert torch.equal(back[0], torch.ones(2 * BLOCK, dtype=torch.bfloat16))
    assert torch.equal(back[1, :BLOCK], torch.ones(BLOCK, dtype=torch.bfloat16))


def test_round_scale_gives_powers_of_two_at_least_the_exact_scale():
    x = torch.randn(4, 2 * BLOCK, generator=torch.Generator().manual_seed(1)) * 7
    _, exact = moe_comm.quantize(x)
    _, rounded = moe_comm.quantize(x, round_scale=True)
    assert torch.all(rounded >= exact)
    assert torch.all(torch.frexp(rounded).mantissa == 0.5)


@pytest.mark.parametrize("first_row", [0, 3])
def test_unpack_gives_back_what_pack_packed_as_views_of_the_rows(first_row):
    hidden = 3 * BLOCK  # 12 scale bytes a row, then zeros to the row's end
    x_fp8, scales = moe_comm.quantize(torch.randn(7, hidden, generator=torch.Generator().manual_seed(2)))
    packed = fp8.pack(x_fp8, scales)[first_row:]  # rows from the middle of an allocation too
    got_fp8, got_scales = fp8.unpack(packed, hidden)
    assert got_fp8.dtype == fp8.FP8_DTYPE and got_scales.dtype == torch.float32
    assert torch.equal(got_fp8.view(torch.uint8), x_fp8[first_row:].view(torch.uint8))
    assert torch.equal(got_scales, scales[first_row:])
    assert got_fp8.data_ptr() == packed.data_ptr() and got_scales.data_ptr() == packed.data_ptr() + hidden
    assert got_scales.stride() == (fp8.packed_row_bytes(hidden) // 4, 1)


@pytest.mark.parametrize("call, words", [
    (lambda: moe_comm.quantize(torch.zeros(2, 100)), ["quantize x", "multiple of 128", "100"]),
    (lambda: moe_comm.quantize(torch.zeros(2, BLOCK, dtype=torch.int32)), ["quantize x", "int32"]),
    (lambda: moe_comm.quantize(torch.zeros(BLOCK)), ["quantize x", "2-d", "(128,)"]),
    (lambda: moe_comm.dequantize(torch.zeros(2, BLOCK), torch.ones(2, 1)), ["x_fp8", "float8_e4m3fn", "float32"]),
    (lambda: moe_comm.dequantize(torch.zeros(2, BLOCK).to(torch.float8_e4m3fn), torch.ones(2, 2)),
     ["scales", "[2, 1]", "(2, 2)"]),
])
def test_bad_input_is_refused_by_name(call, words):
    with pytest.raises(InputError) as info:
        call()
    for word in words:
        assert word in str(info.value), str(info.value)
