"""A vision-language family whose processor needs torchvision, where torchvision is not installed: one line
naming the package and the extra, before any processor is loaded."""

from __future__ import annotations

import importlib.util

import pytest

from finetune.core.errors import ConfigError
from finetune.modeling import models
from finetune.pipeline.cli import compose


def test_a_processor_that_needs_torchvision_is_refused_in_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "torchvision" else real(n, *a)
    )
    cfg = compose(["+recipe=qwen25vl_7b_lora"])
    with pytest.raises(ConfigError) as err:
        models.load_tokenizer(cfg.model)
    assert str(err.value) == (
        "model.architecture=qwen2_5_vl: its processor needs torchvision, which is not installed "
        "(pip install '.[vision]', torchvision built for the installed torch)"
    )
