"""moe_comm.gemm_sm_carveout (contract: SM budget): what it sets, that it restores it, and its errors.

torch's settings are replaced by recorders here (a CPU build of torch has no cuBLASLt); the GPU
overlap test runs the real ones.
"""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import InputError


@pytest.fixture
def torch_settings(monkeypatch):
    state = {"library": "cublas", "carveout": None}
    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: state["carveout"], raising=False)
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental",
                        lambda value: state.update(carveout=value), raising=False)

    def library(backend=None):
        if backend is not None:
            state["library"] = backend
        return state["library"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", library)
    return state


def test_carveout_sets_cublaslt_and_restores_on_exit_and_on_error(torch_settings):
    with moe_comm.gemm_sm_carveout(24):
        assert torch_settings == {"library": "cublaslt", "carveout": 24}
    assert torch_settings == {"library": "cublas", "carveout": None}
    torch_settings.update(carveout=8)
    with pytest.raises(ZeroDivisionError):
        with moe_comm.gemm_sm_carveout(16):
            1 / 0
    assert torch_settings == {"library": "cublas", "carveout": 8}


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "24", None])
def test_carveout_refuses_what_is_not_a_positive_int(bad, torch_settings):
    with pytest.raises(InputError, match="num_sms: expected a positive int"):
        with moe_comm.gemm_sm_carveout(bad):
            pass
    assert torch_settings == {"library": "cublas", "carveout": None}


def test_carveout_names_a_torch_without_it(monkeypatch):
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental", raising=False)
    with pytest.raises(InputError, match="has no SM carveout"):
        with moe_comm.gemm_sm_carveout(24):
            pass


def test_carveout_names_a_torch_without_cublaslt():
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA (and cuBLASLt)")
    with pytest.raises(InputError, match="cannot use cuBLASLt"):
        with moe_comm.gemm_sm_carveout(24):
            pass
