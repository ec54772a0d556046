"""Typed errors raised by moe_comm.

Every error derives from :class:`MoeCommError`. The subclasses that describe bad
arguments also derive from :class:`ValueError`, and the timeout from
:class:`TimeoutError`, so callers may catch either the library's type or the
built-in one.
"""

from __future__ import annotations

__all__ = [
    "MoeCommError",
    "ConfigError",
    "InputError",
    "BackendError",
    "CompileError",
    "CommTimeoutError",
    "DeviceStatusError",
    "GroupFailedError",
    "RankFailureError",
]


class MoeCommError(Exception):
    """Base class of every error raised by moe_comm."""


class ConfigError(MoeCommError, ValueError):
    """A configuration key has a wrong name, type or value, or does not fit the process group."""


class InputError(MoeCommError, ValueError):
    """A tensor handed to dispatch/combine has the wrong dtype, shape, device or strides (not contiguous)."""


class BackendError(MoeCommError, RuntimeError):
    """A backend cannot run on this machine, or its setup failed (the message says which step)."""


class CompileError(MoeCommError, RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


class CommTimeoutError(MoeCommError, TimeoutError):
    """A wait on another rank ran past ``timeout_s``; the message names the peer and the phase."""


class DeviceStatusError(MoeCommError, RuntimeError):
    """The device status word recorded a fault (invalid expert id, dropped tokens, timeout)."""


class GroupFailedError(DeviceStatusError):
    """A rank of the group failed (a wait timed out, a peer died): the Dispatcher's calls are out of step.

    Raised by ``Dispatcher.check()`` on every rank whose calls saw the failure, and at once by every
    later call on that rank, until a collective ``Dispatcher.reset()`` (or a new Dispatcher).
    """


class RankFailureError(MoeCommError, RuntimeError):
    """One or more ranks started by ``moe_comm.tools.spawn.run_ranks`` raised, crashed or hung.

    The message holds every failed rank's report.

    Attributes:
        failures: rank -> report text (traceback, exit code or stack dump), for every failed rank.
        hung: the ranks that were still running at the deadline and were killed.
    """

    def __init__(self, message: str, failures: dict[int, str], hung: list[int]):
        super().__init__(message)
        self.failures = failures
        self.hung = hung
