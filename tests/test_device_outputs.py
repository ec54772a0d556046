"""The device backend's dispatch outputs (contract: handles): one allocation, views made on demand.

``_packed_outputs`` carves ``expert_offsets``, ``tokens_per_expert`` and a ``PackedRouting`` out of
one int32 buffer (CPU here: the layout is the same on a GPU). Every piece must have the shape and
dtype of the routing contract, start on a 128-byte line, overlap no other piece, and sit at the
address the kernels are given.
"""

from __future__ import annotations

import pytest
import torch

from moe_comm.backends.device import PackedRouting, _addresses, _packed_outputs, _separate_outputs
from moe_comm.routing import Routing

WORLD, MAX_TOKENS, TOPK, LOCAL = 4, 16, 8, 3


@pytest.mark.parametrize("num_tokens", [0, 1, 5, MAX_TOKENS])
def test_packed_outputs_have_the_contract_shapes_and_do_not_overlap(num_tokens):
    offsets, counts, routing = _packed_outputs(num_tokens, WORLD, MAX_TOKENS, TOPK, LOCAL, torch.device("cpu"))
    assert isinstance(routing, PackedRouting) and routing.num_tokens == num_tokens
    pieces = {
        "expert_offsets": (offsets, (LOCAL,), torch.int32),
        "tokens_per_expert": (counts, (LOCAL,), torch.int32),
        "send_mask": (routing.send_mask, (num_tokens, WORLD), torch.bool),
        "dest_rank": (routing.dest_rank, (num_tokens, TOPK), torch.int32),
        "recv_pos": (routing.recv_pos, (WORLD, MAX_TOKENS, TOPK), torch.int32),
        "recv_weight": (routing.recv_weight, (WORLD, MAX_TOKENS, TOPK), torch.float32),
    }
    spans = []
    for name, (tensor, shape, dtype) in pieces.items():
        assert (tuple(tensor.shape), tensor.dtype, tensor.is_contiguous()) == (shape, dtype, True), name
        if not tensor.numel():
            continue  # an empty view has no address of its own
        # expert_offsets starts the buffer (CUDA allocations start on 512-byte lines; the CPU's on 64).
        assert (tensor.data_ptr() - offsets.data_ptr()) % 128 == 0, f"{name} does not start on a 128-byte line"
        spans.append((tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size(), name))
    spans.sort()
    for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
        assert end <= start, f"{name} overlaps {following}"
    for name, address in _addresses(routing)._asdict().items():
        view = getattr(routing, name)
        if view.numel():  # an empty view has no address of its own
            assert address == view.data_ptr(), name


def test_packed_routing_makes_each_view_once_and_keeps_the_buffer_alive():
    _, _, routing = _packed_outputs(3, WORLD, MAX_TOKENS, TOPK, LOCAL, torch.device("cpu"))
    addresses = routing.addresses
    assert "recv_pos" not in vars(routing), "a view was made before anything asked for it"
    assert routing.recv_pos is routing.recv_pos
    routing.recv_weight.fill_(0.5)
    assert routing.recv_pos.data_ptr() == addresses.recv_pos
    assert torch.all(routing.recv_weight == 0.5)


def test_separate_outputs_are_a_plain_routing_of_their_own_allocations():
    offsets, counts, routing = _separate_outputs(5, WORLD, MAX_TOKENS, TOPK, LOCAL, torch.device("cpu"))
    assert isinstance(routing, Routing) and routing.num_tokens == 5
    tensors = [offsets, counts, routing.send_mask, routing.dest_rank, routing.recv_pos, routing.recv_weight]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    assert _addresses(routing).recv_weight == routing.recv_weight.data_ptr()
