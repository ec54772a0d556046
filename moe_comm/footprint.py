"""The device memory a config takes on each rank, before any GPU is touched (``moe-comm info --config``).

Two kinds of memory: what a :class:`moe_comm.Dispatcher` holds for its lifetime (the device
backends' symmetric allocation, :class:`moe_comm.protocol.SymmetricRegions`; the collective
backends hold none and allocate their ``[W, M]`` exchange slabs per call), and what every
dispatch output takes (``out.x``: ``capacity_rows`` rows, :meth:`moe_comm.Config.capacity_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import fp8
from .protocol import SymmetricRegions

if TYPE_CHECKING:
    # Annotations only: the config checks every value with this module, so it imports it.
    from .config import Config

__all__ = ["Footprint", "MemoryTerm", "footprint", "run_memory"]

# Backends whose ranks share one symmetric allocation (the rest exchange padded slabs per call).
_SYMMETRIC = ("vmm", "nvshmem")


@dataclass(frozen=True)
class Footprint:
    """Bytes one rank takes for ``config`` at ``world_size`` ranks on ``backend``.

    symmetric_bytes: the Dispatcher's symmetric allocation (0 on the collective backends).
    slab_bytes: one ``[W, M, hidden]`` slab of rows (the symmetric allocation holds two per slab
        copy, ``Config.slab_copies``, and one more with NVSHMEM puts; the collective backends
        allocate two per exchange).
    capacity_rows: rows of every dispatch output; out_x_bytes: its ``x`` in the config dtype (with
        FP8 dispatch: its packed e4m3 rows and scales).
    lossless: no ``expert_capacity`` bound (nothing is ever dropped).
    """

    world_size: int
    backend: str
    symmetric_bytes: int
    slab_bytes: int
    capacity_rows: int
    out_x_bytes: int
    lossless: bool

    def lines(self) -> list[str]:
        """A human-readable report, one fact a line."""
        gib = lambda n: f"{n / 2**30:.3f} GiB ({n:,} bytes)"  # noqa: E731
        if self.symmetric_bytes:
            held = f"symmetric allocation, held by the Dispatcher: {gib(self.symmetric_bytes)}"
        else:
            held = f"no symmetric allocation; every exchange allocates two slabs: {gib(2 * self.slab_bytes)}"
        capacity = "lossless" if self.lossless else "bounded by expert_capacity"
        return [
            held,
            f"one [world, max_tokens_per_rank, hidden] slab: {gib(self.slab_bytes)}",
            f"each dispatch output x: {self.capacity_rows:,} rows ({capacity}), {gib(self.out_x_bytes)}; "
            "a training step holds several (the output, the experts' activations, backward's redispatch)",
        ]


def footprint(config: Config, world_size: int, backend: str) -> Footprint:
    """What ``config`` takes per rank at ``world_size`` ranks on ``backend`` (a resolved name, not ``auto``).

    Raises:
        ConfigError: ``world_size`` does not divide the config's experts.
    """
    config.check_world(world_size)
    row_bytes = config.hidden * config.torch_dtype.itemsize
    put = backend == "nvshmem" and config.nvshmem.transport == "put" and world_size > 1
    symmetric = backend in _SYMMETRIC or (backend == "nccl" and config.nccl.transport == "symmetric")
    regions = SymmetricRegions.plan(world_size, config.max_tokens_per_rank, config.topk, row_bytes,
                                    put_transport=put, slab_copies=config.slab_copies)
    capacity_rows = config.capacity_rows(world_size)
    out_row_bytes = row_bytes if config.dispatch_dtype is None else fp8.packed_row_bytes(config.hidden)
    return Footprint(
        world_size=world_size,
        backend=backend,
        symmetric_bytes=regions.nbytes if symmetric else 0,
        slab_bytes=world_size * config.max_tokens_per_rank * row_bytes,
        capacity_rows=capacity_rows,
        out_x_bytes=capacity_rows * out_row_bytes,
        lossless=config.expert_capacity is None,
    )


@dataclass(frozen=True)
class MemoryTerm:
    """One holder of a rank's memory: what it is, its bytes and the config key (or option) that scales it most."""

    what: str
    nbytes: int
    lower: str


def run_memory(config: Config, world_size: int, backend: str, ffn_hidden: int) -> list[MemoryTerm]:
    """What one rank of ``moe-comm run`` holds at its peak, largest first (an estimate from the shapes).

    The dispatcher's :func:`footprint`, plus what :class:`moe_comm.MoELayer` allocates for a
    training step and the run's float32 dense reference of every expert:

    - the dispatcher's symmetric allocation (or the two slabs of every exchange);
    - the step's activations: three dispatch-output-sized buffers (the output, backward's
      redispatch and its gradient) and the experts' ``[capacity_rows, 2F]`` and ``[capacity_rows, F]``
      activations with their gradients, in the config dtype; with ``receive_layout: token_major`` also
      the ``[W * M, H]`` token-major and reduced rows and their gradients;
    - this rank's experts (``[E_local, H, 2F]`` and ``[E_local, F, H]``) and their gradients;
    - the dense reference: every expert in float32, with gradients, plus the config-dtype copy
      it is drawn from.
    """
    fp = footprint(config, world_size, backend)
    itemsize = config.torch_dtype.itemsize
    per_expert = 3 * config.hidden * ffn_hidden
    local = config.num_local_experts(world_size)
    capacity_key = "expert_capacity" if config.expert_capacity is not None else "max_tokens_per_rank"
    activations = 3 * fp.out_x_bytes + 2 * fp.capacity_rows * 3 * ffn_hidden * itemsize
    if config.token_major:
        # The token-major rows and the reduced rows, and their gradients: [W * M, H] each.
        activations += 4 * world_size * config.max_tokens_per_rank * config.hidden * itemsize
    terms = [
        MemoryTerm("the dispatcher's buffers", fp.symmetric_bytes or 2 * fp.slab_bytes, "max_tokens_per_rank"),
        MemoryTerm(f"a training step's activations ({fp.capacity_rows:,} rows a dispatch output)", activations,
                   capacity_key),
        MemoryTerm(f"this rank's {local} experts and their gradients", 2 * local * per_expert * itemsize,
                   "num_experts or --ffn-hidden"),
        MemoryTerm(f"the dense reference of all {config.num_experts} experts (float32, with gradients)",
                   config.num_experts * per_expert * (2 * 4 + itemsize), "num_experts or --ffn-hidden"),
    ]
    return sorted(terms, key=lambda term: term.nbytes, reverse=True)
