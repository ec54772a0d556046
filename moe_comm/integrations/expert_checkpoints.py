"""Checkpoints of a transformers model made expert-parallel (:func:`.transformers.expert_parallel`).

Each rank holds only its experts' slices, so two things a user does with a model go wrong unless
the model knows which experts it holds:

- **Saving.** transformers' ``save_pretrained`` writes ``model.state_dict()`` from one process: half
  the experts under a config that counts them all. :func:`save_pretrained` (installed as the
  model's own ``save_pretrained``) gathers every sliced parameter to rank 0 of the group, in
  rank order (global expert ``e`` lives on rank ``e // E_local``: concatenating the slices along
  dim 0 restores the unmodified layout), and writes it through transformers in its own format,
  so ``from_pretrained`` of the unmodified model class loads it.
- **Loading.** ``model.load_state_dict`` of another rank's state dict matches every key and shape.
  Every experts module carries a persistent buffer ``moe_comm_expert_ids`` (``[E_local]`` int64,
  the global ids of its slices) in its state dict, and a load pre-hook refuses a state dict whose
  ids differ from the ones this rank holds, or that carries sliced experts without ids.
"""

from __future__ import annotations

import os
from typing import Union

import torch
import torch.distributed as dist
from torch import nn

from ..dispatcher import Dispatcher
from ..errors import InputError

__all__ = ["EXPERT_IDS", "attach_expert_ids", "gathered_state_dict", "save_pretrained"]

EXPERT_IDS = "moe_comm_expert_ids"


def attach_expert_ids(module: nn.Module, sliced: list[str], first: int, num_local: int) -> None:
    """Mark ``module`` as holding global experts ``[first, first + num_local)`` in its parameters ``sliced``.

    Registers the persistent ``moe_comm_expert_ids`` buffer (int64, on the experts' device) and the
    load pre-hook that checks it.
    """
    device = getattr(module, sliced[0]).device
    module.register_buffer(EXPERT_IDS, torch.arange(first, first + num_local, device=device), persistent=True)
    module._moe_comm_sliced = tuple(sliced)
    module._moe_comm_expert_range = (first, num_local)
    module._register_load_state_dict_pre_hook(_check_expert_ids, with_module=True)


def _check_expert_ids(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Refuse a state dict of other experts than ``module`` holds (a load pre-hook of ``module``).

    Raises:
        InputError: naming the key, the ids this rank holds and the ids that came.
    """
    first, num_local = module._moe_comm_expert_range
    key = prefix + EXPERT_IDS
    if key not in state_dict:
        present = [prefix + name for name in module._moe_comm_sliced if prefix + name in state_dict]
        if present:
            raise InputError(
                f"load_state_dict: {present[0]} comes without {key}: not a state dict of this expert-parallel "
                f"model (rank holding experts {first}..{first + num_local - 1}); load a state dict this rank saved, "
                f"or one whose {key} says which experts its slices hold (here torch.arange({first}, "
                f"{first + num_local})), or a whole checkpoint with from_pretrained before expert_parallel"
            )
        return
    ids = state_dict[key].tolist() if isinstance(state_dict[key], torch.Tensor) else state_dict[key]
    mine = list(range(first, first + num_local))
    if ids != mine:
        raise InputError(
            f"load_state_dict: {key} holds experts {ids}, but this rank holds experts {mine}: the state dict is "
            "another rank's (or of another world size); load each rank's own state dict, or save with "
            "save_pretrained and load the whole checkpoint with from_pretrained before expert_parallel"
        )


def _sliced_keys(model: nn.Module) -> set[str]:
    """The state-dict keys of every parameter sliced to this rank's experts."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() if hasattr(module, "_moe_comm_sliced")
            for name in module._moe_comm_sliced}


def gathered_state_dict(model: nn.Module, dispatcher: Dispatcher) -> dict[str, torch.Tensor]:
    """The unmodified model's state dict on rank 0 of the dispatcher's group (CPU tensors); ``{}`` on the others.

    Collective: every rank of the group calls it. Sliced experts' parameters are gathered to
    rank 0 one at a time (``[E_local, ...]`` from each rank -> ``[E, ...]``); the id buffers are
    left out. Rank 0 holds the whole checkpoint in CPU memory.
    """
    sliced = _sliced_keys(model)
    state = model.state_dict()
    dst = dist.get_global_rank(dispatcher.group, 0) if dispatcher.group is not None else 0
    root = dispatcher.rank == 0
    gathered = {}
    for key, tensor in state.items():
        if key.rsplit(".", 1)[-1] == EXPERT_IDS:
            continue
        if key in sliced:
            piece = tensor.detach().contiguous()
            pieces = [torch.empty_like(piece) for _ in range(dispatcher.world_size)] if root else None
            dist.gather(piece, pieces, dst=dst, group=dispatcher.group)
            if root:
                gathered[key] = torch.cat(pieces).cpu()
        elif root:
            gathered[key] = tensor.detach().cpu()
    return gathered


def save_pretrained(model: nn.Module, save_directory: Union[str, os.PathLike], **kwargs) -> None:
    """Write the whole model (every expert) as transformers' ``save_pretrained`` of the unmodified model would.

    Collective over the dispatcher's group; rank 0 writes. ``kwargs`` go to transformers'
    ``save_pretrained`` (``max_shard_size``, ``safe_serialization``, ...); ``state_dict`` and
    ``is_main_process`` are this function's to set.

    Raises:
        InputError: ``state_dict`` or ``is_main_process`` passed.
    """
    taken = sorted({"state_dict", "is_main_process"} & set(kwargs))
    if taken:
        raise InputError(f"save_pretrained of an expert-parallel model: {taken} are set by moe_comm (it gathers "
                         "every rank's experts and writes on rank 0); leave them out")
    dispatcher: Dispatcher = model.moe_comm_dispatcher
    state = gathered_state_dict(model, dispatcher)
    if dispatcher.rank == 0:
        # The class's own method: the instance's save_pretrained is this function.
        type(model).save_pretrained(model, save_directory, state_dict=state, **kwargs)
    # The other ranks must not read the directory before rank 0 has written it.
    dist.barrier(group=dispatcher.group)
