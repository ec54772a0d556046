"""The kernel launchers pass what the CUDA signatures declare (CPU: fake launches, source text).

A parameter in the wrong place or of the wrong size is read as garbage by the kernel, so every
launcher of ``moe_comm.cuda.kernels`` is run against a recording fake and its parameter list is
compared, in order, with the ``extern "C"`` signature in ``csrc``: pointer or integer,
and size. (Two parameters of the same kind and size in each other's places are beyond this
check; the GPU suite compares every result with the reference.)
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from moe_comm import protocol
from moe_comm.cuda import driver, kernels
from moe_comm.cuda.kernel_params import KernelParams, kernel_params
from moe_comm.assets import asset_dir
from requirements import missing

WORLD, MAX_TOKENS, TOPK, HIDDEN, EXPERTS = 2, 8, 3, 64, 8
_POINTER, _INTEGER = "pointer", "integer"
_CTYPE_KINDS = {
    ctypes.c_void_p: (_POINTER, 8), ctypes.c_longlong: (_INTEGER, 8), ctypes.c_ulonglong: (_INTEGER, 8),
    ctypes.c_int: (_INTEGER, 4), ctypes.c_uint: (_INTEGER, 4),
}
_CUDA_INTEGER_SIZES = {"int": 4, "i32": 4, "u32": 4, "i64": 8, "u64": 8}


def _parameters(source: str, entry: str) -> list[str]:
    """The declarations of the parameters of ``extern "C"`` kernel ``entry`` in ``source`` (a list
    given as one macro, as the dispatch kernels share theirs, is the macro's body)."""
    match = re.search(r'extern "C" __global__ void (?:__launch_bounds__\([\w, ]+\) )?' + entry + r"\(([^)]*)\)", source)
    assert match, f"no extern \"C\" kernel {entry}"
    declared = match.group(1).strip()
    macro = re.search(r"#define " + re.escape(declared) + r"\b((?:[^\n]*\\\n)*[^\n]*)", source)
    if macro:
        declared = macro.group(1).replace("\\\n", " ")
    return declared.split(",")


def _signature(source: str, entry: str) -> list[tuple[str, int]]:
    """(kind, bytes) of every parameter of ``extern "C"`` kernel ``entry`` in ``source``."""
    kinds = []
    for parameter in _parameters(source, entry):
        words = parameter.replace("*", " * ").split()
        if "*" in words:
            kinds.append((_POINTER, 8))
        else:
            kinds.append((_INTEGER, _CUDA_INTEGER_SIZES[words[0]]))
    return kinds


def _parameter_index(name: str, entry: str, parameter: str) -> int:
    """Position of ``parameter`` among the parameters of kernel ``entry`` of ``csrc/<name>.cu``."""
    source = asset_dir("csrc").joinpath(f"{name}.cu").read_text()
    return [p.replace("*", " ").split()[-1] for p in _parameters(source, entry)].index(parameter)


class _Recorder:
    """Stands in for a loaded kernel: records the parameter types of every launch."""

    def __init__(self, name: str, entry: str):
        self.name, self.entry, self.launches, self.grids, self.values, self.shared = name, entry, [], [], [], []

    def launch(self, grid, block, args, shared_bytes=0, stream=None):
        params = args if isinstance(args, KernelParams) else kernel_params(args)
        self.launches.append([_CTYPE_KINDS[t] for t in params.types])
        self.grids.append(grid)
        self.shared.append(shared_bytes)
        self.values.append(params.values())


def _launch_every_kernel(monkeypatch, num_senders: int, grid_sms: int, tokens: int, world: int = WORLD,
                         zero_padding: bool = True) -> dict:
    """Launch each kernel once through recording stand-ins (as rank 0 of ``world``); returns (file, entry) ->
    recorder."""
    recorders = {}

    def load(device, name, entry, defines={}, **_):
        return recorders.setdefault((name, entry), _Recorder(name, entry))

    monkeypatch.setattr(driver, "load_function", load)
    cpu = torch.device("cpu")
    defines = kernels.kernel_defines(torch.bfloat16, HIDDEN, TOPK)
    args = kernels.CommArgs(peers_ptr=0x1000, rank=0, world_size=world, max_tokens_per_rank=MAX_TOKENS, state_ptr=0x2000,
                            status_ptr=0x3000, timeout_ns=10**9)
    layout = protocol.SymmetricRegions.plan(world, MAX_TOKENS, TOPK, HIDDEN * 2)
    local = EXPERTS // world
    capacity_rows = 64
    dispatch = kernels.DispatchKernels(cpu, defines, args, layout, num_experts=EXPERTS, num_local_experts=local,
                                       expert_alignment=4, expert_capacity=None, zero_padding=zero_padding,
                                       capacity_rows=capacity_rows,
                                       num_senders=num_senders, grid_sms=grid_sms)
    combine = kernels.CombineKernels(cpu, defines, args, layout, capacity_rows=capacity_rows, num_senders=num_senders,
                                     grid_sms=grid_sms)

    x = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)
    idx = torch.zeros(tokens, TOPK, dtype=torch.int64)
    weights = torch.zeros(tokens, TOPK)
    send_mask = torch.zeros(tokens, world, dtype=torch.bool)
    dest_rank = torch.zeros(tokens, TOPK, dtype=torch.int32)
    recv_pos = torch.zeros(world, MAX_TOKENS, TOPK, dtype=torch.int32)
    recv_weight = torch.zeros(world, MAX_TOKENS, TOPK)
    counts = torch.zeros(local, dtype=torch.int32)
    rows = torch.zeros(capacity_rows, HIDDEN, dtype=torch.bfloat16)
    routing = kernels.RoutingAddresses(send_mask.data_ptr(), dest_rank.data_ptr(), recv_pos.data_ptr(),
                                       recv_weight.data_ptr())
    dispatch.dispatch(x, idx, weights, routing, counts, counts, rows)
    dispatch.redispatch(x, routing, rows)
    combine.combine(rows, routing, True, x)
    combine.values_send(torch.zeros(capacity_rows), routing)
    combine.values_recv(routing, weights)
    return recorders


@pytest.mark.parametrize("world, suffix", [(WORLD, ""), (1, "_one_rank")])
def test_launchers_pass_the_parameters_the_kernels_declare(monkeypatch, world, suffix):
    # One rank runs dispatch and combine kernels of its own (nothing to send or wait for).
    recorders = _launch_every_kernel(monkeypatch, num_senders=4, grid_sms=8, tokens=5, world=world)
    sources = {name: asset_dir("csrc").joinpath(f"{name}.cu").read_text()
               for name in ("dispatch", "combine")}
    launched = {key: recorder.launches for key, recorder in recorders.items() if recorder.launches}
    assert sorted(launched) == [("combine", "combine" + suffix), ("combine", "values_recv"), ("combine", "values_send"),
                                ("dispatch", "dispatch" + suffix), ("dispatch", "redispatch")]
    for (name, entry), launches in launched.items():
        assert launches == [_signature(sources[name], entry)], f"{name}.{entry}: launch parameters differ from csrc"


@pytest.mark.parametrize("zero_padding", [True, False])
def test_dispatch_gets_the_configs_zero_padding(monkeypatch, zero_padding):
    recorders = _launch_every_kernel(monkeypatch, num_senders=4, grid_sms=8, tokens=5, zero_padding=zero_padding)
    values = recorders[("dispatch", "dispatch")].values[0]
    assert values[_parameter_index("dispatch", "dispatch", "zero_pad")] == int(zero_padding)


def test_sm_budget_bounds_every_grid(monkeypatch):
    # sm_budget (grid_sms) bounds every kernel's grid, the senders within it too (num_senders larger
    # than the budget, and enough tokens to want every sender), so the other SMs stay free.
    recorders = _launch_every_kernel(monkeypatch, num_senders=24, grid_sms=3, tokens=MAX_TOKENS)
    grids = {key: recorder.grids for key, recorder in recorders.items() if recorder.grids}
    assert len(grids) == 5 and all(grid <= 3 for launches in grids.values() for grid in launches), grids
    assert grids[("dispatch", "dispatch")] == [3] and grids[("combine", "combine")] == [3]
    senders = recorders[("dispatch", "dispatch")].values[0][_parameter_index("dispatch", "dispatch", "num_senders")]
    assert 1 <= senders <= 3


def test_world_one_dispatch_holds_no_block_back_to_send(monkeypatch):
    # At world 1 no row leaves the rank: dispatch gets no senders (every block lays out and
    # expands); redispatch gets one block, which sends nothing and signals the arrival its
    # expansion waits for. With several ranks both send.
    def senders(world, entry):
        recorders = _launch_every_kernel(monkeypatch, num_senders=4, grid_sms=8, tokens=MAX_TOKENS, world=world)
        return recorders[("dispatch", entry)].values[0][_parameter_index("dispatch", entry, "num_senders")]

    assert senders(1, "dispatch_one_rank") == 0 and senders(1, "redispatch") == 1
    assert senders(WORLD, "dispatch") >= 1 and senders(WORLD, "redispatch") >= 1


def test_one_rank_kernels_get_their_grid_and_shared_memory(monkeypatch):
    # combine_one_rank has no phase that waits for other blocks: it runs on the blocks its units
    # (one warp per token and COMBINE_SEND_VPL vectors a lane) fill, at most the grid; several ranks'
    # combine on the whole grid. dispatch_one_rank's blocks keep their own copy of the layout's
    # positions at decode sizes: LAYOUT_ROWS_PER_BLOCK x K int32 more shared memory.
    lanes = 32 * protocol.COMBINE_SEND_VPL
    units_per_row = -(-HIDDEN * 2 // 16 // lanes)
    warps = protocol.COMBINE_THREADS // 32
    for tokens, grid in ((1, 1), (40, -(-40 * units_per_row // warps)), (1000, 8)):
        recorders = _launch_every_kernel(monkeypatch, num_senders=4, grid_sms=8, tokens=tokens, world=1)
        assert recorders[("combine", "combine_one_rank")].grids == [grid], tokens
    assert _launch_every_kernel(monkeypatch, num_senders=4, grid_sms=8, tokens=1)[("combine", "combine")].grids == [8]

    counters = (2 * (protocol.DISPATCH_THREADS // 32) + 3) * 4  # 32-bit words per local expert
    one = _launch_every_kernel(monkeypatch, num_senders=4, grid_sms=8, tokens=5, world=1)[("dispatch", "dispatch_one_rank")]
    several = _launch_every_kernel(monkeypatch, num_senders=4, grid_sms=8, tokens=5)[("dispatch", "dispatch")]
    assert several.shared == [counters * (EXPERTS // WORLD)]
    assert one.shared == [counters * EXPERTS + protocol.LAYOUT_ROWS_PER_BLOCK * TOPK * 4]


def test_fp8_launchers_pass_the_parameters_fp8_cu_declares(monkeypatch):
    from types import SimpleNamespace

    from moe_comm import fp8

    recorders = {}
    monkeypatch.setattr(driver, "load_function", lambda device, name, entry, defines={}, **_:
                        recorders.setdefault((name, entry), _Recorder(name, entry)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=4))
    launchers = kernels.Fp8PackKernels(torch.device("cpu"), torch.bfloat16, 256)
    packed = launchers.quantize_pack(torch.zeros(3, 256, dtype=torch.bfloat16))
    launchers.quantize_pack(torch.zeros(5, 256, dtype=torch.bfloat16))
    pairs = (torch.zeros(3, 256, dtype=torch.float8_e4m3fn), torch.zeros(3, 2))
    launchers.pack_pairs(*pairs)
    launchers.dequantize_rows(fp8.unpack(packed, 256)[0])
    source = asset_dir("csrc").joinpath("fp8.cu").read_text()
    for entry, calls in (("quantize_pack", 2), ("pack_pairs", 1), ("dequantize_rows", 1)):
        assert recorders[("fp8", entry)].launches == [_signature(source, entry)] * calls, entry
    # The prepared parameters are refilled per launch: the row counts of both calls.
    assert [values[1] for values in recorders[("fp8", "quantize_pack")].values] == [3, 5]
    assert recorders[("fp8", "pack_pairs")].values[0][:3] == [pairs[0].data_ptr(), pairs[1].data_ptr(), 3]


def test_device_builds_list_what_a_device_backend_loads():
    """Dispatch and combine, then FP8 dispatch's build and, from sm_89, csrc/fp8.cu (always without
    NVSHMEM's headers: the FP8 codec loads it with the plain toolchain)."""
    from moe_comm.cuda import jit

    plain = kernels.device_builds(torch.bfloat16, 512, 2, arch="sm_90", put_transport=False, fp8_dispatch=False)
    defines = kernels.kernel_defines(torch.bfloat16, 512, 2)
    assert plain == [("dispatch", defines, jit.Toolchain()), ("combine", defines, jit.Toolchain())]
    with_fp8 = kernels.device_builds(torch.bfloat16, 512, 2, arch="sm_90", put_transport=False, fp8_dispatch=True)
    assert with_fp8[:2] == plain
    assert with_fp8[2:] == [("dispatch", kernels.fp8_dispatch_defines(torch.bfloat16, 512, 2), jit.Toolchain()),
                            ("fp8", kernels.fp8_defines(torch.bfloat16, 512), jit.Toolchain())]
    # csrc/fp8.cu converts with sm_89 instructions: an A100 packs with the torch reference instead.
    on_a100 = kernels.device_builds(torch.bfloat16, 512, 2, arch="sm_80", put_transport=False, fp8_dispatch=True)
    assert [name for name, _, _ in on_a100] == ["dispatch", "combine", "dispatch"]
    assert [name for name, _, _ in kernels.device_builds(torch.bfloat16, 512, 2, arch="sm_100a", put_transport=False,
                                                         fp8_dispatch=True)] == ["dispatch", "combine", "dispatch", "fp8"]


def test_compile_for_configs_compiles_each_distinct_build_once_all_at_once(monkeypatch):
    """Configs that differ only in what the builds do not depend on (backend, sm_budget, capacity)
    share builds: every distinct one is handed to a single compile_many, in first-seen order."""
    import moe_comm
    from moe_comm.cuda import jit

    calls = []
    monkeypatch.setattr(jit, "compile_many", lambda builds, *, arch: calls.append((list(builds), arch)) or [])
    shape = dict(num_experts=8, topk=2, hidden=512, max_tokens_per_rank=16)
    configs = [moe_comm.load_config(None, backend="vmm", dtype="bfloat16", **shape),
               moe_comm.load_config(None, backend="nccl", dtype="bfloat16", sm_budget=4, **shape),
               moe_comm.load_config(None, backend="vmm", dtype="float32", **shape),
               moe_comm.load_config(None, backend="vmm", dtype="bfloat16", dispatch_dtype="float8_e4m3fn", **shape)]
    kernels.compile_for_configs(configs, "sm_90")
    [(builds, arch)] = calls
    bf16 = kernels.device_builds(torch.bfloat16, 512, 2, arch="sm_90", put_transport=False, fp8_dispatch=True)
    f32 = kernels.device_builds(torch.float32, 512, 2, arch="sm_90", put_transport=False, fp8_dispatch=False)
    assert arch == "sm_90" and builds == bf16[:2] + f32 + bf16[2:]


def test_device_builds_name_a_bad_architecture():
    from moe_comm.errors import InputError

    for arch in ("sm9x", "sm_75"):
        with pytest.raises(InputError, match=f"arch: got '{arch}'"):
            kernels.device_builds(torch.bfloat16, 512, 2, arch=arch, put_transport=False, fp8_dispatch=True)


def test_device_builds_of_the_put_transport_use_nvshmem_headers_except_fp8_cu():
    from moe_comm.cuda import jit, nvshmem_build
    from moe_comm.errors import BackendError

    try:
        toolchain = nvshmem_build.toolchain()
    except BackendError as exc:
        missing("nvshmem_headers", f"no NVSHMEM headers here: {exc}")
    builds = kernels.device_builds(torch.float16, 256, 4, arch="sm_90", put_transport=True, fp8_dispatch=True)
    assert [(name, build_toolchain.options) for name, _, build_toolchain in builds] == [
        ("dispatch", toolchain.options), ("combine", toolchain.options), ("dispatch", toolchain.options),
        ("fp8", jit.Toolchain().options)]
    assert all(defines.get("PUT_TRANSPORT") == 1 for _, defines, _ in builds[:3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32])
def test_empty_rows_is_a_contiguous_matrix(dtype):
    rows = kernels.empty_rows(3, 5, dtype, torch.device("cpu"))
    assert rows.shape == (3, 5) and rows.stride() == (5, 1) and rows.dtype == dtype
    assert rows.is_contiguous() and rows.device == torch.device("cpu")
    assert kernels.empty_rows(0, 7, dtype, torch.device("cpu")).shape == (0, 7)


def _permute_launchers(monkeypatch, *, fp8_rows: bool, zero_padding: bool = True):
    """PermuteKernels for rows of HIDDEN bf16 over recording stand-ins on a 4-SM device; returns it and
    (entry, whether its build is the packed FP8 rows') -> recorder."""
    from types import SimpleNamespace

    recorders = {}

    def load(device, name, entry, defines={}, **_):
        assert name == "permute"
        return recorders.setdefault((entry, defines.get("FP8_ROWS") == 1), _Recorder(name, entry))

    monkeypatch.setattr(driver, "load_function", load)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=4))
    launchers = kernels.PermuteKernels(torch.device("cpu"), torch.bfloat16, HIDDEN, TOPK, fp8_rows=fp8_rows,
                                       num_slab_rows=WORLD * MAX_TOKENS, num_local_experts=EXPERTS // WORLD,
                                       zero_padding=zero_padding, capacity_rows=64)
    return launchers, recorders


def test_permute_launchers_pass_the_parameters_permute_cu_declares(monkeypatch):
    from moe_comm import fp8

    launchers, recorders = _permute_launchers(monkeypatch, fp8_rows=True)
    recv_pos, weights = torch.zeros(WORLD * MAX_TOKENS, TOPK, dtype=torch.int32), torch.zeros(WORLD * MAX_TOKENS, TOPK)
    counts = torch.zeros(EXPERTS // WORLD, dtype=torch.int32)
    rows = torch.zeros(WORLD * MAX_TOKENS, HIDDEN, dtype=torch.bfloat16)
    packed = torch.zeros(WORLD * MAX_TOKENS, fp8.packed_row_bytes(HIDDEN), dtype=torch.uint8)
    out = torch.zeros(64, HIDDEN, dtype=torch.bfloat16)
    launchers.permute(rows, recv_pos.data_ptr(), counts, counts, out)
    launchers.permute(packed, recv_pos.data_ptr(), counts, counts, out)
    launchers.unpermute(out, recv_pos.data_ptr(), weights.data_ptr(), rows)
    launchers.unpermute(out, recv_pos.data_ptr(), 0, rows)
    source = asset_dir("csrc").joinpath("permute.cu").read_text()
    # Packed FP8 rows go to the FP8 build's permute_rows, which is all that build loads (y is never FP8).
    assert sorted(recorders) == [("permute_rows", False), ("permute_rows", True), ("unpermute_rows", False)]
    for key, calls in (("permute_rows", False), 1), (("permute_rows", True), 1), (("unpermute_rows", False), 2):
        recorder = recorders[key]
        assert recorder.launches == [_signature(source, recorder.entry)] * calls, key
        assert recorder.grids == [4 * 4] * calls, "a few blocks per SM of the whole device: no SM budget"
    # The segments of the padding in dynamic shared memory: three int32 per local expert.
    assert recorders[("permute_rows", False)].shared == [3 * 4 * (EXPERTS // WORLD)]
    unweighted = recorders[("unpermute_rows", False)].values[1]
    assert unweighted[_parameter_index("permute", "unpermute_rows", "recv_weight")] == 0
    assert recorders[("unpermute_rows", False)].values[0][:4] == [WORLD * MAX_TOKENS, 64, out.data_ptr(),
                                                                  recv_pos.data_ptr()]
    without_padding = _permute_launchers(monkeypatch, fp8_rows=False, zero_padding=False)
    without_padding[0].permute(rows, recv_pos.data_ptr(), counts, counts, out)
    permute = without_padding[1][("permute_rows", False)]
    assert permute.shared == [0] and permute.values[0][_parameter_index("permute", "permute_rows", "zero_pad")] == 0


def test_permute_launchers_refuse_rows_of_another_dtype(monkeypatch):
    from moe_comm.errors import InputError

    launchers, recorders = _permute_launchers(monkeypatch, fp8_rows=False)
    recv_pos = torch.zeros(WORLD * MAX_TOKENS, TOPK, dtype=torch.int32).data_ptr()
    counts = torch.zeros(EXPERTS // WORLD, dtype=torch.int32)
    out = torch.zeros(64, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"rows: got dtype torch.uint8, .*fp8_rows=True"):
        launchers.permute(torch.zeros(WORLD * MAX_TOKENS, 128, dtype=torch.uint8), recv_pos, counts, counts, out)
    with pytest.raises(InputError, match="rows: got dtype torch.float32, expected torch.bfloat16"):
        launchers.permute(torch.zeros(WORLD * MAX_TOKENS, HIDDEN), recv_pos, counts, counts, out)
    with pytest.raises(InputError, match="y: got dtype torch.float16, expected the config's torch.bfloat16"):
        launchers.unpermute(out.half(), recv_pos, 0, out)
    assert not any(recorder.launches for recorder in recorders.values()), "validated before any launch"


def test_permute_builds_compile_for_sm90(nvrtc, cache):
    """Both builds of csrc/permute.cu compile with NVRTC (on a CPU host; one compile_many): the rows
    of the config dtype with both entry points, the packed FP8 rows with permute_rows only."""
    from moe_comm.cuda import jit

    builds = kernels.permute_builds(torch.bfloat16, 2048, 6, fp8_rows=True)
    assert builds == [("permute", kernels.kernel_defines(torch.bfloat16, 2048, 6), jit.Toolchain()),
                      ("permute", kernels.fp8_dispatch_defines(torch.bfloat16, 2048, 6), jit.Toolchain())]
    assert kernels.permute_builds(torch.bfloat16, 2048, 6, fp8_rows=False) == builds[:1]
    plain, packed = (path.read_bytes() for path in jit.compile_many(builds, arch="sm_90"))
    assert plain[:4] == packed[:4] == b"\x7fELF"
    assert b"permute_rows" in plain and b"unpermute_rows" in plain
    assert b"permute_rows" in packed and b"unpermute_rows" not in packed
