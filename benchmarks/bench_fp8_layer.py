"""MoELayer with FP8 dispatch against the same layer dispatching config-dtype rows: accuracy and time.

Usage: python benchmarks/bench_fp8_layer.py [--tokens 128 1024 4096] [--name 1xH200-fp8-layer] [--out DIR]

One rank (world 1; ``vmm`` on a GPU, the reference backend on the CPU as a smoke run). For each
token count the two layers (same seed, so the same router and experts) run a forward and a
forward + backward of ``mean(out ** 2)``:

* accuracy: the relative norm of the FP8 layer's output, input gradient and largest expert/router
  weight-gradient error against the config-dtype layer;
* time: on a GPU, the median of CUDA-graph replays of the forward (no grad), of the forward +
  backward, and of ``Dispatcher.dequantize`` alone (the pass that turns the FP8 rows back into the
  experts' dtype); on the CPU, eager wall-clock time.

Writes ``<out>/<name>.json``, ``.md`` and ``.png`` (the plot needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import moe_comm

GPU_SHAPE = dict(hidden=7168, num_experts=32, topk=8, ffn_hidden=1024, dtype="bfloat16", backend="vmm")
CPU_SHAPE = dict(hidden=256, num_experts=8, topk=2, ffn_hidden=64, dtype="float32", backend="reference")


def _median_us(fn: Callable[[], object], repeats: int, gpu: bool) -> float:
    """Median time of ``fn`` in microseconds (CUDA events around each call on a GPU)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000)
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(samples)


def _replayable(fn: Callable[[], object], gpu: bool) -> Callable[[], object]:
    """On a GPU, ``fn`` captured once in a CUDA graph (after two warm-up calls on a side stream) and
    returned as its replay; on the CPU, ``fn`` itself."""
    if not gpu:
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def measure(tokens: int, shape: dict, repeats: int, device: torch.device) -> dict:
    """One token count: the row of the FP8 layer against the config-dtype one (see the module docstring)."""
    gpu = device.type == "cuda"
    base = dict(backend=shape["backend"], num_experts=shape["num_experts"], topk=shape["topk"],
                hidden=shape["hidden"], max_tokens_per_rank=tokens, dtype=shape["dtype"], expert_alignment=16)
    x = torch.randn(tokens, shape["hidden"], generator=torch.Generator().manual_seed(tokens))
    x = x.to(device, getattr(torch, shape["dtype"]))
    row = {"tokens": tokens}
    measured = {}
    for name, dispatch_dtype in (("plain", None), ("fp8", "float8_e4m3fn")):
        layer = moe_comm.MoELayer(moe_comm.load_config(None, **base, dispatch_dtype=dispatch_dtype),
                                  shape["ffn_hidden"], seed=1)
        params = list(layer.parameters())
        leaf = x.clone().requires_grad_()

        def forward_backward():
            for p in params:
                p.grad = None
            leaf.grad = None
            layer(leaf).float().square().mean().backward()

        with torch.no_grad():
            forward = _replayable(lambda: layer(x), gpu)
        row[f"{name}_forward_us"] = _median_us(forward, repeats, gpu)
        row[f"{name}_forward_backward_us"] = _median_us(_replayable(forward_backward, gpu), repeats, gpu)
        if dispatch_dtype is not None:
            disp = layer.dispatcher
            with torch.no_grad():
                out = disp.dispatch(x, layer.last_topk_idx, layer.last_topk_weights)
                row["dequantize_us"] = _median_us(_replayable(lambda: disp.dequantize(out), gpu), repeats, gpu)
                row["dequantized_rows"] = int(out.expert_offsets[-1])
        # Eager, after the graphs: the gradients to compare.
        for p in params:
            p.grad = None
        probe = x.clone().requires_grad_()
        out = layer(probe)
        out.float().square().mean().backward()
        measured[name] = (out.detach(), probe.grad, [p.grad for p in params if p.grad is not None])
        layer.close()
    (out8, grad8, wgrad8), (out0, grad0, wgrad0) = measured["fp8"], measured["plain"]
    row["output_rel_err"] = _relative(out8, out0)
    row["input_grad_rel_err"] = _relative(grad8, grad0)
    row["weight_grad_rel_err"] = max(_relative(a, b) for a, b in zip(wgrad8, wgrad0))
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# MoELayer: FP8 dispatch against config-dtype dispatch", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    lines += ["", "| T | forward (us) plain / FP8 | fwd+bwd (us) plain / FP8 | dequantize (us) | rows | "
              "output err | input grad err | weight grad err |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['plain_forward_us']:.1f} / {r['fp8_forward_us']:.1f} | "
                     f"{r['plain_forward_backward_us']:.1f} / {r['fp8_forward_backward_us']:.1f} | "
                     f"{r['dequantize_us']:.1f} | {r['dequantized_rows']} | {100 * r['output_rel_err']:.2f}% | "
                     f"{100 * r['input_grad_rel_err']:.2f}% | {100 * r['weight_grad_rel_err']:.2f}% |")
    lines += ["", "Errors: relative norm of the difference, FP8 layer against the config-dtype layer "
              "(weight grad: the largest over the parameters)."]
    return "\n".join(lines) + "\n"


def write(rows: list[dict], meta: dict, out_dir: Path, name: str) -> list[Path]:
    """``<name>.json``, ``.md`` and, with matplotlib, ``.png`` under ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    paths[1].write_text(markdown(rows, meta))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    figure, axis = plt.subplots(figsize=(8, 5))
    tokens = [r["tokens"] for r in rows]
    for key, label in (("plain_forward_us", "forward, config dtype"), ("fp8_forward_us", "forward, FP8 dispatch"),
                       ("plain_forward_backward_us", "fwd+bwd, config dtype"),
                       ("fp8_forward_backward_us", "fwd+bwd, FP8 dispatch"), ("dequantize_us", "dequantize alone")):
        axis.plot(tokens, [r[key] for r in rows], marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("tokens")
    axis.set_ylabel("time (us, median)")
    axis.set_title(f"MoELayer, {meta['device']}: FP8 dispatch against {meta['dtype']}")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    paths.append(out_dir / f"{name}.png")
    figure.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(figure)
    return paths


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (default 128 1024 4096; CPU: 16 64)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (default 20)")
    parser.add_argument("--name", default="fp8-layer", help="results file name (default fp8-layer)")
    parser.add_argument("--out", default="benchmarks/results", help="results directory")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    shape = GPU_SHAPE if gpu else CPU_SHAPE
    tokens = args.tokens or ([128, 1024, 4096] if gpu else [16, 64])
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = [measure(t, shape, args.repeats, device) for t in tokens]
    finally:
        dist.destroy_process_group()
    meta = {"device": torch.cuda.get_device_name(device) if gpu else "CPU", "world_size": 1, **shape,
            "timing": "CUDA graph replays" if gpu else "eager wall clock (smoke run)", "repeats": args.repeats}
    for path in write(rows, meta, Path(args.out), args.name):
        print(f"wrote {path}")
    sys.stdout.write(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
