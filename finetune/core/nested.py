"""Nested mappings (a resolved config, a plan) as one level of dotted keys: `{"train": {"seq_len": 128}}` ->
`{"train.seq_len": 128}`. Lists stay values. Read by the model card, the tracker's parameters and
mode=compare."""

from __future__ import annotations

from typing import Any


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}
