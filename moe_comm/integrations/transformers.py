"""HuggingFace transformers (5.x): make a loaded MoE model expert-parallel through moe_comm in one call.

transformers routes the experts of every MoE family decorated with ``@use_experts_implementation``
(Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, gpt-oss, ...) through one interface: the
experts module, holding ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` for every expert, is
called as ``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])`` and its forward
is looked up by name (``config._experts_implementation``) in ``ExpertsInterface``.
:func:`expert_parallel` registers the name ``"moe_comm"`` there, keeps on each rank only its
experts' weights and selects that name for the model: the experts' forward becomes dispatch ->
this rank's experts -> combine. The router and any shared experts are the model's own, untouched.
Llama 4 (text), DBRX and JetMoE, whose experts are outside that interface, get their MoE blocks
adapted instead (:mod:`.transformers_blocks`). Every rank must make the same forward calls (the
dispatches are collective). ``model.save_pretrained`` becomes collective and writes every expert,
and a state dict of another rank's experts is refused (:mod:`.expert_checkpoints`).

Loading only this rank's experts from a checkpoint: ``from_pretrained`` loads every weight. Load
on the CPU (``device_map="cpu"``, the default), call :func:`expert_parallel` (which keeps this
rank's slices and drops the rest), then ``model.to(device)``: the GPU never holds the other
experts. On a host with too little CPU memory for the whole model, build the model on the meta
device (``with torch.device("meta"): model = AutoModelForCausalLM.from_config(config)``), call
:func:`expert_parallel` (with ``dtype=``: meta tensors carry the config's dtype),
``model.to_empty(device=...)``, build the modules with non-persistent buffers again (``to_empty``
leaves them uninitialised and no checkpoint holds them: e.g. ``model.model.rotary_emb``), and load
this rank's tensors from the checkpoint's safetensors files with
``safe_open(...).get_slice(name)[first:first + E_local]`` for the experts' weights (global expert
``e`` lives on rank ``e // E_local``) and whole for the rest.
"""

from __future__ import annotations

import functools
import os
from typing import Union

import torch
from torch import nn

from ..config import DTYPES, Config, load_config
from ..dispatcher import Dispatcher
from ..errors import ConfigError
from ..nn.experts import expert_of_rows, resolve_expert_impl
from .expert_calls import check_experts_call, dispatched, segmented_linear
from .expert_checkpoints import attach_expert_ids, save_pretrained

__all__ = ["IMPLEMENTATION", "expert_parallel", "save_pretrained"]

IMPLEMENTATION = "moe_comm"
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


# Set on every experts class by transformers' ``@use_experts_implementation`` (``has_post_expert_norm``
# only by newer 5.x releases: absent means no norm).
_LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed")


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules transformers dispatches by ``_experts_implementation`` (its decorator sets the flags)."""
    return [m for m in model.modules() if all(hasattr(m, flag) for flag in _LAYOUT_FLAGS)]


def _expected_shapes(module: nn.Module, hidden: int) -> dict[str, tuple]:
    """Every per-expert parameter of ``module`` and the shape its flags and ``hidden`` call for."""
    experts, ffn = module.down_proj.shape[0], _ffn_hidden(module)
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    up_width = 2 * ffn if module.has_gate else ffn
    shapes = {
        up_name: (experts, hidden, up_width) if module.is_transposed else (experts, up_width, hidden),
        "down_proj": (experts, ffn, hidden) if module.is_transposed else (experts, hidden, ffn),
    }
    if module.has_bias:
        shapes.update({f"{up_name}_bias": (experts, up_width), "down_proj_bias": (experts, hidden)})
    return shapes


def _check_layout(module: nn.Module, hidden: int) -> list[str]:
    """The names of ``module``'s per-expert parameters, after checking them against its layout flags.

    Raises:
        ConfigError: naming the experts class, when a parameter its flags call for is missing or
            has the wrong shape.
    """
    name = type(module).__name__
    shapes = _expected_shapes(module, hidden)
    missing = [key for key in shapes if not isinstance(getattr(module, key, None), nn.Parameter)]
    if missing or (_has_post_norm(module) and not callable(getattr(module, "post_expert_norm", None))):
        raise ConfigError(
            f"expert_parallel: experts class {name} has a layout moe_comm cannot handle: its flags call for "
            f"parameters {list(shapes)}{' and post_expert_norm' if _has_post_norm(module) else ''}, "
            f"missing {missing or ['post_expert_norm']}"
        )
    wrong = [f"{key} {tuple(getattr(module, key).shape)} (expected {shape})" for key, shape in shapes.items()
             if tuple(getattr(module, key).shape) != shape]
    if wrong:
        raise ConfigError(f"expert_parallel: {name} weights of the wrong shape: {', '.join(wrong)}")
    return list(shapes)


def _has_post_norm(module: nn.Module) -> bool:
    return getattr(module, "has_post_expert_norm", False)


def _down_proj(module: nn.Module) -> nn.Parameter:
    """``module.down_proj``, which every layout this integration handles has: ``[experts, ., .]``."""
    down = getattr(module, "down_proj", None)
    if not isinstance(down, nn.Parameter) or down.dim() != 3:
        got = tuple(down.shape) if isinstance(down, torch.Tensor) else type(down).__name__
        raise ConfigError(f"expert_parallel: experts class {type(module).__name__} has a layout moe_comm cannot "
                          f"handle: expected a 3-d down_proj parameter [experts, ., .], got {got}")
    return down


def _ffn_hidden(module: nn.Module) -> int:
    """The experts' intermediate width F (the down projection's input width)."""
    return module.down_proj.shape[1 if module.is_transposed else 2]


def _local_experts(module: nn.Module, rows: torch.Tensor, expert_offsets: torch.Tensor, grouped: bool) -> torch.Tensor:
    """The transformers experts ``module`` (this rank's slice) on dispatch's expert-major ``rows [N, H]``.

    Up (or gate/up) projection, the module's own gate (``_apply_gate``: concatenated or
    interleaved halves, its clamps) or activation, down projection, optional post-expert norm;
    graph-capturable (nothing read on the host). Rows past the last segment come out zero.
    """
    expert_of_row = expert_of_rows(expert_offsets, rows.shape[0])
    # Rows past the last segment are unspecified (possibly NaN): zero them before any arithmetic.
    inputs = torch.where(expert_of_row < module.down_proj.shape[0], rows, torch.zeros_like(rows))
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    hidden = segmented_linear(inputs, getattr(module, up_name), getattr(module, f"{up_name}_bias", None)
                              if module.has_bias else None, module.is_transposed, expert_offsets, expert_of_row,
                              grouped)
    hidden = module._apply_gate(hidden) if module.has_gate else module.act_fn(hidden)
    out = segmented_linear(hidden, module.down_proj, module.down_proj_bias if module.has_bias else None,
                           module.is_transposed, expert_offsets, expert_of_row, grouped)
    if _has_post_norm(module):
        out = torch.where(expert_of_row < module.down_proj.shape[0], module.post_expert_norm(out), out)
    return out.to(rows.dtype)


def _moe_comm_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``"moe_comm"`` experts implementation: ``[T, H]`` -> dispatch -> local experts -> combine -> ``[T, H]``."""
    dispatcher: Dispatcher = self._moe_comm_dispatcher
    check_experts_call(self, dispatcher, hidden_states)
    grouped = resolve_expert_impl(dispatcher.config, hidden_states.device, _ffn_hidden(self)) == "grouped_mm"
    return dispatched(self, hidden_states, top_k_index, top_k_weights,
                      lambda rows, offsets: _local_experts(self, rows, offsets, grouped))


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, _moe_comm_experts_forward)


def _dtype_name(dtype: torch.dtype) -> str:
    """The config's name of the experts' ``dtype``; ConfigError for one moe_comm does not move."""
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(f"expert_parallel: experts in {dtype}; moe_comm moves {', '.join(DTYPES)}")
    return _DTYPE_NAMES[dtype]


def _model_shape(model: nn.Module, modules: list[nn.Module]) -> dict:
    """``num_experts``, ``topk``, ``hidden`` and ``dtype`` of the model's experts."""
    config = modules[0].config
    topk = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None)
    if topk is None:
        raise ConfigError(f"expert_parallel: {type(config).__name__} names no top-k (num_experts_per_tok)")
    sizes = {(_down_proj(m).shape[0], m.down_proj.dtype) for m in modules}
    if len(sizes) != 1:
        raise ConfigError(f"expert_parallel: the model's experts modules differ in expert count or dtype: {sizes}")
    ((experts, dtype),) = sizes
    return dict(num_experts=int(experts), topk=int(topk), hidden=int(config.hidden_size), dtype=_dtype_name(dtype))


def _blocks_shape(blocks: list) -> dict:
    """``num_experts``, ``topk`` (the dispatcher's), ``hidden`` and ``dtype`` of the adapted MoE blocks."""
    shapes = {family.shape(block) for block, family in blocks}
    if len(shapes) != 1:
        raise ConfigError(f"expert_parallel: the model's MoE blocks differ in experts, top-k, width or dtype: {shapes}")
    ((experts, topk, hidden, dtype),) = shapes
    return dict(num_experts=int(experts), topk=int(topk), hidden=int(hidden), dtype=_dtype_name(dtype))


def expert_parallel(
    model: nn.Module,
    config: Union[None, Config, str, os.PathLike] = None,
    *,
    group=None,
    **overrides,
) -> nn.Module:
    """Make ``model`` expert-parallel over ``group`` in place; returns it.

    Collective: every rank of ``group`` calls it on the same model (same weights), in the same
    order. Global expert ``e`` lives on rank ``e // (E / world_size)``; each rank keeps those
    experts' weights (their other slices are freed) and every MoE layer's experts forward
    dispatches its tokens to the ranks of their experts, runs this rank's experts on what it
    received and combines the results back. One :class:`moe_comm.Dispatcher` serves every layer:
    ``model.moe_comm_dispatcher`` (``check()`` it between steps, ``close()`` it when done).
    ``model.save_pretrained`` (when the model has one) is replaced by the collective
    :func:`save_pretrained`, and each experts module's state dict carries its expert ids.

    Args:
        model: a loaded transformers model whose experts use transformers' experts interface, or
            with MoE blocks of a family :mod:`.transformers_blocks` adapts (Llama 4 text, DBRX, JetMoE).
        config: a moe_comm :class:`Config`, a YAML path, or None for the embedded default;
            ``num_experts``, ``topk``, ``hidden`` and ``dtype`` are taken from the model (an
            override wins: ``dtype="bfloat16"`` for a model that is converted afterwards).
        group: the expert-parallel process group (None: the default group).
        overrides: config keys, as for :func:`moe_comm.load_config` (e.g. ``max_tokens_per_rank``:
            at least the tokens of one forward on one rank, ``batch x sequence``; ``backend``).

    Raises:
        ConfigError: the model has no such experts module, an experts class has a layout this
            cannot handle or weights of the wrong shape, or the world size does not divide the experts.
    """
    # Imported here: the block families build on this module's helpers.
    from .transformers_blocks import BLOCK_FAMILIES, find_blocks, keep_local

    if hasattr(model, "moe_comm_dispatcher"):
        raise ConfigError(f"expert_parallel: this {type(model).__name__} is expert-parallel already")
    modules, blocks = _experts_modules(model), find_blocks(model)
    if not modules and not blocks:
        raise ConfigError(f"expert_parallel: {type(model).__name__} has no MoE experts module using transformers' "
                          f"experts interface (@use_experts_implementation) nor an MoE block moe_comm adapts "
                          f"({', '.join(BLOCK_FAMILIES)}); bring its experts to moe_comm.MoELayer with MoEWeights")
    shape = _model_shape(model, modules) if modules else _blocks_shape(blocks)
    names = {id(m): _check_layout(m, shape["hidden"]) for m in modules}
    if isinstance(config, Config):
        config = config.to_dict()
    moe_config = load_config(config, **{**shape, **overrides})
    dispatcher = Dispatcher(moe_config, group)
    local = dispatcher.num_local_experts
    first = dispatcher.rank * local
    if modules:
        _register()
        model.config._experts_implementation = IMPLEMENTATION
    for module in modules:
        with torch.no_grad():
            for name in names[id(module)]:
                kept = getattr(module, name).detach()[first:first + local].clone()
                setattr(module, name, nn.Parameter(kept, requires_grad=getattr(module, name).requires_grad))
        module.num_experts = local
        attach_expert_ids(module, names[id(module)], first, local)
        module._moe_comm_dispatcher = dispatcher
        module._moe_comm_call_site = dispatcher.new_call_site()  # modules in model order: the same on every rank
        module.config._experts_implementation = IMPLEMENTATION
    for block, family in blocks:
        keep_local(block, family, dispatcher)
    model.moe_comm_dispatcher = dispatcher
    if hasattr(model, "save_pretrained"):
        model.save_pretrained = functools.partial(save_pretrained, model)
    return model
