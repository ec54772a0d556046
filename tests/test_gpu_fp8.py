"""The FP8 reference quantizer on a GPU gives the CPU's bytes (contract: FP8 format): the CUDA
cast to e4m3 rounds as the CPU's does, so either device can be the yardstick."""

from __future__ import annotations

import pytest
import torch

import moe_comm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("round_scale", [False, True])
def test_quantize_on_gpu_equals_cpu_bitwise(round_scale, requires_gpus):
    requires_gpus(1)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 1024, generator=gen) * torch.logspace(-6, 6, 1024)).to(torch.bfloat16)
    x[5, 7] = float("nan")
    x[9, 300] = float("inf")
    x[11, :128] = 0
    want = moe_comm.quantize(x, round_scale=round_scale)
    got = moe_comm.quantize(x.cuda(), round_scale=round_scale)
    nan = want[0].float().isnan()  # the blocks of the NaN and the inf (a NaN's sign bit may differ)
    assert torch.equal(got[0].cpu().float().isnan(), nan)
    assert torch.equal(got[0].cpu().view(torch.uint8)[~nan], want[0].view(torch.uint8)[~nan])
    assert torch.allclose(got[1].cpu(), want[1], rtol=0, atol=0, equal_nan=True)  # NaN scales of the bad blocks
    back = moe_comm.dequantize(*got)
    assert torch.equal(back.cpu().isnan(), moe_comm.dequantize(*want).isnan())
