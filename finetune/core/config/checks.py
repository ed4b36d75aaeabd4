"""Validation shared by every config section: each failure is one `ConfigError` line naming the key.

A choice field declares its allowed values once, with the field (`choice`); `check_choices`
reads them back from the fields' metadata, so what the schema says and what it checks are one
tuple. Messages read `KEY=VALUE is not one of a, b, c` (tests and users match on them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Any, Optional, TypeVar

from finetune.core.errors import ConfigError

# A field's metadata: whether the setting changes what the data stage prepares, so it is part of the data
# cache's key (finetune/data/cache.py, `config_key`). On a root section (`data`) it marks every field of it,
# less those whose own metadata says False.
AFFECTS_DATA = "affects_data"
DATA_KEY = {AFFECTS_DATA: True}
NOT_DATA_KEY = {AFFECTS_DATA: False}

T = TypeVar("T")

_CHOICES = "choices"


def choice(default: T, choices: Collection[str]) -> T:
    """A dataclass field whose value must be one of `choices` (checked by `check_choices`).

    `choices` is read when checked, so a registry (METHODS, ARCHITECTURES) may grow at run time.
    None passes where it is the default: the planner, or a later stage, decides.
    """
    return dataclasses.field(default=default, metadata={_CHOICES: choices})


def check_choices(node: Any, section: str, schema: Optional[type] = None) -> None:
    """Every choice field of `node`, or only those `schema` declares (one concern of a combined section)."""
    for f in dataclasses.fields(schema or node):
        valid = f.metadata.get(_CHOICES)
        if valid is None:
            continue
        key = f"{section}.{f.name}" if section else f.name
        check_choice(key, getattr(node, f.name), tuple(valid), allow_none=f.default is None)


def check_choice(key: str, value: Any, valid: tuple, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, valid))}")


def check_positive(
    key: str, value: Optional[float], allow_none: bool = False, allow_zero: bool = False
) -> None:
    if value is None:
        if allow_none:
            return
        raise ConfigError(f"{key} must be set")
    check_finite(key, value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def check_finite(key: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number")


def check_all_finite(node: Any, key: str) -> None:
    """NaN and infinity refused in every float of the config (comparisons with NaN are always False,
    so a range check alone lets `method.learning_rate=nan` through to crash the worker after loading)."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            check_all_finite(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(node, dict):
        for k, v in node.items():
            check_all_finite(v, f"{key}.{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            check_all_finite(v, f"{key}[{i}]")
    else:
        check_finite(key, node)
