"""The data cache's key is built from the schema: every setting marked as changing what the data stage prepares
(finetune/core/config/checks.py, AFFECTS_DATA), so a new one cannot be left out; and a cache folder that is
not a folder is one line."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from helpers import REPO, tiny_cfg

from finetune.core.config import Config
from finetune.core.config.checks import AFFECTS_DATA
from finetune.core.errors import DataError
from finetune.data import cache
from finetune.data import stage as data_stage


def test_the_key_holds_the_marked_settings_and_no_others():
    key = cache.config_key(tiny_cfg())
    data_fields = {f"data.{f.name}" for f in dataclasses.fields(tiny_cfg().data)}
    ignored = {"data.name", "data.path", "data.num_proc", "data.cache_dir"}
    assert data_fields - ignored <= key.keys() and not ignored & key.keys()
    assert {"train.seq_len", "model.max_position_embeddings"} <= key.keys()
    assert "method.learning_rate" not in key and "train.seed" not in key
    grpo = cache.config_key(tiny_cfg("objective=grpo", "objective.num_generations=4"))
    assert "objective.max_completion_length" in grpo and "objective.beta" not in grpo


def _cfg_reads(source: str) -> set[tuple[str, str]]:
    """(section, field) of every `cfg.SECTION.FIELD` in a module, and `X.FIELD` where `X = cfg.SECTION`."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
            v = node.value
            if isinstance(v.value, ast.Name) and v.value.id == "cfg":
                for target in node.targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    for name in names:
                        if isinstance(name, ast.Name):
                            aliases[name.id] = v.attr
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):  # a, b = cfg.x, cfg.y
            for target, value in zip(getattr(node.targets[0], "elts", []), node.value.elts):
                if (
                    isinstance(target, ast.Name)
                    and isinstance(value, ast.Attribute)
                    and isinstance(value.value, ast.Name)
                    and value.value.id == "cfg"
                ):
                    aliases[target.id] = value.attr
    reads = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.value, (ast.Attribute, ast.Name)):
            continue
        inner = node.value
        if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "cfg":
            reads.add((inner.attr, node.attr))
        elif isinstance(inner, ast.Name) and inner.id in aliases:
            reads.add((aliases[inner.id], node.attr))
    return reads


def test_every_setting_the_data_stage_reads_is_in_the_key():
    """A setting the preparation reads but the key leaves out gives a stale cache hit (a changed
    objective.max_completion_length would keep the old prompts)."""
    cfg = tiny_cfg("objective=grpo", "objective.num_generations=4")
    sections = {f.name for f in dataclasses.fields(Config)}
    key = cache.config_key(cfg)
    # marked as not changing the prepared rows, on purpose (where the input is, the cache's place, processes)
    declined = {
        f"{s}.{f.name}"
        for s in sections
        if dataclasses.is_dataclass(getattr(cfg, s))
        for f in dataclasses.fields(getattr(cfg, s))
        if f.metadata.get(AFFECTS_DATA) is False
    }
    assert declined == {"data.name", "data.path", "data.num_proc", "data.cache_dir"}
    missing = []
    for path in sorted((REPO / "finetune" / "data").glob("*.py")):
        for section, name in _cfg_reads(path.read_text()):
            if section not in sections or section == "objective":  # the objective: its record kind is keyed
                continue
            if f"{section}.{name}" not in key and f"{section}.{name}" not in declined:
                missing.append(f"{path.name}: cfg.{section}.{name}")
    assert not missing, f"read by the data stage but not in its cache key (mark them AFFECTS_DATA): {missing}"


def test_a_changed_completion_length_is_another_entry(tiny_tokenizer):
    def key(*overrides: str) -> str:
        cfg = tiny_cfg("objective=grpo", "objective.num_generations=4", *overrides)
        return data_stage._fingerprint(cfg, "input", tiny_tokenizer)

    assert key() == key("objective.beta=0.1") == key("data.num_proc=2")
    assert key() != key("objective.max_completion_length=100000")
    assert key() != key("train.seq_len=64") != key("data.dedup=false")


@pytest.mark.parametrize("kind", ["file", "under_a_file"])
def test_a_cache_dir_that_is_not_a_folder_is_one_line(tmp_path, kind):
    afile = tmp_path / "afile"
    afile.write_text("x")
    where = afile if kind == "file" else afile / "sub"
    with pytest.raises(DataError) as err:
        cache.root(str(where))
    expected = (
        "is a regular file, not a folder; name a folder for the cache" if kind == "file" else "cannot use it"
    )
    assert str(err.value).startswith(f"data.cache_dir={where}: {expected}")
    assert cache.root(str(tmp_path / "new")) == Path(tmp_path / "new")
