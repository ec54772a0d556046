"""Config contract: the embedded default, YAML/dict/override loading, and errors that name the key."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import moe_comm
from moe_comm.assets import asset_dir
from moe_comm.config import Config, NcclConfig, default_config_text, load_config
from moe_comm.errors import ConfigError


def test_embedded_default_matches_dataclass_defaults():
    # The YAML shipped in the package and the dataclass defaults must not drift apart.
    assert load_config() == Config()
    assert "backend:" in default_config_text()


@pytest.mark.parametrize("name", sorted(path.name for path in asset_dir("configs").iterdir()
                                         if path.name.endswith(".yaml") and path.name != "default.yaml"))
def test_example_configs_load_and_fit_8_ranks(name):
    # The example configs users start from must stay valid as keys change; 8 ranks is one full node.
    config = load_config(asset_dir("configs").joinpath(name))
    assert config.backend != "auto", f"{name} names its backend: it is an example of one deployment"
    config.check_world(8)
    assert config.capacity_rows(8) > 0


def test_yaml_file_dict_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend: reference\nnum_experts: 8\ntopk: 2\nnccl:\n  transport: symmetric\n")
    cfg = load_config(path, hidden=64)
    assert (cfg.backend, cfg.num_experts, cfg.topk, cfg.hidden) == ("reference", 8, 2, 64)
    assert cfg.nccl == NcclConfig(transport="symmetric")
    assert load_config(str(path)) == load_config({**cfg.to_dict(), "hidden": Config().hidden})
    # A section override merges key by key with the source's section.
    merged = load_config({"nvshmem": {"heap_size_mb": 512}}, nvshmem={"transport": "put"})
    assert (merged.nvshmem.transport, merged.nvshmem.heap_size_mb) == ("put", 512)
    router = load_config({"router": {"score": "sigmoid"}}, router={"n_group": 4, "topk_group": 2}).router
    assert (router.score, router.n_group, router.topk_group, router.renormalize) == ("sigmoid", 4, 2, True)
    assert cfg.torch_dtype is torch.bfloat16
    assert load_config(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"num_expert": 8}, "'num_expert' is unknown"),
        ({"nccl": {"transprt": "collective"}}, "'nccl.transprt' is unknown"),
        ({"num_experts": "8"}, "'num_experts': got '8'"),
        ({"num_experts": 0}, "'num_experts': got 0"),
        ({"topk": 0}, "'topk'"),
        ({"topk": 20, "num_experts": 16}, "at most num_experts"),
        ({"hidden": True}, "'hidden'"),
        ({"hidden": 12, "dtype": "bfloat16"}, "multiple of 16 bytes"),
        ({"dtype": "int8"}, "'dtype': got 'int8'"),
        ({"backend": "mpi"}, "'backend': got 'mpi'"),
        ({"expert_capacity": 0}, "'expert_capacity'"),
        ({"expert_alignment": 0}, "'expert_alignment'"),
        ({"zero_padding": "no"}, "'zero_padding': got 'no', expected true or false"),
        ({"zero_padding": 0}, "'zero_padding': got 0"),
        ({"timeout_s": -1}, "'timeout_s'"),
        ({"timeout_s": float("nan")}, "'timeout_s'"),
        ({"check_every_step": "yes"}, "'check_every_step'"),
        ({"sm_budget": 0}, "'sm_budget': got 0, expected an integer >= 1"),
        ({"sm_budget": 2.5}, "'sm_budget': got 2.5"),
        ({"sm_budget": "24"}, "'sm_budget': got '24'"),
        ({"slab_copies": 3}, "'slab_copies': got 3, expected 1 or 2"),
        ({"slab_copies": True}, "'slab_copies': got True"),
        ({"slab_copies": 2.0}, "'slab_copies': got 2.0"),
        ({"expert_impl": "triton"}, "'expert_impl': got 'triton'"),
        ({"vmm": {"fd_passing": "magic"}}, "'vmm.fd_passing'"),
        ({"nvshmem": {"transport": "ib"}}, "'nvshmem.transport'"),
        ({"nvshmem": {"heap_size_mb": 0}}, "'nvshmem.heap_size_mb'"),
        ({"nccl": "collective"}, "'nccl': got 'collective'"),
        ({"router": {"score": "tanh"}}, "'router.score': got 'tanh'"),
        ({"router": {"scores": "softmax"}}, "'router.scores' is unknown"),
        ({"router": {"score": "sigmoid", "softmax_after_topk": True}}, "'router.softmax_after_topk'"),
        ({"router": {"renormalize": 1}}, "'router.renormalize': got 1"),
        ({"router": {"routed_scaling_factor": 0}}, "'router.routed_scaling_factor': got 0"),
        ({"router": {"n_group": 3}}, "'router.n_group': got 3, expected a divisor of num_experts (16)"),
        ({"router": {"n_group": 4, "topk_group": 5}}, "'router.topk_group': got 5, expected at most router.n_group"),
        ({"router": {"n_group": 8, "topk_group": 1}}, "'router.topk_group': got 1, expected enough groups for topk (4)"),
        ({"router": {"aux_loss_coef": -0.1}}, "'router.aux_loss_coef': got -0.1"),
        ({"router": {"seq_aux_loss_coef": float("inf")}}, "'router.seq_aux_loss_coef'"),
        ({"router": {"z_loss_coef": "1e-3"}}, "'router.z_loss_coef'"),
        ({"router": {"bias_update_rate": -1}}, "'router.bias_update_rate'"),
    ],
)
def test_bad_values_name_the_key(overrides, fragment):
    # One case per validation rule: each must raise ConfigError (also a ValueError) naming the key.
    with pytest.raises(ConfigError) as info:
        load_config(None, **overrides)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("backend: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top-level list"):
        load_config(listing)
    with pytest.raises(ConfigError, match="expected a YAML path, a dict or None"):
        load_config(42)
    # An empty file is refused, not read as "the defaults": it is usually a wrong or truncated file.
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="is empty; write the keys"):
        load_config(empty)


def test_world_dependent_values():
    cfg = load_config(None, num_experts=12, topk=2, max_tokens_per_rank=10, expert_alignment=4)
    cfg.check_world(3)
    with pytest.raises(ConfigError, match="multiple of the world size"):
        cfg.check_world(8)
    # Lossless: 2 sources x 10 tokens x topk 2 entries, plus up to 3 padding rows for each of 6 experts.
    assert cfg.capacity_rows(2) == 2 * 10 * 2 + 6 * 3
    # Capacity 5 rounds up to 8 rows per expert.
    capped = load_config(cfg.to_dict(), expert_capacity=5)
    assert capped.capacity_rows(2) == 6 * 8


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_config().hidden = 7


def test_public_names():
    for name in ("load_config", "Config", "Dispatcher", "MoeCommError", "ConfigError", "InputError"):
        assert hasattr(moe_comm, name)


# Nested aliases: 342 bytes that expand to 9**9 strings (and, in a repr, gigabytes of text).
BILLION_LAUGHS = "\n".join(
    ["a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]"]
    + [f"{chr(ord('a') + n)}: &{chr(ord('a') + n)} [" + ",".join([f"*{chr(ord('a') + n - 1)}"] * 9) + "]"
       for n in range(1, 9)]
) + "\n"


def test_yaml_aliases_are_refused_at_once(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"laughs.yaml', line 1: YAML anchors and aliases .* not allowed"):
        load_config(path)
    assert time.monotonic() - started < 1.0
    path.write_text("num_experts: 8\nhidden: &h 64\n")  # an anchor alone is refused too: configs need none
    with pytest.raises(ConfigError, match="line 2: YAML anchors"):
        load_config(path)


def test_a_huge_value_is_named_in_a_short_message():
    nested = [["lol"] * 1000] * 1000  # a million strings
    started = time.monotonic()
    with pytest.raises(ConfigError, match="'hidden': got ") as info:
        load_config(None, hidden=nested)
    assert len(str(info.value)) < 300 and time.monotonic() - started < 1.0
    with pytest.raises(ConfigError, match="got <an int of 16610 bits>"):
        load_config(None, hidden=10**5000)


def test_an_int_past_pythons_digit_limit_in_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "digits.yaml"
    path.write_text("hidden: " + "1" * 5000 + "\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(path)


# Every key that reaches an int32 kernel parameter or an allocation, one past its bound (topk and
# router.n_group are at most num_experts, checked by their own rules).
@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"num_experts": 2**31, "topk": 1}, "'num_experts': got 2147483648, expected an integer from 1 to 2147483647"),
        ({"hidden": 2**31}, "'hidden': got 2147483648"),
        ({"max_tokens_per_rank": 2**31}, "'max_tokens_per_rank': got 2147483648"),
        ({"expert_alignment": 2**31}, "'expert_alignment': got 2147483648"),
        ({"expert_capacity": 2**31}, "'expert_capacity': got 2147483648"),
        ({"sm_budget": 2**31}, "'sm_budget': got 2147483648"),
        ({"num_senders": 2**31}, "'num_senders': got 2147483648"),
        ({"nvshmem": {"heap_size_mb": 2**20 + 1}}, "'nvshmem.heap_size_mb': got 1048577, expected an integer from 1"),
        ({"timeout_s": 1e10}, "'timeout_s': got 10000000000.0, expected a positive number of seconds, at most 1e+06"),
        # Products of keys in range: the assignments and the dispatch rows are int32 counts in the kernels.
        ({"max_tokens_per_rank": 2**30, "topk": 2}, "'max_tokens_per_rank': got 1073741824, expected a value whose "
                                                   "assignments"),
        ({"expert_alignment": 2**30, "num_experts": 4, "topk": 1}, "dispatch rows"),
        # Within int32 everywhere, but one rank would need 2**30 rows of 2**27 bytes.
        ({"hidden": 2**26, "max_tokens_per_rank": 2**30, "topk": 1}, "one rank needs at least"),
    ],
)
def test_every_out_of_range_value_is_refused_at_load(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, **overrides)
    assert fragment in str(info.value)


def test_the_dispatch_rows_at_the_world_size_are_checked():
    config = load_config(None, num_experts=1024, topk=8, max_tokens_per_rank=2**24, hidden=8)
    config.check_world(8)
    with pytest.raises(ConfigError, match=r"at 16 ranks \(2,147,484,608 rows\) fits the kernels' int32"):
        config.check_world(16)


def test_a_config_past_the_current_devices_memory_is_refused(monkeypatch):
    """Where CUDA is in use (a rank with its device set), one rank's least footprint must fit the device."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=64 << 20))
    load_config(None, hidden=1024, max_tokens_per_rank=1024)  # 2 MiB slab + 8 MiB of rows
    with pytest.raises(ConfigError, match=r"'max_tokens_per_rank'.* over the 67,108,864 bytes of cuda:0"):
        load_config(None, hidden=1024, max_tokens_per_rank=16384)


@pytest.mark.parametrize("old, new, value", [("num_sms", "num_senders", 12), ("experts", "expert_impl", "loop")])
def test_a_renamed_key_still_loads_with_a_warning_naming_the_new_key(tmp_path, old, new, value):
    path = tmp_path / "old.yaml"
    path.write_text(f"{old}: {value}\n")
    for source, overrides in ((str(path), {}), ({old: value}, {}), (None, {old: value})):
        with pytest.warns(DeprecationWarning, match=f"config key '{old}' is deprecated .*use '{new}'"):
            cfg = load_config(source, **overrides)
        assert getattr(cfg, new) == value and old not in cfg.to_dict()
    # An override under the old name replaces the source's value under the new one.
    with pytest.warns(DeprecationWarning):
        assert getattr(load_config({new: getattr(Config, new)}, **{old: value}), new) == value
    with pytest.raises(ConfigError, match=f"'{old}' and '{new}' are both given"):
        load_config({old: value, new: value})
