"""Bytes an SM moves: dispatch's row expansion and combine's row sums alone, on 4 to 132 SMs.

Dispatch's expansion writes every received row to the ``out.x`` rows of its kept entries (top-8:
eight copies of each row), and combine's send phase sums a token's expert rows. With an
``sm_budget`` of 24 their rate per SM decides how much slower they get than on the whole device
(the SM-budget issue asks for at most 2x). This measures the data movement alone, outside
moe_comm's kernels, three ways:

* ``vector``: what ``csrc/expand.cuh`` does: one warp per (row, 2 KiB part), 16-byte loads
  (4 per lane), then the part stored to each destination row.
* ``bulk``: each warp owns a row-sized buffer in shared memory; its first lane loads a whole row
  with one ``cp.async.bulk`` (completion on an mbarrier), then stores it to each destination with
  one ``cp.async.bulk`` each; the stores' reads of the buffer are waited for before the next load.
* ``sum (combine's shape)``: the other direction, as combine's send phase at world 1: each token's
  ``--copies`` rows loaded at once (2 vectors per lane each) and summed in float32 into one row.

Rows: ``--rows`` source rows of ``--hidden`` bf16 values, each to ``--copies`` distinct destination
rows (a random permutation of ``rows * copies`` rows, as a uniform routing gives). Timed with CUDA
events, median of ``--repeats``, at each grid size of ``--sms`` (one 512-thread block per SM).
Every kernel's output is checked against ``torch``'s indexing first.

    python benchmarks/bench_row_copy.py --sms 132 64 24 16 8 4 --name 1xH100-row-copy

Results go to ``<out>/<name>.md``, ``.json`` and ``.png`` (the plot needs matplotlib).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path
from typing import Callable

import torch

from moe_comm.cuda import driver
from moe_comm.cuda.kernel_params import KernelParams

THREADS = 512

SOURCE = r"""
typedef unsigned char uint8_t;
typedef unsigned int uint32_t;
typedef unsigned long long u64;

struct alignas(16) Vec16 { uint32_t w[4]; };

// One warp per (row, part of 32 * VPL vectors).
extern "C" __global__ void __launch_bounds__(512) copy_vector(const uint8_t* src, uint8_t* out, const int* dest,
                                                              int rows, int row_bytes, int copies) {
    const int lane = threadIdx.x & 31;
    const int vecs = row_bytes / 16;
    const int parts = (vecs + 32 * VPL - 1) / (32 * VPL);
    const long long units = (long long)rows * parts;
    for (long long unit = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); unit < units;
         unit += (long long)gridDim.x * (blockDim.x >> 5)) {
        const int r = (int)(unit / parts);
        const int v0 = (int)(unit - (long long)r * parts) * 32 * VPL + lane;
        Vec16 vals[VPL];
#pragma unroll
        for (int u = 0; u < VPL; ++u) {
            const int v = v0 + 32 * u;
            if (v < vecs) vals[u] = *reinterpret_cast<const Vec16*>(src + (long long)r * row_bytes + 16ll * v);
        }
        for (int k = 0; k < copies; ++k) {
            uint8_t* row = out + (long long)dest[(long long)r * copies + k] * row_bytes;
#pragma unroll
            for (int u = 0; u < VPL; ++u) {
                const int v = v0 + 32 * u;
                if (v < vecs) *reinterpret_cast<Vec16*>(row + 16ll * v) = vals[u];
            }
        }
    }
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t round_bf16(float f) {  // nearest even (finite inputs)
    const uint32_t u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Combine's shape: z[t] = sum over k of rows[dest[t * copies + k]] in float32, k increasing, one
// warp per (token, part of 32 * 2 vectors), every part's `copies` loads in flight at once.
extern "C" __global__ void __launch_bounds__(512) sum_vector(const uint8_t* rows_in, uint8_t* z, const int* dest,
                                                             int tokens, int row_bytes, int copies) {
    const int lane = threadIdx.x & 31;
    const int vecs = row_bytes / 16;
    const int parts = (vecs + 63) / 64;
    const long long units = (long long)tokens * parts;
    for (long long unit = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); unit < units;
         unit += (long long)gridDim.x * (blockDim.x >> 5)) {
        const int t = (int)(unit / parts);
        const int v0 = (int)(unit - (long long)t * parts) * 64 + lane;
        float acc[2][8];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
        Vec16 vals[8][2];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (k < copies) {
                const uint8_t* row = rows_in + (long long)dest[(long long)t * copies + k] * row_bytes;
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const int v = v0 + 32 * u;
                    if (v < vecs) vals[k][u] = *reinterpret_cast<const Vec16*>(row + 16ll * v);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (k < copies) {
#pragma unroll
                for (int u = 0; u < 2; ++u) {
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        acc[u][2 * w] = __fadd_rn(acc[u][2 * w], bf16_lo(vals[k][u].w[w]));
                        acc[u][2 * w + 1] = __fadd_rn(acc[u][2 * w + 1], bf16_hi(vals[k][u].w[w]));
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int v = v0 + 32 * u;
            if (v < vecs) {
                Vec16 o;
#pragma unroll
                for (int w = 0; w < 4; ++w) o.w[w] = round_bf16(acc[u][2 * w]) | (round_bf16(acc[u][2 * w + 1]) << 16);
                *reinterpret_cast<Vec16*>(z + (long long)t * row_bytes + 16ll * v) = o;
            }
        }
    }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One warp per row, its first lane driving the bulk copies through the warp's buffer.
extern "C" __global__ void __launch_bounds__(512) copy_bulk(const uint8_t* src, uint8_t* out, const int* dest,
                                                            int rows, int row_bytes, int copies) {
    extern __shared__ __align__(128) uint8_t stage[];
    __shared__ __align__(8) u64 loaded[16];
    const int warp = threadIdx.x >> 5;
    uint8_t* buffer = stage + (long long)warp * row_bytes;
    const uint32_t bar = smem_addr(&loaded[warp]);
    if ((threadIdx.x & 31) != 0) return;
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    uint32_t parity = 0;
    for (int r = blockIdx.x * (blockDim.x >> 5) + warp; r < rows; r += gridDim.x * (blockDim.x >> 5)) {
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the buffer's last stores read it
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(row_bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_addr(buffer)), "l"(src + (long long)r * row_bytes), "r"(row_bytes), "r"(bar)
                     : "memory");
        uint32_t done = 0;
        while (!done) {
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        }
        parity ^= 1u;
        for (int k = 0; k < copies; ++k) {
            uint8_t* row = out + (long long)dest[(long long)r * copies + k] * row_bytes;
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"(row), "r"(smem_addr(buffer)), "r"(row_bytes) : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def _time_us(launch: Callable[[], None], repeats: int) -> float:
    """Median of ``repeats`` launches between CUDA events, after 3 untimed ones."""
    samples = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples[3:])


def _measure(kernel, inputs: tuple, out: torch.Tensor, want: torch.Tensor, sms: int, shared: int,
             repeats: int) -> float:
    """Check one launch of ``kernel(*inputs)`` on ``sms`` blocks against ``want``, then time it (us)."""
    params = KernelParams([ctypes.c_void_p] * 3 + [ctypes.c_int] * 3).fill(inputs)

    def launch() -> None:
        kernel.launch(sms, THREADS, params, shared_bytes=shared)

    out.zero_()
    launch()
    torch.cuda.synchronize()
    if not torch.equal(out, want):
        raise SystemExit(f"{kernel.entry} at {sms} SMs: wrong rows")
    return _time_us(launch, repeats)


def _write(rows: list[dict], meta: dict, out_dir: Path, name: str) -> None:
    """``<name>.md`` (table), ``.json`` (meta and rows) and ``.png`` (GB/s per SM against SMs; needs matplotlib)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# {name}", ""] + [f"- {key}: {value}" for key, value in meta.items()] + [
        "", "| kernel | SMs | us | GB/s | GB/s per SM |", "|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['sms']} | {r['us']:.1f} | {r['gb_s']:.0f} | {r['gb_s_per_sm']:.1f} |"
              for r in rows]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == kernel]
        ax.plot([r["sms"] for r in mine], [r["gb_s_per_sm"] for r in mine], marker="o", label=kernel)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("SMs (one 512-thread block each)")
    ax.set_ylabel("GB/s per SM (bytes read + written)")
    ax.set_title(f"{meta['rows']} rows x {meta['copies']} copies, {meta['device']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--copies", type=int, default=8, help="destination rows per source row, 1 to 8")
    parser.add_argument("--sms", type=int, nargs="+", default=[132, 64, 24, 16, 8, 4])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--name", default="row-copy")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    row_bytes = 2 * args.hidden
    if row_bytes % 16 or row_bytes * (THREADS // 32) > 227 * 1024:
        raise SystemExit(f"--hidden: expected rows of a multiple of 16 B, 16 of them within 227 KiB; got "
                         f"{args.hidden} ({row_bytes} B)")
    if not 1 <= args.copies <= 8:
        raise SystemExit(f"--copies: expected 1 to 8 (the sum kernel loads up to 8 rows at once), got {args.copies}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_row_copy.py times GPU kernels: it needs a CUDA GPU, and torch sees none")
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(args.rows, args.hidden, device=device, generator=generator).to(torch.bfloat16)
    dest = torch.randperm(args.rows * args.copies, device=device, generator=generator).to(torch.int32)
    expanded = torch.empty(args.rows * args.copies, args.hidden, dtype=torch.bfloat16, device=device)
    expanded[dest.long()] = src.repeat_interleave(args.copies, dim=0)
    summed = torch.zeros(args.rows, args.hidden, dtype=torch.float32, device=device)
    for k in range(args.copies):  # the sum kernel's order: k increasing, float32 adds
        summed = summed + expanded[dest.view(args.rows, args.copies)[:, k].long()].float()
    summed = summed.to(torch.bfloat16)

    def load(entry: str):
        return driver.load_function(device, "row_copy", entry, {"VPL": 4}, source=SOURCE)

    # (label, kernel, source rows, output, expected output, dynamic shared memory)
    cases = [("vector", load("copy_vector"), src, torch.empty_like(expanded), expanded, 0),
             ("bulk", load("copy_bulk"), src, torch.empty_like(expanded), expanded, row_bytes * (THREADS // 32)),
             ("sum (combine's shape)", load("sum_vector"), expanded, torch.empty_like(summed), summed, 0)]
    moved = args.rows * row_bytes * (1 + args.copies)
    rows = []
    for label, kernel, source, out, want, shared in cases:
        for sms in args.sms:
            inputs = (source.data_ptr(), out.data_ptr(), dest.data_ptr(), args.rows, row_bytes, args.copies)
            us = _measure(kernel, inputs, out, want, sms, shared, args.repeats)
            rows.append({"kernel": label, "sms": sms, "us": us, "gb_s": moved / us / 1e3,
                         "gb_s_per_sm": moved / us / 1e3 / sms})
            print(f"| {label} | {sms} | {us:.1f} | {moved / us / 1e3:.0f} | {moved / us / 1e3 / sms:.1f} |")
    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": args.rows,
            "row_bytes": row_bytes, "copies": args.copies, "bytes_moved": moved, "repeats": args.repeats}
    _write(rows, meta, args.out, args.name)


if __name__ == "__main__":
    main()
