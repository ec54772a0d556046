"""Contract of moe_comm.protocol: the one source of the values Python and the kernels share (CPU).

The kernels see these values only through the generated ``protocol.cuh``: no file in ``csrc``
may define one of them again, every protocol name the kernels use must come from the header,
and a changed value must change the compile cache key (so it recompiles).
"""

from __future__ import annotations

import re

import pytest
import torch

from moe_comm import protocol
from moe_comm.cuda import jit
from moe_comm.assets import asset_dir

_DEFINE = re.compile(r"^\s*#\s*define\s+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
_PROTOCOL_PREFIXES = ("TIMEOUT_", "STATUS_", "FLAG_", "SLOT_", "STATE_", "CH_")


def _protocol_values() -> dict[str, int]:
    """Every int constant protocol exports, by name."""
    return {name: getattr(protocol, name) for name in protocol.__all__ if type(getattr(protocol, name)) is int}


def _header_defines(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#define ([A-Za-z_][A-Za-z0-9_]*) (.+)$", text, re.MULTILINE))


def _csrc_texts() -> dict[str, str]:
    return {entry.name: entry.read_text(encoding="utf-8") for entry in asset_dir("csrc").iterdir()
            if entry.name.endswith((".cu", ".cuh"))}


def test_the_header_defines_every_protocol_value():
    text = protocol.cuda_header()
    assert text.splitlines()[2] == "#pragma once"
    defined = _header_defines(text)
    values = _protocol_values()
    assert values, "protocol exports no constants"
    for name, value in values.items():
        assert name in defined, f"protocol.cuh lacks {name}"
        literal = defined[name].removesuffix("ULL").removesuffix("LL")
        assert int(literal) == value, f"protocol.cuh has {name} {defined[name]}, not {value}"
    assert defined["NO_OFFENDER"] == f"{(1 << 63) - 1}LL"
    assert "META_WORDS" in defined
    assert protocol.cuda_header() == text, "the header text must be deterministic"


def test_metadata_rows_hold_a_16_byte_entry_per_column():
    # Two tagged u64 words (expert id, weight) per column k, so rows and entries stay 16-byte aligned.
    assert [protocol.meta_words(k) for k in (1, 2, 3, 8, 32)] == [4, 8, 12, 32, 128]
    assert all(protocol.meta_words(k) * 4 % 16 == 0 for k in range(1, protocol.MAX_TOPK + 1))


def test_no_csrc_file_defines_a_protocol_name():
    owned = set(_header_defines(protocol.cuda_header()))
    texts = _csrc_texts()
    assert {"common.cuh", "dispatch.cu", "combine.cu"} <= set(texts)
    assert "protocol.cuh" not in texts, "protocol.cuh is generated, not a file in csrc"
    for name, text in texts.items():
        again = owned & set(_DEFINE.findall(text))
        assert not again, f"csrc/{name} defines {sorted(again)}, which moe_comm.protocol owns"


def test_every_protocol_name_csrc_uses_comes_from_the_header():
    defined = set(_header_defines(protocol.cuda_header()))
    pattern = re.compile(r"\b((?:" + "|".join(_PROTOCOL_PREFIXES) + r")[A-Z0-9_]+)\b")
    used = {name for text in _csrc_texts().values() for name in pattern.findall(text)}
    assert {"TIMEOUT_GRID_BARRIER", "STATUS_NUM_DROPPED", "FLAG_CHUNK", "SLOT_COMBINE_SEND", "STATE_DONE"} <= used
    assert used <= defined, f"used in csrc but not in protocol.cuh: {sorted(used - defined)}"


def test_common_header_includes_the_protocol():
    assert '#include "protocol.cuh"' in _csrc_texts()["common.cuh"]


def _status(**fields) -> list[int]:
    values = [0] * protocol.STATUS_FIELDS
    for field in ("FIRST_INVALID", "FIRST_DROPPED", "FIRST_INVALID_CALL", "FIRST_DROPPED_CALL"):
        values[getattr(protocol, f"STATUS_{field}")] = protocol.NO_OFFENDER
    for name, value in fields.items():
        values[getattr(protocol, f"STATUS_{name.upper()}")] = value
    return values


def test_a_clear_status_decodes_to_nothing():
    assert protocol.new_status(torch.device("cpu")).tolist() == _status()
    report = protocol.decode_status(_status())
    assert report == protocol.StatusReport(0, None, None, 0, None, None, None, None) and report.ok


@pytest.mark.parametrize("field, value, expected", [
    ("num_invalid", 3, {"num_invalid": 3}),
    ("first_invalid", (2 << 32) | 7, {"first_invalid": (2, 7)}),
    ("num_dropped", 5, {"num_dropped": 5}),
    ("first_dropped", (1 << 32) | 0xFFFFFFFF, {"first_dropped": (1, 0xFFFFFFFF)}),
    ("first_invalid_call", 12, {"first_invalid_call": 12}),
    ("first_dropped_call", 1, {"first_dropped_call": 1}),
])
def test_each_counted_field_decodes(field, value, expected):
    report = protocol.decode_status(_status(**{field: value}))
    clear = {"num_invalid": 0, "first_invalid": None, "first_invalid_call": None, "num_dropped": 0,
             "first_dropped": None, "first_dropped_call": None, "timeout_phase": None, "timeout_peer": None}
    assert report == protocol.StatusReport(**{**clear, **expected})


@pytest.mark.parametrize("phase", sorted(protocol.TIMEOUT_PHASES))
def test_every_timeout_phase_decodes_with_its_peer(phase):
    report = protocol.decode_status(_status(timeout_phase=phase, timeout_peer=3))
    assert report.timeout_phase == protocol.TIMEOUT_PHASES[phase] and report.timeout_peer == 3
    assert not report.ok


def test_an_unknown_phase_is_named_by_its_code_and_a_peer_without_a_phase_is_ignored():
    assert protocol.decode_status(_status(timeout_phase=99, timeout_peer=1)).timeout_phase == "phase 99"
    assert protocol.decode_status(_status(timeout_peer=1)).timeout_peer is None


def test_timeout_phases_name_every_timeout_code():
    codes = {value for name, value in _protocol_values().items() if name.startswith("TIMEOUT_")}
    assert codes == set(protocol.TIMEOUT_PHASES)


def test_status_report_is_public_from_its_home():
    import moe_comm

    assert moe_comm.StatusReport is protocol.StatusReport


def test_regions_are_aligned_and_sized_by_the_protocol():
    regions = protocol.SymmetricRegions.plan(3, 10, 5, 2048, put_transport=True)
    offsets = [regions.flags_offset, regions.meta_offset, regions.ret_vals_offset, regions.recv_x_offset,
               regions.ret_x_offset, regions.stage_x_offset, regions.nbytes]
    assert offsets == sorted(offsets) and all(o % protocol.REGION_ALIGN == 0 for o in offsets)
    assert regions.meta_offset >= protocol.CHANNELS * protocol.FLAG_KINDS * 3 * 8
    assert regions.meta_words == protocol.meta_words(5) == 20


def test_two_slab_copies_sit_copy_stride_apart():
    """Copy 1 of the four receive slabs repeats copy 0's layout copy_stride bytes further; stage_x
    (one call's staging) and the flags have one copy; one slab copy has stride 0."""
    one = protocol.SymmetricRegions.plan(3, 10, 5, 2048, put_transport=True, slab_copies=1)
    two = protocol.SymmetricRegions.plan(3, 10, 5, 2048, put_transport=True, slab_copies=2)
    assert one.copy_stride == 0 and two.slab_copies == 2
    slabs = ("meta_offset", "ret_vals_offset", "recv_x_offset", "ret_x_offset")
    assert all(getattr(one, name) == getattr(two, name) for name in slabs)
    slab_rows_bytes = 3 * 10 * 2048
    assert two.copy_stride >= 2 * slab_rows_bytes + 3 * 10 * (12 + 5) * 4
    assert two.copy_stride % protocol.REGION_ALIGN == 0
    # Copy 1 ends where stage_x starts: the copies do not overlap each other or the staging slab.
    assert two.ret_x_offset + two.copy_stride + slab_rows_bytes <= two.stage_x_offset
    assert two.stage_x_offset - one.stage_x_offset == two.copy_stride
    assert two.nbytes - one.nbytes == two.copy_stride
    with pytest.raises(ValueError, match="slab_copies"):
        protocol.SymmetricRegions.plan(3, 10, 5, 2048, slab_copies=3)


def test_a_changed_protocol_value_changes_the_compile_cache_key(tmp_path, monkeypatch):
    """The generated header is hashed with the csrc headers, so a new value is a new cache entry."""
    monkeypatch.setenv("MOE_COMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "nvrtc_version", lambda: (12, 0))
    compiled = []

    def fake_compile(name, source, headers, options):
        compiled.append(headers["protocol.cuh"])
        return b"\x7fELF"

    monkeypatch.setattr(jit, "_nvrtc_compile", fake_compile)
    source = '#include "common.cuh"\n'
    defines = {"DTYPE": "bf16", "HIDDEN": 64, "TOPK": 2}
    first = jit.compile_source("probe", arch="sm_90", defines=defines, source=source)
    assert jit.compile_source("probe", arch="sm_90", defines=defines, source=source) == first
    monkeypatch.setattr(protocol, "MAX_CHUNKS", protocol.MAX_CHUNKS + 1)
    second = jit.compile_source("probe", arch="sm_90", defines=defines, source=source)
    assert second != first and len(compiled) == 2
    assert "#define MAX_CHUNKS 5" in compiled[1] and "#define MAX_CHUNKS 4" in compiled[0]
