"""The exceptions a user can act on.

Every one carries a one-line message naming what is wrong (the bad key or
value, the file and line) and, where there is one, what to do instead. The
entry point prints the message and exits with code 2; no traceback.
"""


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
