"""Exceptions raised by FlashDMoE beyond plain ``ValueError`` for bad input."""

from __future__ import annotations

__all__ = ["BackendUnavailable", "KernelTimeout", "TeamFailed"]


class KernelTimeout(RuntimeError):
    """The fused kernel's watchdog expired while waiting on a signal.

    The message carries the kernel's error word decoded into text: the phase that was waiting
    (gate, dispatch, expert, combine) and, for cross-rank waits, the peer that never signalled.
    """


class BackendUnavailable(RuntimeError):
    """A backend was asked for explicitly but cannot run here; the message says why."""


class TeamFailed(RuntimeError):
    """The team saw a kernel failure earlier (or was closed); it cannot be used again. Also raised for a
    forward the device stopped at its start because an earlier forward of its team had failed."""
