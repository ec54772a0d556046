"""FP8 dispatch on 2 gloo ranks of the reference backend (contract: FP8 format, dispatch).

With ``dispatch_dtype: float8_e4m3fn`` every row arrives as the bytes and scales the FP8 format
specifies (the tests' own quantizer, ``fp8_model``), laid out as the config-dtype dispatch lays
out the same rows; a pre-quantized ``(x_fp8, x_scales)`` pair gives the same output as the tensor
it came from; the padding rows are zero; combine works on it; the dequantized rows differentiate
straight through the quantization (the backward a config-dtype dispatch has); MoELayer trains on
it; malformed inputs are refused by name.
"""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import fp8
from moe_comm.backends.base import Backend
import fp8_model
from layer_checks import paired_layer_errors
from multirank import run_ranks
from tensor_views import off_boundary

WORLD = 2
BASE = dict(backend="reference", num_experts=8, topk=2, hidden=256, max_tokens_per_rank=12, expert_alignment=4)


def _inputs(rank: int, tokens: int = 12):
    gen = torch.Generator().manual_seed(10 + rank)
    x = (torch.randn(tokens, BASE["hidden"], generator=gen) * 3).to(torch.bfloat16)
    idx = torch.randint(0, BASE["num_experts"], (tokens, BASE["topk"]), generator=gen)
    idx[0, 1] = -1
    return x, idx, torch.rand(tokens, BASE["topk"], generator=gen)


def _rank_fp8(rank: int, world: int) -> dict:
    x, idx, weights = _inputs(rank)
    results = {}
    for round_scale in (False, True):
        cfg = moe_comm.load_config(None, **BASE, dispatch_dtype="float8_e4m3fn", dispatch_round_scale=round_scale)
        plain = moe_comm.load_config(None, **BASE)
        x_fp8, x_scales = moe_comm.quantize(x, round_scale=round_scale)
        with moe_comm.Dispatcher(cfg) as disp, moe_comm.Dispatcher(plain) as reference:
            out = disp.dispatch(x, idx, weights)
            pair = disp.dispatch((x_fp8, x_scales), idx, weights)
            # The same rows in the config dtype: their placement is the FP8 output's.
            want = reference.dispatch(x, idx, weights)
            recv_pos = want.handle.routing.recv_pos
            y = want.x * 2
            z_fp8, z_plain = disp.combine(y, out.handle), reference.combine(y, want.handle)
            disp_rows, plain_rows = disp.dequantize(out), reference.dequantize(want)
        rows = torch.full((want.x.shape[0],), -1, dtype=torch.int64)
        # Which source row each output row holds (slab row s * M + t: every rank sends M tokens here),
        # and every rank's rows as the test's own quantizer makes them, to compare with.
        codes, scales = fp8_model.quantize(x, round_scale)
        all_fp8 = [torch.empty_like(codes) for _ in range(world)]
        all_scales = [torch.empty_like(scales) for _ in range(world)]
        torch.distributed.all_gather(all_fp8, codes)
        torch.distributed.all_gather(all_scales, scales)
        source_rows = torch.cat(all_fp8)
        source_scales = torch.cat(all_scales)
        kept = recv_pos >= 0
        slab_row = torch.arange(world * BASE["max_tokens_per_rank"])[:, None].expand(-1, BASE["topk"])
        slab_row = slab_row.reshape(world, BASE["max_tokens_per_rank"], BASE["topk"])
        rows[recv_pos[kept].long()] = slab_row[kept]
        placed = rows >= 0
        got_bytes, got_scales = out.x.view(torch.uint8), out.x_scales
        end = int(want.expert_offsets[-1])
        padding = ~placed[:end]
        results[round_scale] = {
            "dtypes": (out.x.dtype, out.x_scales.dtype, tuple(out.x.shape), tuple(out.x_scales.shape)),
            "layout": torch.equal(out.expert_offsets, want.expert_offsets)
            and torch.equal(out.tokens_per_expert, want.tokens_per_expert),
            "rows": torch.equal(got_bytes[placed], source_rows[rows[placed]]),
            "scales": torch.equal(got_scales[placed], source_scales[rows[placed]]),
            "padding_zero": bool((got_bytes[:end][padding] == 0).all() and (got_scales[:end][padding] == 0).all()),
            "pair": torch.equal(pair.x.view(torch.uint8)[:end], got_bytes[:end])
            and torch.equal(pair.x_scales[:end], got_scales[:end]),
            "combine": torch.equal(z_fp8, z_plain),
            "plain_x_scales": want.x_scales is None,
            "dequantize": torch.equal(disp_rows, fp8_model.dequantize(got_bytes, got_scales, torch.bfloat16))
            and plain_rows is want.x,
        }
    return results


def test_fp8_dispatch_moves_the_quantizer_bytes_in_the_config_layout():
    for rank, per_scale in enumerate(run_ranks(_rank_fp8, WORLD, timeout_s=120)):
        for round_scale, result in per_scale.items():
            tag = f"rank {rank}, round_scale {round_scale}: {result}"
            assert result["dtypes"][:2] == (torch.float8_e4m3fn, torch.float32), tag
            assert result["dtypes"][2][1] == BASE["hidden"] and result["dtypes"][3][1] == BASE["hidden"] // 128, tag
            assert all(result[key] for key in ("layout", "rows", "scales", "padding_zero", "pair", "combine",
                                               "plain_x_scales", "dequantize")), tag


def _rank_straight_through(rank: int, world: int) -> dict:
    x, idx, weights = _inputs(rank)
    gen = torch.Generator().manual_seed(20 + rank)
    results = {}
    with moe_comm.Dispatcher(moe_comm.load_config(None, **BASE, dispatch_dtype="float8_e4m3fn")) as disp, \
            moe_comm.Dispatcher(moe_comm.load_config(None, **BASE)) as plain:
        upstream = torch.randn(disp.capacity_rows, BASE["hidden"], generator=gen).to(torch.bfloat16)
        grads = []
        for dispatcher in (disp, plain):
            leaf = x.clone().requires_grad_()
            out = dispatcher.dispatch(leaf, idx, weights)
            rows = dispatcher.dequantize(out)
            (rows.float() * upstream.float()).sum().backward()
            grads.append(leaf.grad)
            if dispatcher is disp:
                results["quantized_from_kept"] = out.quantized_from is leaf and out.x.grad_fn is None
                results["rows_track_grad"] = rows.requires_grad
                with torch.no_grad():
                    results["no_grad_rows_plain"] = not disp.dequantize(out).requires_grad
        # Both backward passes are the same unweighted combine of the same upstream rows.
        results["grad_equal"] = torch.equal(grads[0], grads[1])
        results["grad_nonzero"] = bool(grads[0].abs().sum() > 0)
        pair = disp.dispatch(moe_comm.quantize(x), idx, weights)
        results["pair_not_differentiable"] = pair.quantized_from is None
        with torch.no_grad():
            results["no_grad_not_differentiable"] = disp.dispatch(x.clone().requires_grad_(), idx, weights).quantized_from is None
    return results


def test_fp8_dequantized_rows_differentiate_straight_through():
    for rank, result in enumerate(run_ranks(_rank_straight_through, WORLD, timeout_s=120)):
        assert all(result.values()), f"rank {rank}: {result}"


def _rank_layer_and_refusals(rank: int, world: int) -> dict:
    x, idx, weights = _inputs(rank)
    cfg = moe_comm.load_config(None, **BASE, dispatch_dtype="float8_e4m3fn")
    results = {}
    with moe_comm.Dispatcher(cfg) as disp:
        layer = moe_comm.MoELayer(cfg, 64, dispatcher=disp, seed=3)
        bf16 = moe_comm.MoELayer(moe_comm.load_config(None, **BASE), 64, seed=3)
        results["errors"] = paired_layer_errors(layer, bf16, x)
        bf16.close()
        pair = moe_comm.quantize(x)
        for name, call in (
            ("pair_shape", lambda: disp.dispatch((pair[0], torch.ones(12, 3)), idx, weights)),
            ("pair_dtype", lambda: disp.dispatch((x, torch.ones(12, 2)), idx, weights)),
            ("triple", lambda: disp.dispatch((x, x, x), idx, weights)),
            ("pair_unaligned", lambda: disp.dispatch((off_boundary(pair[0]), pair[1]), idx, weights)),
        ):
            try:
                call()
                results[name] = "no error"
            except moe_comm.InputError as exc:
                results[name] = str(exc)
    with moe_comm.Dispatcher(moe_comm.load_config(None, **BASE)) as plain:
        try:
            plain.dispatch(moe_comm.quantize(x), idx, weights)
            results["pair_without_fp8"] = "no error"
        except moe_comm.InputError as exc:
            results["pair_without_fp8"] = str(exc)
    return results


def test_fp8_layer_trains_close_to_bf16_and_malformed_pairs_are_refused():
    for rank, result in enumerate(run_ranks(_rank_layer_and_refusals, WORLD, timeout_s=120)):
        # e4m3 keeps 3 mantissa bits (a relative rounding error of at most 1/16 per value): the
        # layer's output and gradients move by a few percent of their norm (3.6-5.3% here).
        assert all(0 < error < 0.08 for error in result["errors"].values()), result
        assert "x_scales" in result["pair_shape"] and "(12, 3)" in result["pair_shape"], result
        assert "x_fp8" in result["pair_dtype"] and "float8_e4m3fn" in result["pair_dtype"], result
        assert "tuple of 3" in result["triple"], result
        unaligned = "x_fp8: expected a tensor whose data starts on a 16-byte boundary"
        assert result["pair_unaligned"].startswith(unaligned), result
        assert "dispatch_dtype" in result["pair_without_fp8"], result


def test_fp8_config_needs_hidden_in_blocks_of_128():
    with pytest.raises(moe_comm.ConfigError, match="'hidden': got 192, expected a multiple of 128"):
        moe_comm.load_config(None, **{**BASE, "hidden": 192}, dispatch_dtype="float8_e4m3fn")
    with pytest.raises(moe_comm.ConfigError, match="'dispatch_dtype'"):
        moe_comm.load_config(None, dispatch_dtype="float8_e5m2")
    assert fp8.packed_row_bytes(7168) == 7168 + 224 + 32 and fp8.packed_row_bytes(2048) == 2048 + 64
    assert fp8.packed_row_bytes(128) == 192


class _RecordingBackend:
    """Stands in for a backend: its FP8 dispatch is Backend's; its dispatch records what that hands it."""

    dispatch_fp8 = Backend.dispatch_fp8

    def __init__(self, config, fp8_codec, quantizes_fp8: bool):
        self.config = config
        self.fp8_codec = fp8_codec
        self.quantizes_fp8 = quantizes_fp8
        self.calls = []

    def dispatch(self, x, topk_idx, topk_weights, *, separate_outputs=False, quantize=False, x_scales=None):
        self.calls.append({"x": x, "separate_outputs": separate_outputs, "quantize": quantize, "x_scales": x_scales})
        return len(self.calls)


class _PackingKernels:
    """Stands in for the GPU packing kernels (Fp8PackKernels) with the torch reference they equal."""

    def quantize_pack(self, x):
        return fp8.pack(*fp8.quantize(x))

    def pack_pairs(self, x_fp8, scales):
        return fp8.pack(x_fp8, scales)


def test_fp8_dispatch_lets_quantizing_kernels_build_rows_and_packs_for_everything_else():
    from moe_comm.backends.fp8_codec import Fp8Codec

    x, idx, weights = _inputs(0)
    packed = fp8.pack(*fp8.quantize(x))
    pair = fp8.quantize(x)
    for round_scale in (False, True):
        cfg = moe_comm.load_config(None, **BASE, dispatch_dtype="float8_e4m3fn", dispatch_round_scale=round_scale)
        want_packed = fp8.pack(*fp8.quantize(x, round_scale=round_scale))
        for kernels in (None, _PackingKernels()):  # a CPU (no e4m3 kernels), an sm_89+ GPU
            codec = Fp8Codec(cfg, torch.device("cpu"))
            codec._kernels = kernels
            for quantizing in (False, True):
                backend = _RecordingBackend(cfg, codec, quantizing)
                backend.dispatch_fp8(x, None, idx, weights, separate_outputs=True)
                backend.dispatch_fp8(*pair, idx, weights)
                rows, given_pair = backend.calls
                in_kernel = quantizing and kernels is not None and not round_scale
                assert rows["quantize"] is in_kernel and rows["separate_outputs"] is True
                assert rows["x_scales"] is None
                if in_kernel:
                    assert rows["x"] is x
                else:
                    assert torch.equal(rows["x"], want_packed)
                # A pre-quantized pair goes to kernels that build FP8 rows as it is (its scales are
                # its own: rounding does not apply), else it is packed as it is.
                if quantizing and kernels is not None:
                    assert given_pair["quantize"] is True
                    assert given_pair["x"] is pair[0] and given_pair["x_scales"] is pair[1]
                else:
                    assert given_pair["quantize"] is False and torch.equal(given_pair["x"], packed)


def _rank_collective_quantize(rank: int, world: int) -> str:
    cfg = moe_comm.load_config(None, **BASE, dispatch_dtype="float8_e4m3fn")
    x, idx, weights = _inputs(rank)
    with moe_comm.Dispatcher(cfg) as disp:
        try:
            disp._backend.dispatch(x, idx, weights, quantize=True)
        except moe_comm.BackendError as exc:
            return str(exc)
    return "no error"


def test_collective_backends_refuse_to_quantize_rows_themselves():
    for message in run_ranks(_rank_collective_quantize, 1, timeout_s=60):
        assert "reference backend" in message and "moe_comm.fp8.pack" in message, message
