"""``moe-comm`` (also ``python -m moe_comm``): ``info``, ``run`` and ``compile``.

* ``info``: torch, the CUDA devices and their peer access, and for every backend whether it
  can run here and why not, with its transports as ``moe_comm.backend_table`` describes
  them; which one ``backend: auto`` picks.
* ``run``: the main job. Spawns one rank per local GPU (or, without GPUs, N CPU ranks on the
  ``reference`` backend), runs MoELayer forward+backward steps and checks every step against
  the dense single-process reference (``moe_comm.tools.job``); prints a table; exits 1 if a check fails.
* ``compile``: compiles every kernel in ``csrc`` for the given architectures with NVRTC
  (no GPU needed) into the kernel cache, and prints the cubin paths.

Exit codes: 0 success, 1 a failed check or a runtime error, 2 a usage or configuration error.
Heavy imports (torch) happen inside the commands so ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

__all__ = ["main"]


class _UsageError(Exception):
    """A command-line value that cannot work; reported with exit code 2."""


def _say(*parts: object) -> None:
    print(*parts, flush=True)


def _probe(check: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    """Run one availability check; an exception becomes a 'no' carrying its text (info must not crash)."""
    try:
        return check()
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------------ info


def _missing_modules(entry) -> list[str]:
    return [name for name in entry.modules if importlib.util.find_spec(name) is None]


def _absent(backend: str) -> Optional[str]:
    """Why no transport of ``backend`` is in this install of moe_comm, or None when one is."""
    from .. import backend_table

    missing = [_missing_modules(entry) for entry in backend_table.ENTRIES if entry.backend == backend]
    if not all(missing):
        return None
    modules = sorted({module for absent in missing for module in absent})
    return f"not installed here (missing {', '.join(modules)})"


def _transports(backend: str) -> str:
    from .. import backend_table

    return " and ".join(backend_table.transports(backend))


def _describe_entry(entry) -> str:
    missing = _missing_modules(entry)
    absent = f"; not installed here (missing {', '.join(missing)})" if missing else ""
    return f"{entry.id}: {entry.mover.value}; memory: {entry.memory.value}; reach: {entry.reach.value}{absent}"


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _no_cuda_reason() -> str:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (no CUDA)"
    return "no CUDA device is visible (torch.cuda.is_available() is False)"


def _probe_reference() -> tuple[bool, str]:
    import torch.distributed as dist

    if not dist.is_available():
        return False, "torch was built without torch.distributed"
    if not dist.is_gloo_available():
        return False, "torch.distributed has no gloo backend"
    return True, "torch.distributed with gloo, CPU ranks"


def _probe_vmm() -> tuple[bool, str]:
    count = _cuda_count()
    if count == 0:
        return False, _no_cuda_reason()
    from ..cuda.driver import cu_check, cuda_driver

    driver = cuda_driver()  # BackendError if cuda-bindings or libcuda cannot be loaded
    attr = driver.CUdevice_attribute
    for index in range(count):
        device = cu_check(driver.cuDeviceGet(index), f"cuDeviceGet({index})")
        for name in ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                     "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
            if not cu_check(driver.cuDeviceGetAttribute(getattr(attr, name), device), name):
                return False, f"GPU {index} does not support {name[len('CU_DEVICE_ATTRIBUTE_'):]}"
    if count == 1:
        return True, "1 GPU: ranks share it (no peer GPU to reach)"
    peers = _peer_matrix(count)
    if not all(peers[i][j] for i in range(count) for j in range(count) if i != j):
        return False, f"{count} GPUs, but not every pair has peer access (see the matrix above)"
    return True, f"{count} GPUs with peer access between all of them"


def _probe_nvshmem() -> tuple[bool, str]:
    if _cuda_count() == 0:
        return False, _no_cuda_reason()
    from torch.distributed import _symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        return False, "torch's NVSHMEM symmetric-memory backend is not available (nvidia-nvshmem not importable?)"
    return True, f"torch's NVSHMEM symmetric memory: transports {_transports('nvshmem')} (put compiles NVSHMEM's " \
                 "device headers with NVRTC; the nvshmem-cu13 extra brings them)"


def _probe_nccl() -> tuple[bool, str]:
    if _cuda_count() == 0:
        return False, _no_cuda_reason()
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return False, "torch.distributed has no NCCL backend"
    return True, f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}: transports {_transports('nccl')}"


# Whether each backend of the table can run on this machine (one check per backend name).
_PROBES = {"vmm": _probe_vmm, "nvshmem": _probe_nvshmem, "nccl": _probe_nccl, "reference": _probe_reference}


def _peer_matrix(count: int) -> list[list[bool]]:
    import torch

    return [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(count)] for i in range(count)]


def _auto_choice() -> str:
    from ..config import load_config

    return _resolved_backend(load_config(None, backend="auto"), _cuda_count() > 0)


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from .. import __version__, backend_table

    # The package's folder, a floor above this module's.
    _say(f"moe_comm {__version__} at {Path(__file__).resolve().parents[1]}")
    _say(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})")
    ok, text = _probe(lambda: (True, str(_cuda_count())))
    count = int(text) if ok else 0
    if not ok:
        _say(f"CUDA devices: unknown ({text})")
    elif count == 0:
        _say(f"CUDA devices: none ({_no_cuda_reason()})")
    else:
        _say(f"CUDA devices: {count}")
        for index in range(count):
            ok, text = _probe(lambda: (True, _describe_device(index)))
            _say(f"  {index}: {text}")
        ok, text = _probe(lambda: (True, _format_peers(_peer_matrix(count))))
        _say("peer access (row can reach column):" if ok else f"peer access: unknown ({text})")
        if ok:
            _say(text)
    _say("backends:")
    for name in backend_table.BACKEND_NAMES:
        absent = _absent(name)
        usable, why = (False, absent) if absent else _probe(_PROBES[name])
        _say(f"  {name:<10} {'usable' if usable else 'no':<7} {why}")
        for entry in backend_table.ENTRIES:
            if entry.backend == name:
                _say(f"    - {_describe_entry(entry)}")
    ok, text = _probe(lambda: (True, _auto_choice()))
    _say(f"auto -> {text}" if ok else f"auto -> unknown ({text})")
    if args.config is not None or args.world is not None:
        _say_footprint(args, count, text if ok else "reference")
    return 0


def _say_footprint(args: argparse.Namespace, gpus: int, auto: str) -> None:
    """The per-rank memory of ``--config`` (default: the embedded default) at ``--world`` ranks."""
    from ..config import load_config
    from ..footprint import footprint

    config = load_config(args.config)
    world = args.world or gpus or 2
    backend = auto if config.backend == "auto" else config.backend
    _say(f"memory per rank of {args.config or 'the default config'} at {world} ranks on {backend} "
         f"(max_tokens_per_rank {config.max_tokens_per_rank}, hidden {config.hidden}, {config.dtype}, "
         f"top-{config.topk} of {config.num_experts}):")
    for line in footprint(config, world, backend).lines():
        _say(f"  {line}")


def _describe_device(index: int) -> str:
    import torch

    from ..cuda.jit import MIN_ARCH

    props = torch.cuda.get_device_properties(index)
    too_old = " (moe_comm's kernels need sm_%d or newer)" % MIN_ARCH if props.major * 10 + props.minor < MIN_ARCH else ""
    return f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB{too_old}"


def _format_peers(matrix: list[list[bool]]) -> str:
    count = len(matrix)
    lines = ["      " + " ".join(f"{j:>3}" for j in range(count))]
    for i, row in enumerate(matrix):
        cells = ("  -" if i == j else ("  y" if ok else "  n") for j, ok in enumerate(row))
        lines.append(f"  {i:>3} " + " ".join(cells))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- run


def _plan_ranks(config, requested_ranks: Optional[int]) -> tuple[int, bool, str]:
    """``(world_size, gpu, dist_backend)`` for this machine and config."""
    gpus = _cuda_count()
    if config.backend == "reference" or (config.backend == "auto" and gpus == 0):
        world_size = 2 if requested_ranks is None else requested_ranks
        return world_size, False, "gloo"
    if gpus == 0:
        raise _UsageError(
            f"backend {config.backend!r} needs CUDA GPUs and {_no_cuda_reason()}; use --backend reference for CPU ranks"
        )
    if requested_ranks is not None:
        raise _UsageError(f"--ranks applies to CPU runs (backend reference); with GPUs one rank runs per GPU ({gpus})")
    # gloo carries the CPU-side setup collectives, NCCL anything on the GPU.
    return gpus, True, "cpu:gloo,cuda:nccl"


def _resolved_backend(config, gpu: bool) -> str:
    """The backend ``config`` resolves to for ranks of this host only (what ``info`` and ``run`` start)."""
    import torch

    from ..backends import host_identity, resolve_backend_name

    return resolve_backend_name(config, torch.device("cuda", 0) if gpu else torch.device("cpu"), [host_identity()])


def _default_ffn_hidden(hidden: int) -> int:
    # About half the model width, as in fine-grained MoE models; a multiple of 8 keeps bf16
    # rows 16-byte aligned for grouped GEMMs.
    return max(8, hidden // 2 // 8 * 8)


def _nan_max(values) -> float:
    """max() that returns NaN if any value is NaN (plain max lets a NaN hide behind a number)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _aggregate(per_rank: list, tolerance: float) -> list[dict]:
    """One row per step: errors and times maxed over ranks, tokens summed, statuses joined."""
    from .job import CHECKED

    rows = []
    for step_results in zip(*per_rank):
        rel = {name: _nan_max(r.rel_err[name] for r in step_results) for name in CHECKED}
        statuses = sorted({f"rank {i}: {r.status}" for i, r in enumerate(step_results) if r.status != "ok"})
        rows.append({
            "step": step_results[0].step,
            "tokens": sum(r.tokens for r in step_results),
            "abs": _nan_max(r.abs_err[name] for r in step_results for name in CHECKED),
            "rel": rel,
            "worst": max(rel, key=lambda name: math.inf if math.isnan(rel[name]) else rel[name]),
            "dispatch_ms": max(r.dispatch_ms for r in step_results),
            "combine_ms": max(r.combine_ms for r in step_results),
            "step_ms": max(r.step_ms for r in step_results),
            "statuses": statuses,
            "ok": all(v <= tolerance for v in rel.values()) and not statuses,  # NaN fails the comparison
        })
    return rows


def _print_table(rows: list[dict], tolerance: float) -> None:
    _say(f"{'step':>4} {'tokens':>7} {'max abs err':>11} {'max rel err':>11} {'worst':>14} "
         f"{'dispatch ms':>11} {'combine ms':>10} {'step ms':>8}  result")
    for row in rows:
        _say(f"{row['step']:>4} {row['tokens']:>7} {row['abs']:>11.3e} {row['rel'][row['worst']]:>11.3e} "
             f"{row['worst']:>14} {row['dispatch_ms']:>11.3f} {row['combine_ms']:>10.3f} {row['step_ms']:>8.2f}  "
             f"{'pass' if row['ok'] else 'FAIL'}")
    for row in rows:
        if not row["ok"]:
            over = {name: f"{v:.3e}" for name, v in row["rel"].items() if not v <= tolerance}
            details = row["statuses"] + ([f"relative errors over {tolerance:g}: {over}"] if over else [])
            _say(f"step {row['step']}: {'; '.join(details)}")


def _cmd_run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..errors import RankFailureError
    from .spawn import run_ranks
    from .job import TOLERANCE, RunOptions, check_fits, run_rank

    overrides = {} if args.backend is None else {"backend": args.backend}
    config = load_config(args.config, **overrides)
    world_size, gpu, dist_backend = _plan_ranks(config, args.ranks)
    config.check_world(world_size)
    tokens = config.max_tokens_per_rank if args.tokens is None else args.tokens
    if not 1 <= tokens <= config.max_tokens_per_rank:
        raise _UsageError(f"--tokens: got {tokens}, expected 1..max_tokens_per_rank ({config.max_tokens_per_rank})")
    ffn_hidden = _default_ffn_hidden(config.hidden) if args.ffn_hidden is None else args.ffn_hidden
    options = RunOptions(steps=args.steps, tokens=tokens, ffn_hidden=ffn_hidden, seed=args.seed)
    check_fits(config, world_size, _resolved_backend(config, gpu), ffn_hidden, gpu)
    where = f"{world_size} GPU ranks" if gpu else f"{world_size} CPU ranks"
    print(
        f"moe-comm run: {where}, backend {_resolved_backend(config, gpu)} over {dist_backend}; "
        f"experts {config.num_experts}, topk {config.topk}, hidden {config.hidden}, ffn {ffn_hidden}, "
        f"{config.dtype}, {tokens} tokens/rank, {args.steps} steps; starting ranks...",
        file=sys.stderr, flush=True,
    )
    try:
        per_rank = run_ranks(run_rank, world_size, config.to_dict(), options, dist_backend=dist_backend,
                             gpu=gpu, timeout_s=args.timeout)
    except RankFailureError as exc:
        print(f"moe-comm run: FAIL: {exc}", file=sys.stderr)
        return 1

    tolerance = TOLERANCE[config.dtype]
    rows = _aggregate(per_rank, tolerance)
    _print_table(rows, tolerance)
    checked = "output and gradients of x, router, w_gate_up, w_down"
    failed = sum(not row["ok"] for row in rows)
    if failed:
        _say(f"FAIL: {failed} of {len(rows)} steps differ from the dense reference ({checked})")
        return 1
    _say(f"PASS: {len(rows)} steps match the dense reference ({checked}; relative tolerance {tolerance:g} "
         f"for {config.dtype}); times are the slowest rank's, step 0 includes warm-up")
    return 0


# --------------------------------------------------------------------------------- compile


_COMPILE_SHAPE_KEYS = ("backend", "hidden", "topk", "dtype")


def _cmd_compile(args: argparse.Namespace) -> int:
    from ..cuda import jit, kernels
    from ..config import load_config

    # An architecture the kernels cannot run on is the answer whether or not NVRTC is here.
    for arch in args.arch:
        jit.arch_capability(arch)
    major, minor = jit.nvrtc_version()  # CompileError naming the fix when NVRTC is missing
    overrides = {key: getattr(args, key) for key in _COMPILE_SHAPE_KEYS if getattr(args, key) is not None}
    paths = args.config or ([None] if overrides else [])
    configs = [load_config(path, **overrides) for path in paths]
    total = 0
    for arch in args.arch:
        built = kernels.compile_for_configs(configs, arch) if configs else jit.compile_all(arch)
        total += len(built)
        for path in built:
            _say(f"{arch}  {path}")
    what = "; ".join(f"{path or 'the default config'} (dtype {config.dtype}, hidden {config.hidden}, topk {config.topk})"
                     for path, config in zip(paths, configs))
    what = f"the kernels of {what}" if configs else "every declared kernel build"
    _say(f"compiled {total} kernel build(s), {what}, with NVRTC {major}.{minor} into {jit.cache_dir()}")
    return 0


# ------------------------------------------------------------------------------------ main


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (``nan`` and ``inf`` parse as floats: refused here, not in a traceback)."""
    from ..config import MAX_TIMEOUT_S

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= MAX_TIMEOUT_S:  # also false for nan
        raise argparse.ArgumentTypeError(f"expected seconds > 0 and at most {MAX_TIMEOUT_S:g}, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    import torch

    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="moe-comm", description="Dispatch/combine of MoE tokens between GPUs: inspect, check and compile."
    )
    parser.add_argument("--version", action="version", version=f"moe-comm {__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser("info", help="torch, CUDA devices, peer access, which backends can run here, "
                                            "and the memory a config takes")
    info.add_argument("--config", help="also report the memory this YAML config takes per rank")
    info.add_argument("--world", type=_positive,
                      help="ranks for that report (default: the GPUs present, 2 without GPUs); implies the "
                           "default config when --config is not given")
    info.set_defaults(func=_cmd_info)

    run = commands.add_parser(
        "run",
        help="run MoE layer steps on every local GPU (or CPU ranks) and check them against a dense reference",
        description="Spawns one rank per local GPU (backend from the config; auto picks the GPU backend), or "
        "without GPUs N CPU ranks on the reference backend; runs forward+backward steps of MoELayer on "
        "random tokens and checks outputs and gradients against the dense single-process reference.",
    )
    run.add_argument("--config", help="YAML config (default: the embedded configs/default.yaml)")
    run.add_argument("--backend", help="override the config's backend: auto, vmm, nvshmem, nccl or reference")
    run.add_argument("--steps", type=_positive, default=3, help="forward+backward steps (default 3)")
    run.add_argument("--ranks", type=_positive, help="CPU runs only: number of ranks (default 2)")
    run.add_argument("--tokens", type=_positive, help="tokens per rank per step (default: max_tokens_per_rank)")
    run.add_argument("--ffn-hidden", type=_positive, help="each expert's intermediate width (default: about hidden/2)")
    run.add_argument("--seed", type=int, default=0, help="seed of weights and tokens (default 0)")
    run.add_argument("--timeout", type=_seconds, default=600.0,
                     help="seconds before hung ranks are killed and reported (default 600)")
    run.set_defaults(func=_cmd_run)

    compile_ = commands.add_parser("compile", help="compile every kernel for GPU architectures with NVRTC (no GPU needed)")
    compile_.add_argument("--arch", action="append", required=True,
                          help="architecture such as sm_90 (sm_80 or newer); repeat for several")
    compile_.add_argument("--config", action="append",
                          help="compile the kernels this YAML config runs; repeat for several, compiled at once "
                               "(default: every declared build, which includes the embedded default config's)")
    compile_.add_argument("--backend", help="with --config or a shape key: override the config's backend "
                                            "(nvshmem with transport put compiles the NVSHMEM build)")
    compile_.add_argument("--hidden", type=_positive, help="override the config's hidden (compiles that config's kernels)")
    compile_.add_argument("--topk", type=_positive, help="override the config's topk (compiles that config's kernels)")
    compile_.add_argument("--dtype", help="override the config's dtype: bfloat16, float16 or float32")
    compile_.set_defaults(func=_cmd_compile)

    bench = commands.add_parser(
        "bench", add_help=False,
        help="time dispatch/combine against the all-to-all baselines (`moe-comm bench --help` for its options)",
    )
    bench.set_defaults(func=None)  # main() hands `bench` and its own options to moe_comm.tools.bench.main
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``moe-comm``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # bench parses its own options (see moe_comm.tools.bench)
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = _parser().parse_args(argv)
    from ..errors import ConfigError, InputError, MoeCommError

    try:
        return args.func(args)
    except (_UsageError, ConfigError, InputError) as exc:
        print(f"moe-comm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except MoeCommError as exc:
        print(f"moe-comm {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
