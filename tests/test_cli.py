"""The ``moe-comm`` command line: info, run (the main job), compile, and its errors (contract: CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import moe_comm
from moe_comm import backend_table
from moe_comm.tools import cli, spawn
from moe_comm.tools.job import CHECKED, StepResult

# Subprocesses import the same moe_comm as this test process (the source tree or an install).
_PACKAGE_PARENT = str(Path(moe_comm.__file__).resolve().parent.parent)


def _command() -> list[str]:
    """The installed ``moe-comm`` script when it sits beside this Python (CI installs it), else ``python -m``."""
    script = Path(sys.executable).parent / "moe-comm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "moe_comm"]


def _run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_PARENT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def test_module_help_lists_the_commands():
    result = _run([sys.executable, "-m", "moe_comm", "--help"])
    assert result.returncode == 0, result.stderr
    for command in ("info", "run", "compile"):
        assert command in result.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"moe-comm {moe_comm.__version__} (torch ")


def test_info_lists_every_backend():
    result = _run(_command() + ["info"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in ("vmm", "nvshmem", "nccl", "reference"):
        assert any(line.split()[:1] == [name] and line.split()[1] in ("usable", "no") for line in lines), name
    assert any(line.startswith("  reference  usable") for line in lines)
    assert any(line.startswith("auto -> ") for line in lines)
    assert "torch " in result.stdout
    assert f"moe_comm {moe_comm.__version__} at {Path(moe_comm.__file__).resolve().parent}\n" in result.stdout
    # Every entry of the backend table is listed under its backend, with its mover, memory and reach.
    assert set(cli._PROBES) == set(backend_table.BACKEND_NAMES)
    for entry in backend_table.ENTRIES:
        assert f"    - {entry.id}: {entry.mover.value}; memory: {entry.memory.value}" in result.stdout, entry.id


def test_run_two_cpu_ranks_passes():
    # The README's main job on a CPU machine (fewer tokens than the default to keep CI quick).
    result = _run(_command() + ["run", "--steps", "2", "--ranks", "2", "--tokens", "32", "--backend", "reference"])
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = lines[0].split()
    assert header[:2] == ["step", "tokens"] and "result" in header
    rows = [line.split() for line in lines[1:3]]
    assert [row[0] for row in rows] == ["0", "1"]
    assert all(row[1] == "64" and row[-1] == "pass" for row in rows)  # 2 ranks x 32 tokens
    assert lines[3].startswith("PASS: 2 steps")
    assert "2 CPU ranks, backend reference" in result.stderr


def _step(step: int, rel: float, status: str = "ok") -> StepResult:
    return StepResult(step=step, tokens=8, abs_err={n: rel for n in CHECKED}, rel_err={n: rel for n in CHECKED},
                      dispatch_ms=1.0, combine_ms=1.0, step_ms=3.0, status=status)


def test_run_fails_on_a_wrong_result_or_a_failed_rank(monkeypatch, capsys):
    # Feed the table step results from fake ranks: one over the tolerance, one with a device fault.
    # Step 2 has a NaN on one rank beside a small error on the other: NaN must not hide behind max().
    fake = [[_step(0, 1e-9), _step(1, 0.5), _step(2, float("nan"))],
            [_step(0, 1e-9, "1 expert id(s) outside [0, 16)"), _step(1, 1e-9), _step(2, 1e-9)]]
    monkeypatch.setattr(spawn, "run_ranks", lambda *args, **kwargs: fake)
    assert cli.main(["run", "--backend", "reference", "--steps", "3"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") == 4 and "pass" not in out
    assert "step 0: rank 1: 1 expert id(s) outside" in out
    assert "step 1: relative errors over 0.02" in out
    assert "step 2: relative errors over 0.02" in out and "nan" in out

    def failing(*args, **kwargs):
        raise spawn.RankFailureError("1 of 2 ranks failed:\n--- rank 1 ---\nTraceback: boom", {1: "boom"}, [])

    monkeypatch.setattr(spawn, "run_ranks", failing)
    assert cli.main(["run", "--backend", "reference"]) == 1
    assert "rank 1" in capsys.readouterr().err


def test_bad_config_is_a_clear_usage_error(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert cli.main(["run", "--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err
    bad_key = tmp_path / "bad.yaml"
    bad_key.write_text("num_expert: 8\n")
    assert cli.main(["run", "--config", str(bad_key)]) == 2
    assert "num_expert" in capsys.readouterr().err
    # 16 experts cannot be split over 3 ranks: refused before any rank starts.
    assert cli.main(["run", "--backend", "reference", "--ranks", "3"]) == 2
    assert "multiple of the world size (3)" in capsys.readouterr().err
    assert cli.main(["run", "--backend", "reference", "--tokens", "100000"]) == 2
    assert "--tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--steps", "0"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("timeout", ["nan", "inf", "-1", "0", "1e7", "soon"])
def test_run_timeout_must_be_positive_finite_seconds(timeout, capsys):
    # nan and inf parse as floats; they ended in a traceback from the launcher's timedelta.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--timeout", timeout])
    assert exit_info.value.code == 2
    assert "--timeout: expected" in capsys.readouterr().err


def test_compile_reports_arch_and_nvrtc_errors(monkeypatch, capsys):
    from moe_comm.cuda import jit
    from moe_comm.errors import CompileError

    assert cli.main(["compile", "--arch", "sm_9x"]) == 2
    assert "sm_9x" in capsys.readouterr().err

    def no_nvrtc():
        raise CompileError("NVRTC is not available: Failure finding libnvrtc.so.13; install nvidia-cuda-nvrtc")

    monkeypatch.setattr(jit, "nvrtc_version", no_nvrtc)
    assert cli.main(["compile", "--arch", "sm_90"]) == 1
    assert "NVRTC is not available" in capsys.readouterr().err


@pytest.fixture
def without_nvrtc(monkeypatch):
    """This process as on a host without NVRTC: ``cuda.bindings.nvrtc`` cannot be imported."""
    from moe_comm.cuda import jit

    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)
    bindings = sys.modules.get("cuda.bindings")
    if bindings is not None:
        # `from cuda.bindings import nvrtc` reads the package's attribute before sys.modules.
        monkeypatch.delattr(bindings, "nvrtc", raising=False)
    jit._nvrtc.cache_clear()
    yield
    jit._nvrtc.cache_clear()


@pytest.mark.parametrize("arch, expected", [("sm_75", "sm_80 or newer"), ("sm_9x", "expected a real GPU architecture")])
def test_compile_checks_the_arch_before_nvrtc(without_nvrtc, capsys, arch, expected):
    assert cli.main(["compile", "--arch", "sm_90", "--arch", arch]) == 2
    err = capsys.readouterr().err
    assert f"'{arch}'" in err and expected in err and "NVRTC" not in err, err
    # A supported arch reaches the NVRTC check, which says what is missing.
    assert cli.main(["compile", "--arch", "sm_90"]) == 1
    assert "NVRTC is not available: cuda.bindings.nvrtc cannot be imported" in capsys.readouterr().err


def test_compile_refuses_architectures_older_than_sm80(capsys):
    assert cli.main(["compile", "--arch", "sm_75"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'sm_75'" in err and "sm_80 or newer" in err, err


def test_compile_builds_the_kernels_of_a_config(nvrtc, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOE_COMM_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "deploy.yaml"
    config.write_text("hidden: 2048\ntopk: 6\n")
    assert cli.main(["compile", "--arch", "sm_90", "--config", str(config), "--dtype", "float16"]) == 0
    built = sorted("-".join(path.name.split("-")[:3]) for path in (tmp_path / "cache").glob("*.cubin"))
    assert built == ["combine-f16_hidden2048_topk6-sm90", "dispatch-f16_hidden2048_topk6-sm90"], built
    assert f"the kernels of {config}" in capsys.readouterr().out


def test_compile_takes_several_configs_at_once(tmp_path, monkeypatch, capsys):
    from moe_comm.cuda import jit, kernels

    compiled = []
    monkeypatch.setattr(jit, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(kernels, "compile_for_configs", lambda configs, arch: compiled.append((configs, arch)) or [])
    first, second = tmp_path / "train.yaml", tmp_path / "serve.yaml"
    first.write_text("hidden: 2048\ntopk: 6\n")
    second.write_text("hidden: 4096\ntopk: 8\ndispatch_dtype: float8_e4m3fn\n")
    assert cli.main(["compile", "--arch", "sm_90", "--config", str(first), "--config", str(second)]) == 0
    [(configs, arch)] = compiled
    assert arch == "sm_90" and [(c.hidden, c.topk, c.dispatch_dtype) for c in configs] == [
        (2048, 6, None), (4096, 8, "float8_e4m3fn")]
    out = capsys.readouterr().out
    assert f"the kernels of {first} (dtype bfloat16, hidden 2048, topk 6); {second} (dtype bfloat16, " \
           "hidden 4096, topk 8)" in out, out


@pytest.mark.parametrize("slab_copies", [1, 2])
def test_info_reports_the_memory_a_config_takes(tmp_path, slab_copies):
    config = tmp_path / "big.yaml"
    config.write_text("backend: vmm\nnum_experts: 64\ntopk: 8\nhidden: 7168\nmax_tokens_per_rank: 4096\n"
                      f"slab_copies: {slab_copies}\n")
    result = _run(_command() + ["info", "--config", str(config), "--world", "8"])
    assert result.returncode == 0, result.stderr
    row_bytes = 7168 * 2
    # Lossless: every rank's 4096 tokens x top-8, plus 15 padding rows for each of 8 local experts.
    rows = 8 * 4096 * 8 + 8 * 15
    slab = 8 * 4096 * row_bytes
    assert "at 8 ranks on vmm" in result.stdout, result.stdout
    assert f"{rows:,} rows (lossless), {rows * row_bytes / 2**30:.3f} GiB ({rows * row_bytes:,} bytes)" in result.stdout
    assert f"slab: {slab / 2**30:.3f} GiB ({slab:,} bytes)" in result.stdout
    held = next(line for line in result.stdout.splitlines() if "symmetric allocation" in line)
    symmetric = int(held.split("(")[1].split()[0].replace(",", ""))
    # Two slabs of rows (received tokens, returned partials) per copy, and a few MB of metadata and flags.
    assert 2 * slab_copies * slab < symmetric < 2 * slab_copies * slab + 2**26, held


@pytest.mark.gpu
def test_run_on_every_gpu(requires_gpus):
    requires_gpus(2)
    result = _run(_command() + ["run", "--steps", "3"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "GPU ranks" in result.stderr and "PASS: 3 steps" in result.stdout
