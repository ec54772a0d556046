"""Contract of moe_comm.cuda.jit: the NVRTC compile path and its disk cache (CPU only).

The tests need only NVRTC (the ``nvidia-cuda-nvrtc`` wheel), which compiles for sm_90 on a
machine without a GPU; they skip with the reason when it cannot be loaded (fixtures ``nvrtc`` and
``cache`` in conftest.py).
"""

from __future__ import annotations

import threading

import pytest
import torch

from moe_comm.cuda import jit, nvshmem_build
from moe_comm.errors import BackendError, CompileError, InputError
from moe_comm.cuda.kernels import fp8_defines, fp8_dispatch_defines, kernel_defines
from toy_kernels import TOY_SOURCE


def cubins(directory):
    return sorted(p.name for p in directory.iterdir() if p.suffix == ".cubin")


def path_is_cubin(path) -> bool:
    return path.exists() and path.read_bytes()[:4] == b"\x7fELF"  # an ELF cubin (SASS for a real arch)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MOE_COMM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit.cache_dir() == tmp_path / "xdg" / "moe_comm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert jit.cache_dir() == tmp_path / "home" / ".cache" / "moe_comm"
    monkeypatch.setenv("MOE_COMM_CACHE_DIR", str(tmp_path / "explicit"))
    assert jit.cache_dir() == tmp_path / "explicit"


def test_compile_writes_a_readable_cubin_once(nvrtc, cache):
    directory, calls = cache
    path = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 3, "DTYPE": "bf16"}, source=TOY_SOURCE)
    assert path.parent == directory
    # kernel - defines (sorted by name: DTYPE, VALUE) - arch - 16 hex digits of the key
    prefix, digest = path.stem.rsplit("-", 1)
    assert prefix == "toy-bf16_value3-sm90"
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert path_is_cubin(path)
    stamp = path.stat().st_mtime_ns

    again = jit.compile_source("toy", arch="sm_90", defines={"DTYPE": "bf16", "VALUE": 3}, source=TOY_SOURCE)
    assert again == path
    assert calls == ["toy"], "the second call (same defines, other order) must hit the cache"
    assert path.stat().st_mtime_ns == stamp
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")], "no temp file left behind"


def test_compiling_leaves_python_bytes_objects_intact(nvrtc, cache):
    # Regression: NVRTC used to write its one-byte log into the immutable ``b" " * 1``, which is
    # Python's shared b" " object; afterwards every b" " in the process was b"\\0" and gloo's
    # object collectives (pickle) delivered corrupt data.
    import pickle

    jit.compile_source("space", arch="sm_90", source='extern "C" __global__ void k(int* p) { p[0] = 1; }')
    assert (b" " * 1)[0] == 32 and bytes([32])[0] == 32
    assert pickle.loads(pickle.dumps([b" ", "a b"])) == [bytes([32]), "a b"]


def test_every_key_part_gives_its_own_entry(nvrtc, cache):
    directory, calls = cache
    base = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 1}, source=TOY_SOURCE)
    other_define = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 2}, source=TOY_SOURCE)
    other_arch = jit.compile_source("toy", arch="sm_80", defines={"VALUE": 1}, source=TOY_SOURCE)
    other_source = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 1}, source=TOY_SOURCE + "\n// edit\n")
    paths = {base, other_define, other_arch, other_source}
    assert len(paths) == 4
    assert cubins(directory) == sorted(p.name for p in paths)
    assert len(calls) == 4
    assert other_arch.name.startswith("toy-value1-sm80-")


def test_schema_version_is_part_of_the_key(nvrtc, cache, monkeypatch):
    directory, calls = cache
    first = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 1}, source=TOY_SOURCE)
    monkeypatch.setattr(jit, "CACHE_SCHEMA_VERSION", jit.CACHE_SCHEMA_VERSION + 1)
    second = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 1}, source=TOY_SOURCE)
    assert first != second and len(calls) == 2


def test_entry_compiled_by_another_process_while_waiting_for_the_lock_is_used(nvrtc, cache, monkeypatch):
    """The second look after taking the lock: a rank that lost the race must not compile again."""
    directory, calls = cache
    expected = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 5}, source=TOY_SOURCE)
    cubin = expected.read_bytes()
    expected.unlink()
    calls.clear()
    real_flock = jit.fcntl.flock

    def flock_then_peer_finishes(handle, operation):
        real_flock(handle, operation)
        expected.write_bytes(cubin)  # what the lock holder before us left behind

    monkeypatch.setattr(jit.fcntl, "flock", flock_then_peer_finishes)
    assert jit.compile_source("toy", arch="sm_90", defines={"VALUE": 5}, source=TOY_SOURCE) == expected
    assert calls == []


def test_syntax_error_raises_compile_error_with_the_log(nvrtc, cache):
    directory, _ = cache
    broken = 'extern "C" __global__ void k(float* x) { x[0] = undefined_thing_42; }'
    with pytest.raises(CompileError) as info:
        jit.compile_source("broken", arch="sm_90", source=broken)
    message = str(info.value)
    assert "'broken'" in message
    assert "undefined_thing_42" in message and "is undefined" in message  # NVRTC's own log line
    assert cubins(directory) == []


def test_packaged_header_is_included_and_hashed(nvrtc, cache, monkeypatch):
    """Sources include the packaged .cuh headers; a header edit is a new cache entry."""
    directory, calls = cache
    headers = {"toy_value.cuh": "#define HEADER_VALUE 7\n"}
    monkeypatch.setattr(jit, "_headers", lambda: dict(headers))
    source = '#include "toy_value.cuh"\nextern "C" __global__ void k(int* x) { x[0] = HEADER_VALUE; }\n'
    first = jit.compile_source("with_header", arch="sm_90", source=source)
    headers["toy_value.cuh"] = "#define HEADER_VALUE 8\n"
    second = jit.compile_source("with_header", arch="sm_90", source=source)
    assert first != second and len(calls) == 2


def test_bad_arguments_name_themselves(nvrtc, cache):
    with pytest.raises(InputError, match="arch"):
        jit.compile_source("toy", arch="sm90", source=TOY_SOURCE)
    with pytest.raises(InputError, match="defines"):
        jit.compile_source("toy", arch="sm_90", defines={"VALUE": 1.5}, source=TOY_SOURCE)
    with pytest.raises(InputError, match="defines"):
        jit.compile_source("toy", arch="sm_90", defines={"NOT AN IDENT": 1}, source=TOY_SOURCE)
    with pytest.raises(InputError, match="kernel name"):
        jit.compile_source("../escape", arch="sm_90", source=TOY_SOURCE)
    with pytest.raises(CompileError, match="no_such_kernel"):
        jit.compile_source("no_such_kernel", arch="sm_90")


def test_declared_defines():
    text = '// moe_comm-defines: {"HIDDEN": 7168, "DTYPE": "bf16"}\n// moe_comm-defines: {"HIDDEN": 4096}\nint x;\n'
    assert jit._declared_defines("k", text) == [{"HIDDEN": 7168, "DTYPE": "bf16"}, {"HIDDEN": 4096}]
    assert jit._declared_defines("k", "int x;\n") == [{}]
    with pytest.raises(CompileError, match="line 1"):
        jit._declared_defines("k", "// moe_comm-defines: HIDDEN=1\n")


def test_compile_all_builds_every_packaged_kernel(nvrtc, cache):
    directory, _ = cache
    paths = jit.compile_all("sm_90")
    assert all(p.parent == directory and p.exists() for p in paths)
    names = {p.name.split("-", 1)[0] for p in paths}
    packaged = set(jit._kernel_sources())
    assert names == packaged


def test_compile_many_runs_the_builds_at_once_and_returns_them_in_order(nvrtc, cache, monkeypatch):
    directory, calls = cache
    # Each compile waits at a barrier for the other: they pass only if both run at the same time.
    meeting = threading.Barrier(2, timeout=120)
    counting = jit._nvrtc_compile

    def compile_when_both_arrived(name, source, headers, options):
        meeting.wait()
        return counting(name, source, headers, options)

    monkeypatch.setattr(jit, "_nvrtc_compile", compile_when_both_arrived)
    builds = [("combine", kernel_defines(torch.bfloat16, 256, 2), jit.Toolchain()),
              ("fp8", fp8_defines(torch.bfloat16, 256), jit.Toolchain())]
    paths = jit.compile_many(builds, arch="sm_90")
    assert sorted(calls) == ["combine", "fp8"]
    monkeypatch.setattr(jit, "_nvrtc_compile", counting)
    assert paths == [jit.compile_source(name, arch="sm_90", defines=defines) for name, defines, _ in builds]
    assert len(calls) == 2, "compile_many's cubins are the cache entries compile_source finds"


def test_compile_many_raises_the_first_failure_after_every_build_ended(nvrtc, cache):
    directory, _ = cache
    builds = [("combine", kernel_defines(torch.bfloat16, 256, 2), jit.Toolchain()),
              ("no_such_kernel", {}, jit.Toolchain())]
    with pytest.raises(CompileError, match="no_such_kernel"):
        jit.compile_many(builds, arch="sm_90")
    assert [name.split("-")[0] for name in cubins(directory)] == ["combine"]


def test_modules_do_not_import_cuda_bindings_at_import_time():
    """CPU-only installs import moe_comm without the CUDA bindings: they are imported inside functions."""
    import ast
    from pathlib import Path

    import moe_comm

    root = Path(moe_comm.__file__).parent
    for relative in ("cuda/jit.py", "cuda/driver.py", "symm/base.py", "symm/vmm.py"):
        tree = ast.parse((root / relative).read_text())
        for node in tree.body:
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not any(name.startswith("cuda") for name in names), f"{relative} imports {names} at module level"


def test_toolchain_options_and_identity_are_part_of_the_key(nvrtc, cache):
    directory, calls = cache
    plain = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 1}, source=TOY_SOURCE)
    with_option = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 1}, source=TOY_SOURCE,
                                     toolchain=jit.Toolchain(options=("-default-device",)))
    other_headers = jit.compile_source("toy", arch="sm_90", defines={"VALUE": 1}, source=TOY_SOURCE,
                                       toolchain=jit.Toolchain(options=("-default-device",), identity="v2"))
    assert len({plain, with_option, other_headers}) == 3 and len(calls) == 3


def test_put_transport_kernels_compile_against_nvshmem_headers(nvrtc, cache):
    """The NVSHMEM device API compiles header-only through NVRTC (the test extra installs the headers)."""
    directory, calls = cache
    toolchain = nvshmem_build.toolchain()
    defines = kernel_defines(torch.bfloat16, 7168, 8, put_transport=True)
    assert defines["PUT_TRANSPORT"] == 1
    for name in ("dispatch", "combine"):
        path = jit.compile_source(name, arch="sm_90", defines=defines, toolchain=toolchain)
        assert path.name.startswith(f"{name}-bf16_hidden7168_put_transport1_topk8-sm90-")
        assert b"nvshmemi_device_state_d" in path.read_bytes()  # NVSHMEM's state lives in the module
    assert calls == ["dispatch", "combine"]


def test_fp8_dispatch_build_compiles_for_both_transports(nvrtc, cache):
    """FP8 dispatch's build (packed rows in the slabs, config-dtype rows quantized on the way) for a
    hidden whose packed rows end in zero padding (3 scales: 12 bytes, 4 of padding), with puts too."""
    directory, calls = cache
    for put, toolchain in ((False, jit.Toolchain()), (True, nvshmem_build.toolchain())):
        defines = fp8_dispatch_defines(torch.float16, 384, 4, put_transport=put)
        assert defines["FP8_ROWS"] == 1 and defines.get("PUT_TRANSPORT", 0) == int(put)
        assert path_is_cubin(jit.compile_source("dispatch", arch="sm_90", defines=defines, toolchain=toolchain))
    assert calls == ["dispatch", "dispatch"]


def test_missing_nvshmem_headers_name_the_wheel(monkeypatch):
    import cuda.pathfinder

    real = cuda.pathfinder.find_nvidia_header_directory
    monkeypatch.setattr(cuda.pathfinder, "find_nvidia_header_directory",
                        lambda name: None if name == "cccl" else real(name))
    with pytest.raises(BackendError, match=r"cccl \(pip install nvidia-cuda-cccl\).*transport 'p2p'"):
        nvshmem_build.toolchain()
