"""Shared-node safety of the kernel cache: another local user can neither plant, swap nor block a cubin.

The hostile user is uid 65534 (nobody): as root, the tests hand a directory or a file to that uid
with ``chown`` (skipped with the reason when not root). NVRTC is stood in by a fixed "cubin" and a
fixed version: what is checked is the cache's handling of the files, not the compiler.
"""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from moe_comm.cuda import jit
from moe_comm.errors import CommTimeoutError, ConfigError

STRANGER = 65534
CUBIN = b"\x7fELF cubin compiled by this user"
PLANTED = b"\x7fELF cubin planted by another user"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another uid needs root (chown)")


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """Compiles return CUBIN and count themselves; NVRTC itself is not needed."""
    calls = []
    monkeypatch.setattr(jit, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(jit, "_nvrtc_compile", lambda name, *_: calls.append(name) or CUBIN)
    return calls


def _compile(directory, monkeypatch):
    monkeypatch.setenv("MOE_COMM_CACHE_DIR", str(directory))
    return jit.compile_source("toy", arch="sm_90", source='extern "C" __global__ void k() {}')


def _entry_name(tmp_path, monkeypatch) -> str:
    """The genuine entry name of the toy build (its hash is of public inputs, so anyone can compute it)."""
    return _compile(tmp_path / "probe", monkeypatch).name


def _strangers_dir(path, mode=0o755):
    path.mkdir(mode=mode)
    os.chmod(path, mode)  # past the umask
    os.chown(path, STRANGER, STRANGER)
    return path


def _strangers_file(path, data: bytes):
    path.write_bytes(data)
    os.chown(path, STRANGER, STRANGER)


@needs_root
def test_a_cubin_planted_in_another_users_directory_is_never_returned(tmp_path, monkeypatch, fake_nvrtc):
    name = _entry_name(tmp_path, monkeypatch)
    theirs = _strangers_dir(tmp_path / "theirs")
    _strangers_file(theirs / name, PLANTED)
    with pytest.raises(ConfigError, match=r"theirs: refused, it is owned by uid 65534.*MOE_COMM_CACHE_DIR"):
        _compile(theirs, monkeypatch)


@needs_root
def test_a_directory_another_user_may_write_is_refused_before_anything_is_written(tmp_path, monkeypatch, fake_nvrtc):
    # Their directory open to all (so the victim could write into it, and they could swap it after),
    # and the victim's own directory left writable by everyone.
    for directory in (_strangers_dir(tmp_path / "theirs", 0o777), tmp_path / "open"):
        directory.mkdir(exist_ok=True)
        if directory.name == "open":
            os.chmod(directory, 0o777)
        with pytest.raises(ConfigError, match=f"{directory.name}: refused"):
            _compile(directory, monkeypatch)
        assert list(directory.iterdir()) == []
    assert fake_nvrtc == []  # nothing was compiled into either


@needs_root
def test_a_cubin_swapped_for_another_users_file_is_not_loaded(tmp_path, monkeypatch, fake_nvrtc):
    path = _compile(tmp_path / "cache", monkeypatch)
    assert jit.read_cubin(path) == CUBIN
    path.unlink()
    _strangers_file(path, PLANTED)  # what a swap leaves: a file this user did not write
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        jit.read_cubin(path)
    os.chown(path, os.geteuid(), os.getegid())
    os.chmod(path, 0o666)  # ours, but anyone may rewrite it
    with pytest.raises(ConfigError, match="group or others may write it"):
        jit.read_cubin(path)


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path, monkeypatch, fake_nvrtc):
    name = _entry_name(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    victim = tmp_path / "victims-file"
    (cache / name.replace(".cubin", ".lock")).symlink_to(victim)
    with pytest.raises(ConfigError, match=r"kernel cache lock .*\.lock: refused"):
        _compile(cache, monkeypatch)
    assert not victim.exists()


def test_a_fifo_under_the_entry_name_is_refused_without_blocking(tmp_path, monkeypatch, fake_nvrtc):
    name = _entry_name(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.mkfifo(cache / name)
    with pytest.raises(ConfigError, match="not a regular file"):
        _compile(cache, monkeypatch)
    with pytest.raises(ConfigError, match="not a regular file"):
        jit.read_cubin(cache / name)  # a read would block forever on a FIFO nobody writes


def test_an_oversized_entry_is_refused(tmp_path, monkeypatch, fake_nvrtc):
    path = _compile(tmp_path / "cache", monkeypatch)
    monkeypatch.setattr(jit, "MAX_CUBIN_BYTES", len(CUBIN) - 1)
    with pytest.raises(ConfigError, match=f"{len(CUBIN)} bytes is more than"):
        jit.read_cubin(path)


def test_the_cache_is_created_private_and_an_own_readable_one_is_made_private(tmp_path, monkeypatch, fake_nvrtc):
    path = _compile(tmp_path / "new" / "cache", monkeypatch)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.with_suffix(".lock").stat().st_mode) == 0o600
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    old = tmp_path / "old"
    old.mkdir()
    os.chmod(old, 0o755)  # what earlier versions created: anyone could list the kernels
    _compile(old, monkeypatch)
    assert stat.S_IMODE(old.stat().st_mode) == 0o700


def test_a_lock_held_past_the_bound_raises_instead_of_waiting_forever(tmp_path, monkeypatch, fake_nvrtc):
    name = _entry_name(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    holder = os.open(cache / name.replace(".cubin", ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    jit.fcntl.flock(holder, jit.fcntl.LOCK_EX)  # another open file: flock excludes it, also in this process
    monkeypatch.setattr(jit, "LOCK_WAIT_S", 0.3)
    outcome = []

    def build():
        try:
            _compile(cache, monkeypatch)
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(10.0)
    os.close(holder)
    assert not thread.is_alive(), "the build waited on the lock past 10 s"
    assert len(outcome) == 1 and isinstance(outcome[0], CommTimeoutError), outcome
    assert ".lock" in str(outcome[0]) and time.monotonic() - started < 5.0


def _rendezvous_store(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    directory = os.stat(os.path.dirname(store.path)) if isinstance(store, dist.FileStore) else None
    return {"store": type(store).__name__, "dir_uid": directory and directory.st_uid,
            "dir_mode": directory and stat.S_IMODE(directory.st_mode)}


def test_the_launchers_store_is_a_file_only_this_user_can_reach():
    """No TCP store that any local user (or another host) could list, write or feed pickles through:
    the ranks meet in a FileStore in a 0700 directory of this user."""
    from multirank import run_ranks

    for report in run_ranks(_rendezvous_store, 2, timeout_s=60):
        assert report == {"store": "FileStore", "dir_uid": os.geteuid(), "dir_mode": 0o700}, report


def test_python_releases_whose_forkserver_other_users_reach_are_excluded():
    """The launcher forces the forkserver start method; 3.10.0-3.10.8 and 3.11.0 listened for it on an
    abstract socket any local user could connect to and have code run as this user."""
    tomllib = pytest.importorskip("tomllib")
    specifiers = pytest.importorskip("packaging.specifiers")
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    allowed = specifiers.SpecifierSet(project["requires-python"])
    assert [v for v in ("3.10.0", "3.10.8", "3.11.0") if v in allowed] == []
    assert all(v in allowed for v in ("3.10.9", "3.11.1", "3.12.0", "3.13.0"))
