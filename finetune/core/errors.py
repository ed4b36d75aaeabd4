"""The exceptions a user can act on.

Every one carries a one-line message naming what is wrong (the bad key or
value, the file and line) and, where there is one, what to do instead. The
entry point prints the message and exits with code 2; no traceback.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Optional


class FinetuneError(Exception):
    """Base class: bad input the user can fix. Exit code 2."""

    exit_code = 2


class ConfigError(FinetuneError):
    """A configuration key, value or combination is invalid."""


class PlanError(FinetuneError):
    """The planner cannot reason about the request (not: the job does not fit)."""


class DataError(FinetuneError):
    """An input data file or record is malformed or unusable."""


class LaunchError(FinetuneError):
    """A launch, rendezvous or run-directory problem."""


class DiskFullError(FinetuneError):
    """No space left where a file had to be written: names the path, the bytes needed and the bytes free."""

    def __init__(self, path: object, needed_bytes: Optional[int], free_bytes: Optional[int] = None):
        self.path, self.needed_bytes, self.free_bytes = path, needed_bytes, free_bytes
        need = f"needs about {format_bytes(needed_bytes)}" if needed_bytes else "needs more space"
        free = f"{format_bytes(free_bytes)} free, " if free_bytes is not None else ""
        super().__init__(
            f"disk full: {path}: {free}{need}; free space there (or choose another run_dir / data.cache_dir) "
            "and run the same command again"
        )


# Exit code of a run stopped by a signal (SIGTERM, SIGINT): EX_TEMPFAIL, "try again later"; running the
# same command again continues from what was completely written.
INTERRUPTED_EXIT_CODE = 75


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or a second SIGINT) stopped the process where it stood: exit code 75.

    A KeyboardInterrupt, not an Exception, so no `except Exception` on the way up swallows it.
    """

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


DISK_FULL_ERRNOS = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


# What PyTorch's C++ writers say when a write fails, with no errno to read: a full disk only when the disk
# lacks the space (the callers compare the bytes free with the bytes needed). torch.save on a full tmpfs:
# "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534".
WRITE_FAILED = ("iostream error", "PytorchStreamWriter failed", "file write failed", "unexpected pos")


def is_disk_full(exc: BaseException) -> bool:
    """A write that failed for a full disk or quota: an OSError with ENOSPC or EDQUOT, or an error that
    carries only the text (Arrow's IO errors; safetensors' SafetensorError, no OSError: "Error while
    serializing: I/O error: No space left on device (os error 28)")."""
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return True
    return any(s in str(exc) for s in ("No space left on device", "Disk quota exceeded"))


def format_bytes(n: Optional[float]) -> str:
    """Decimal units a user reads at a glance: 512 B, 40.2 kB, 3.1 MB, 12.0 GB, 1.2 TB."""
    if n is None:
        return "an unknown size"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:,.1f} TB"


def interrupt_on_signals() -> Callable[[], None]:
    """SIGTERM and SIGINT raise `Interrupted` where the process stands (a repeat while it unwinds is
    ignored); returns the function that puts the previous handlers back. Main thread only."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    received: list[str] = []

    def handle(signum: int, frame: object) -> None:
        if received:
            return  # already stopping
        received.append(signal.Signals(signum).name)
        raise Interrupted(received[0])

    previous = {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    return restore
