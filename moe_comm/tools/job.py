"""The check behind ``moe-comm run``: MoELayer steps on every rank compared with the dense reference.

Each rank builds a :class:`moe_comm.nn.layer.MoELayer`, and per step draws random tokens and a
random upstream gradient from ``(seed, step, rank)``, runs forward and backward, and compares the
output and the gradients of the input, the router weight and the expert weights with
:func:`moe_comm.nn.reference.dense_forward` computed in float32 over every rank's tokens (gathered, with
the routing the layer chose, so a near-tie cannot pick different experts in the two runs).
Weights are not updated between steps: every step checks the same layer on new tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from ..config import Config, load_config
from ..errors import ConfigError, DeviceStatusError
from ..footprint import run_memory
from ..nn.layer import MoELayer
from ..nn.reference import build_dense_weights, dense_forward

__all__ = ["TOLERANCE", "RunOptions", "StepResult", "PhaseTimer", "check_fits", "run_rank"]

# Largest accepted max|got - want| / max|want| per tensor, by config dtype. The reference is
# float32; the layer rounds activations and outputs to the config dtype (bf16 keeps 8 bits of
# mantissa, ~4e-3 per rounding, and the errors seen on CPU and GPU stay below 1e-2).
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}
CHECKED = ("output", "grad_x", "grad_router", "grad_w_gate_up", "grad_w_down")


@dataclass(frozen=True)
class RunOptions:
    """What ``moe-comm run`` asks every rank to do.

    steps: forward+backward steps. tokens: tokens per rank per step (<= max_tokens_per_rank).
    ffn_hidden: each expert's intermediate width F. seed: weights and tokens are drawn from it.
    progress: rank 0 reports each finished step on stderr.
    """

    steps: int
    tokens: int
    ffn_hidden: int
    seed: int = 0
    progress: bool = True


@dataclass(frozen=True)
class StepResult:
    """One rank's view of one step.

    abs_err, rel_err: per checked tensor (``CHECKED``): max |got - want| and that divided by max |want|.
    dispatch_ms, combine_ms: forward dispatch and combine; step_ms: forward + backward.
    status: the dispatcher's check (``"ok"`` or the DeviceStatusError text).
    """

    step: int
    tokens: int
    abs_err: dict
    rel_err: dict
    dispatch_ms: float
    combine_ms: float
    step_ms: float
    status: str


class PhaseTimer:
    """Times named phases: CUDA events on a GPU (no sync inside a step), ``perf_counter`` on CPU.

    Use ``with timer.phase(name): ...``; :meth:`collect` (a host sync on GPU) returns the
    milliseconds per name since the last collect, summed over repeats.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: list = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._marks.append((name, start, end))

    def collect(self) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        totals: dict[str, float] = {}
        for name, start, end in self._marks:
            ms = start.elapsed_time(end) if self.device.type == "cuda" else (end - start) * 1e3
            totals[name] = totals.get(name, 0.0) + ms
        self._marks.clear()
        return totals


def _generator(seed: int, step: int, rank: int) -> torch.Generator:
    digest = hashlib.sha256(f"moe_comm.tools.job:{seed}:{step}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))


def _inputs(config, options: RunOptions, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``x`` and upstream gradient, ``[tokens, H]`` float32 on CPU, reproducible from the seed."""
    gen = _generator(options.seed, step, rank)
    shape = (options.tokens, config.hidden)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _gather(world_size: int, tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, tensor.detach().cpu())
    return gathered


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = float((got.detach().float() - want.detach().float()).abs().max())
    scale = float(want.detach().float().abs().max())
    return diff, diff / scale if scale > 0 else diff


def _host_available_bytes() -> int:
    """Memory the host can give without swapping: ``MemAvailable`` of ``/proc/meminfo`` (else the free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(config: Config, world_size: int, backend: str, ffn_hidden: int, gpu: bool) -> None:
    """Refuse a run that cannot fit before any rank starts (otherwise the kernel kills a CPU rank mid-run).

    CPU ranks share the host's available memory (all ``world_size`` of them); a GPU rank has its
    device's memory (device 0's total: every rank's device is alike on one host).

    Raises:
        ConfigError: naming the memory needed and available, and for each holder its size and
            the config key that lowers it, largest first.
    """
    terms = run_memory(config, world_size, backend, ffn_hidden)
    per_rank = sum(term.nbytes for term in terms)
    if gpu:
        needed, available = per_rank, torch.cuda.get_device_properties(0).total_memory
        where = f"of the {available / 2**30:.1f} GiB of GPU 0"
    else:
        needed, available = world_size * per_rank, _host_available_bytes()
        where = (f"({world_size} ranks x {per_rank / 2**30:.1f} GiB) of the {available / 2**30:.1f} GiB this host "
                 "has available")
    if needed <= available:
        return
    held = "; ".join(f"{term.what}: {term.nbytes / 2**30:.1f} GiB (lower {term.lower})" for term in terms)
    raise ConfigError(
        f"this config needs about {needed / 2**30:.1f} GiB {where}; lower config key "
        f"'{terms[0].lower.split()[0]}' first. Per rank, largest first: {held}"
    )


def run_rank(rank: int, world_size: int, config_dict: dict, options: RunOptions) -> list[StepResult]:
    """Body of one rank of ``moe-comm run`` (for :func:`moe_comm.tools.spawn.run_ranks`); returns its step results."""
    config = load_config(config_dict)
    layer = MoELayer(config, options.ffn_hidden, seed=options.seed)
    device = layer.dispatcher.device
    timer = PhaseTimer(device)
    layer.timer = timer
    dense = build_dense_weights(config, options.ffn_hidden, options.seed, dtype=torch.float32, device=device)
    reference_params = (dense.router, dense.w_gate_up, dense.w_down)
    for tensor in reference_params:
        tensor.requires_grad_()
    lo = rank * layer.dispatcher.num_local_experts
    hi = lo + layer.dispatcher.num_local_experts
    results = []
    try:
        for step in range(options.steps):
            layer.zero_grad(set_to_none=True)
            x_cpu, upstream_cpu = _inputs(config, options, step, rank)
            x = x_cpu.to(device=device, dtype=config.torch_dtype).requires_grad_()
            upstream = upstream_cpu.to(device=device, dtype=config.torch_dtype)
            with timer.phase("step"):
                z = layer(x)
                (z.float() * upstream.float()).sum().backward()
            times = timer.collect()
            try:
                layer.dispatcher.check()
                status = "ok"
            except DeviceStatusError as exc:  # reported in the table; the run goes on
                status = str(exc)

            # Reference over every rank's tokens, with the routing each rank's layer chose.
            routings = _gather(world_size, layer.last_topk_idx)
            for tensor in reference_params:
                tensor.grad = None
            loss = torch.zeros((), device=device)
            for r in range(world_size):
                xr, ur = (x_cpu, upstream_cpu) if r == rank else _inputs(config, options, step, r)
                # The layer saw x rounded to the config dtype; so does the reference.
                xr = xr.to(device=device, dtype=config.torch_dtype).float().requires_grad_()
                zr = dense_forward(xr, dense, topk=config.topk, renormalize=layer.renormalize,
                                   topk_idx=routings[r].to(device), router=config.router)
                loss = loss + (zr * ur.to(device=device, dtype=config.torch_dtype).float()).sum()
                if r == rank:
                    z_ref, x_ref = zr, xr
            loss.backward()
            router_grad = layer.router.weight.grad.clone()
            dist.all_reduce(router_grad)  # each rank's router gradient covers its own tokens only
            pairs = {
                "output": (z, z_ref),
                "grad_x": (x.grad, x_ref.grad),
                "grad_router": (router_grad, dense.router.grad),
                "grad_w_gate_up": (layer.w_gate_up.grad, dense.w_gate_up.grad[lo:hi]),
                "grad_w_down": (layer.w_down.grad, dense.w_down.grad[lo:hi]),
            }
            errors = {name: _errors(*pair) for name, pair in pairs.items()}
            results.append(
                StepResult(
                    step=step,
                    tokens=options.tokens,
                    abs_err={name: e[0] for name, e in errors.items()},
                    rel_err={name: e[1] for name, e in errors.items()},
                    dispatch_ms=times.get("dispatch", 0.0),
                    combine_ms=times.get("combine", 0.0),
                    step_ms=times["step"],
                    status=status,
                )
            )
            if options.progress and rank == 0:
                end = "\r" if sys.stderr.isatty() and step + 1 < options.steps else "\n"
                print(f"moe-comm run: step {step + 1}/{options.steps} done", end=end, file=sys.stderr, flush=True)
    finally:
        layer.close()
    return results
