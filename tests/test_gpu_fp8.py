"""FP8 on the GPU (contract: FP8 format). The reference quantizer gives the CPU's bytes (the CUDA
cast to e4m3 rounds as the CPU's does, so either device can be the yardstick), and FP8 dispatch on
every device backend gives the reference backend's rows, scales and layout bit for bit: a
pre-quantized pair eagerly (the kernels read it as it is; one off a 16-byte boundary is refused),
and bf16 rows quantized inside the call and a pair, captured in a CUDA graph and replayed with new
rows and routing."""

from __future__ import annotations

import pytest
import torch

import moe_comm
from capture import warm_up_on_side_stream
from tensor_views import off_boundary

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packing_kernels_give_the_reference_bytes_and_rows(dtype, requires_gpus):
    requires_gpus(1)
    from moe_comm import fp8
    from moe_comm.cuda.kernels import FP8_KERNELS_MIN_ARCH, Fp8PackKernels

    if torch.cuda.get_device_capability() < FP8_KERNELS_MIN_ARCH:
        pytest.skip("the packing kernels need compute capability 8.9 (FP8 dispatch packs with torch here)")
    gen = torch.Generator().manual_seed(4)
    tokens, hidden = 37, 1152  # an odd number of 128-channel blocks in all: the last warp is half idle
    x = (torch.randn(tokens, hidden, generator=gen) * torch.logspace(-8, 8, hidden)).to(dtype)
    x[3, 5], x[4, 700], x[5, 300] = float("nan"), float("inf"), -float("inf")
    x[6, 128:256] = 0
    x[7, :128] = 1e-30
    want = fp8.pack(*fp8.quantize(x))
    kernels = Fp8PackKernels(torch.device("cuda", 0), dtype, hidden)
    got = kernels.quantize_pack(x.cuda()).cpu()
    x_fp8, scales = fp8.unpack(want, hidden)
    nan_values, nan_scales = x_fp8.float().isnan(), scales.isnan()
    got_fp8, got_scales = fp8.unpack(got, hidden)
    assert torch.equal(got_fp8.float().isnan(), nan_values) and torch.equal(got_scales.isnan(), nan_scales)
    # Every byte but the NaNs' (a NaN's sign and payload may differ) is the reference's.
    finite_bytes = torch.cat([~nan_values, ~nan_scales.repeat_interleave(4, dim=1),
                              torch.ones(tokens, want.shape[1] - hidden - 4 * (hidden // 128), dtype=torch.bool)], 1)
    assert torch.equal(got[finite_bytes], want[finite_bytes])
    # Back to rows: float(e4m3) * scale rounded to the dtype, as the torch reference (NaN blocks aside).
    rows = kernels.dequantize_rows(fp8.unpack(want.cuda(), hidden)[0]).cpu()
    want_rows = fp8.dequantize(*fp8.unpack(want, hidden), dtype=dtype)
    assert torch.equal(rows.isnan(), want_rows.isnan())
    assert torch.equal(rows[~want_rows.isnan()], want_rows[~want_rows.isnan()])
    # Bounded by an int32 read on the device (a dispatch output's expert_offsets[-1:]): the rows below
    # it as before, the others never written. Torch's cache hands the call's output the block of the
    # same size just freed (nothing is allocated in between), filled with a sentinel here, so an
    # unwritten row keeps the sentinel.
    packed_x = fp8.unpack(want.cuda(), hidden)[0]
    for end in (0, 19, tokens, tokens + 5):
        bound = torch.tensor([end], dtype=torch.int32, device="cuda")
        sentinel = torch.full((tokens, hidden), 7.0, dtype=dtype, device="cuda")
        del sentinel
        bounded = kernels.dequantize_rows(packed_x, bound).cpu()
        kept = min(end, tokens)
        assert torch.equal(bounded[:kept].isnan(), want_rows[:kept].isnan()), end
        assert torch.equal(bounded[:kept][~want_rows[:kept].isnan()], want_rows[:kept][~want_rows[:kept].isnan()])
        assert torch.equal(bounded[kept:], torch.full((tokens - kept, hidden), 7.0, dtype=dtype)), end
    pairs = kernels.pack_pairs(*(t.cuda() for t in fp8.quantize(x.float().nan_to_num())))
    assert torch.equal(pairs.cpu(), fp8.pack(*fp8.quantize(x.float().nan_to_num())))


TOKENS, HIDDEN, EXPERTS, TOPK = 64, 512, 8, 2
FP8_CONFIG = dict(num_experts=EXPERTS, topk=TOPK, hidden=HIDDEN, max_tokens_per_rank=TOKENS, expert_alignment=16,
                  dtype="bfloat16", dispatch_dtype="float8_e4m3fn")


def _fp8_inputs(gen: torch.Generator, hidden: int = HIDDEN, tokens: int = TOKENS):
    x = (torch.randn(tokens, hidden, generator=gen) * torch.logspace(-3, 3, hidden)).to(torch.bfloat16)
    idx = torch.randint(0, EXPERTS, (tokens, TOPK), generator=gen)
    idx[torch.rand(tokens, TOPK, generator=gen) < 0.2] = -1
    return x, idx, torch.rand(tokens, TOPK, generator=gen)


def _same_output(out, ref) -> bool:
    end = int(ref.expert_offsets[-1])
    return (torch.equal(out.expert_offsets.cpu(), ref.expert_offsets)
            and torch.equal(out.x[:end].cpu().view(torch.uint8), ref.x[:end].view(torch.uint8))
            and torch.equal(out.x_scales[:end].cpu(), ref.x_scales[:end]))


def _fp8_dispatch_checks(config: moe_comm.Config, shape: dict, gloo, gen: torch.Generator) -> list:
    """FP8 dispatch of one config (a device backend's, built from ``shape``) against the reference: a
    pre-quantized pair eagerly (read by the kernels as it is), and refused with its e4m3 rows off a
    16-byte boundary (an error, not a fault); then bf16 rows quantized inside the call and a
    pre-quantized pair, both captured once and replayed with new rows and routing (8 results)."""
    hidden, tokens = config.hidden, config.max_tokens_per_rank
    ref_shape = {key: value for key, value in shape.items() if key not in ("num_senders", "sm_budget")}
    results = []
    with moe_comm.Dispatcher(config) as dev, \
            moe_comm.Dispatcher(moe_comm.load_config(None, backend="reference", **ref_shape), group=gloo) as ref:
        device = dev.device
        x, idx, weights = _fp8_inputs(gen, hidden, tokens)
        pair = tuple(t.to(device) for t in moe_comm.quantize(x))
        want = ref.dispatch(x, idx, weights)
        results.append(_same_output(dev.dispatch(pair, idx.to(device), weights.to(device)), want))
        try:
            dev.dispatch((off_boundary(pair[0]), pair[1]), idx.to(device), weights.to(device))
            results.append("no error")
        except moe_comm.InputError as exc:
            results.append(str(exc).startswith("x_fp8: expected a tensor whose data starts on a 16-byte boundary"))
        static = [t.to(device) for t in (x, idx, weights)]
        static_pair = [t.clone() for t in pair]
        out = dev.dispatch(*static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dev.dispatch(*static)
            out_pair = dev.dispatch(tuple(static_pair), *static[1:])
        for _ in range(3):
            x, idx, weights = _fp8_inputs(gen, hidden, tokens)
            for target, value in zip(static + static_pair, (x, idx, weights) + moe_comm.quantize(x)):
                target.copy_(value)
            graph.replay()
            torch.cuda.synchronize(device)
            want = ref.dispatch(x, idx, weights)
            results += [_same_output(out, want), _same_output(out_pair, want)]
        dev.check()
    return results


def _fp8_dispatch_configs(backend_id: str, shapes: list) -> list:
    """The device config of each of ``shapes`` (overrides of FP8_CONFIG) on ``backend_id``."""
    from gpu_backends import GPU_BACKENDS

    backend, section = GPU_BACKENDS[backend_id]
    return [moe_comm.load_config(None, backend=backend, **section, **{**FP8_CONFIG, **shape}) for shape in shapes]


def _rank_fp8_dispatch(rank: int, world: int, backend_id: str, shapes: list) -> dict:
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    configs = _fp8_dispatch_configs(backend_id, shapes)
    gen = torch.Generator().manual_seed(rank)
    return {str(shape): _fp8_dispatch_checks(config, {**FP8_CONFIG, **shape}, gloo, gen)
            for shape, config in zip(shapes, configs)}


# Device kernels quantize config-dtype rows themselves: their senders unit by unit (world 2), and
# the blocks that neither send nor lay out pack the own rows of the first
# protocol.FP8_PACK_OWN_MAX_TOKENS (1024) tokens (a budget of senders leaves some), and the own
# expansion quantizes those of the tokens past it (2100 tokens: both).
# 1152 channels: 9 blocks, so the packed row ends in 28 zero bytes and a unit's last lanes idle.
# The other backends at world 1 (one GPU) and world 2 (their peers' rows cross GPUs, over
# NVSHMEM's puts too). Shapes of one backend and world share one spawn of ranks.
@pytest.mark.parametrize("backend_id, world, shapes", [
    ("vmm", 1, [{}, {"hidden": 1152}, {"max_tokens_per_rank": 2100}, {"hidden": 1152, "max_tokens_per_rank": 2100}]),
    ("vmm", 2, [{}, {"hidden": 1152, "num_senders": 2}, {"sm_budget": 4}]),
    ("nvshmem-p2p", 1, [{}]), ("nccl-symmetric", 1, [{}]), ("nccl-collective", 1, [{}]),
    ("nvshmem-p2p", 2, [{}]), ("nccl-symmetric", 2, [{}]), ("nccl-collective", 2, [{}]),
    ("nvshmem-put", 2, [{}, {"hidden": 1152, "num_senders": 2}, {"sm_budget": 4}]),
])
@pytest.mark.kernels.with_args(_fp8_dispatch_configs)
def test_fp8_dispatch_equals_reference_bitwise(backend_id, world, shapes, requires_gpus):
    from gpu_backends import dist_backend_for, gpus_needed
    from multirank import run_ranks

    gpus = requires_gpus(gpus_needed(backend_id, world))
    per_rank = run_ranks(_rank_fp8_dispatch, world, backend_id, shapes, reuse=backend_id,
                         dist_backend=dist_backend_for(world, gpus), gpu=True, timeout_s=300)
    for rank, by_shape in enumerate(per_rank):
        for shape, same in by_shape.items():
            assert same == [True] * 8, f"rank {rank}, shape {shape}: an eager pair, a refusal, 3 replays of 2: {same}"


def _training_configs(backend_id: str) -> list:
    """FP8_CONFIG on ``backend_id``, and the same dispatching rows of its dtype."""
    return _fp8_dispatch_configs(backend_id, [{}, {"dispatch_dtype": None}])


def _rank_fp8_training(rank: int, world: int, backend_id: str) -> dict:
    from layer_checks import paired_layer_errors

    fp8_config, plain_config = _training_configs(backend_id)
    gen = torch.Generator().manual_seed(30 + rank)
    results = {}
    with moe_comm.Dispatcher(fp8_config) as disp, moe_comm.Dispatcher(plain_config) as plain:
        device = disp.device
        x, idx, weights = (t.to(device) for t in _fp8_inputs(gen))
        upstream = torch.randn(disp.capacity_rows, HIDDEN, generator=gen).to(device, torch.bfloat16)

        # Straight through: the dequantized rows' backward is the plain dispatch's, eagerly and captured.
        def input_grad(dispatcher: moe_comm.Dispatcher, leaf: torch.Tensor) -> torch.Tensor:
            leaf.grad = None
            rows = dispatcher.dequantize(dispatcher.dispatch(leaf, idx, weights))
            (rows.float() * upstream.float()).sum().backward()
            return leaf.grad

        want = input_grad(plain, x.clone().requires_grad_()).clone()
        results["eager_grad"] = torch.equal(input_grad(disp, x.clone().requires_grad_()), want)
        # A leaf of its own: one whose gradient was accumulated on the default stream cannot be captured.
        leaf = x.clone().requires_grad_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = input_grad(disp, leaf)
        leaf.data.copy_(x * 2)  # a new batch; the straight-through gradient does not depend on x
        graph.replay()
        torch.cuda.synchronize(device)
        results["graph_grad"] = torch.equal(captured, want)

        # The layer against the same layer dispatching bf16 rows: output and every gradient.
        x = torch.randn(TOKENS, HIDDEN, generator=gen).to(device, torch.bfloat16)
        layers = [moe_comm.MoELayer(d.config, 256, dispatcher=d, seed=5) for d in (disp, plain)]
        results["errors"] = paired_layer_errors(*layers, x)

        for layer in layers:
            layer.close()

        # A captured FP8 training step (forward, loss, backward; Adam outside), replayed: the loss falls.
        # A new layer: the first one's parameters gathered gradients on the default stream.
        layer = moe_comm.MoELayer(disp.config, 256, dispatcher=disp, seed=6)
        optimizer = torch.optim.Adam(layer.parameters(), lr=3e-3)
        target = torch.randn(TOKENS, HIDDEN, generator=gen).to(device, torch.bfloat16)
        static_x = x.clone()

        def step() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=False)
            loss = (layer(static_x).float() - target.float()).square().mean()
            loss.backward()
            return loss

        warm_up_on_side_stream(lambda: [step() for _ in range(2)], device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = step()
        losses = []
        for _ in range(20):
            graph.replay()
            losses.append(loss.item())
            optimizer.step()
        results["losses"] = losses
        disp.check()
        plain.check()
        layer.close()
    return results


# World 2 (time-sliced on one GPU): the gradients cross ranks; the bitwise test above covers world 1.
@pytest.mark.parametrize("backend_id, world", [("vmm", 2)])
@pytest.mark.kernels.with_args(_training_configs)
def test_fp8_layer_trains_on_gpu(backend_id, world, requires_gpus):
    from gpu_backends import dist_backend_for, gpus_needed
    from multirank import run_ranks

    gpus = requires_gpus(gpus_needed(backend_id, world))
    per_rank = run_ranks(_rank_fp8_training, world, backend_id, reuse=backend_id,
                         dist_backend=dist_backend_for(world, gpus), gpu=True, timeout_s=300)
    for rank, result in enumerate(per_rank):
        tag = f"rank {rank}: {result}"
        assert result["eager_grad"] and result["graph_grad"], tag
        # e4m3's 3 mantissa bits: a few percent of each norm (1.6-5.3% in benchmarks/bench_fp8_layer.py).
        assert all(0 < error < 0.08 for error in result["errors"].values()), tag
        losses = result["losses"]
        assert losses[-1] < 0.9 * losses[0], tag
