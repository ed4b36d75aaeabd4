"""A model named as users name it: `model=FOLDER` and `model=ORG/NAME` plan by the model's own config.json,
through the one path presets share; a preset given another hub id is refused unless that model has its shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import planned

# A Qwen2-0.5B-shaped config.json, as save_pretrained writes it.
QWEN_SMALL = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
}


def _folder(root: Path, config: dict = QWEN_SMALL) -> Path:
    folder = root / "my-sft"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline hub cache holding Org/Small's config.json (the layout huggingface_hub writes)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--Org--Small"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(QWEN_SMALL))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _refusal(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from finetune.pipeline.cli import main

    code = main([*args, "mode=plan"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_folder_plans_as_its_config_json(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    cfg, by_folder = planned(f"model={folder}", "mode=plan")
    _, by_path = planned(f"model.config_path={folder / 'config.json'}", "mode=plan")
    assert by_folder.to_dict() == by_path.to_dict()
    assert (cfg.model.architecture, cfg.model.hidden_size, cfg.model.num_layers) == ("qwen2", 896, 24)
    # the run directory is named after the folder, as for model.config_path
    assert cfg.name == "my-sft_lora"


def test_a_hub_id_plans_from_the_hub_cache(tmp_path: Path, hub_cache: Path) -> None:
    folder = _folder(tmp_path)
    cfg, by_hub = planned("model=Org/Small", "mode=plan")
    _, by_folder = planned(f"model={folder}", "mode=plan")
    assert by_hub.to_dict() == by_folder.to_dict()
    assert (cfg.model.hub_id, cfg.model.name, cfg.name) == ("Org/Small", "Small", "Small_lora")
    assert cfg.model.num_kv_heads == 2 and cfg.model.tie_embeddings


def test_an_uncached_hub_id_offline_names_model_config_path(hub_cache: Path, capsys) -> None:
    line = _refusal(["model=Org/Absent"], capsys)
    assert "model=Org/Absent: its config.json is neither in the hub cache nor reachable" in line
    assert "model.config_path=PATH/config.json" in line


def test_a_preset_with_another_models_hub_id_is_refused(hub_cache: Path, capsys) -> None:
    # unreadable: refused, never planned as the preset
    line = _refusal(["model=llama3_1_8b", "model.hub_id=mistralai/Mistral-7B-Instruct-v0.3"], capsys)
    assert "model=llama3_1_8b's shape" in line and "pass model=mistralai/Mistral-7B-Instruct-v0.3" in line
    # readable and of another shape: the differences named
    line = _refusal(["model=llama3_1_8b", "model.hub_id=Org/Small"], capsys)
    assert "its config.json is not model=llama3_1_8b's shape" in line
    assert "hidden_size 896 not 4096" in line and "num_layers 24 not 32" in line


def test_a_preset_with_a_hub_id_of_its_shape_plans_as_the_preset(tmp_path: Path, hub_cache: Path) -> None:
    import yaml

    from finetune.core.composition import package_dir

    stated = yaml.safe_load((package_dir("configs") / "model" / "llama3_1_8b.yaml").read_text())
    llama = {
        "model_type": "llama",
        "hidden_size": stated["hidden_size"],
        "intermediate_size": stated["intermediate_size"],
        "num_attention_heads": stated["num_heads"],
        "num_hidden_layers": stated["num_layers"],
        "num_key_value_heads": stated["num_kv_heads"],
        "vocab_size": stated["vocab_size"],
        "max_position_embeddings": stated["max_position_embeddings"],
        "tie_word_embeddings": False,
    }
    repo = hub_cache / "models--Org--Llama-Base"
    (repo / "snapshots" / "def").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("def")
    (repo / "snapshots" / "def" / "config.json").write_text(json.dumps(llama))
    cfg, plan = planned("model=llama3_1_8b", "model.hub_id=Org/Llama-Base", "mode=plan")
    _, preset = planned("model=llama3_1_8b", "mode=plan")
    assert cfg.model.shape == "checked"
    assert plan.to_dict() == preset.to_dict()


def test_a_preset_needs_no_hub(hub_cache: Path) -> None:
    cfg, plan = planned("model=llama3_1_8b", "mode=plan")
    assert cfg.model.shape == "stated" and plan.params_total > 8e9


@pytest.mark.parametrize(
    "value, needle",
    [
        ("./no-such-folder", "model=./no-such-folder: no such folder"),
        ("{empty}", "no config.json in that folder"),
        ("llama3_8b", "unknown model; choose from"),
    ],
)
def test_a_bad_model_value_is_one_line(tmp_path: Path, capsys, monkeypatch, value: str, needle: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    line = _refusal([f"model={value.format(empty=tmp_path / 'empty')}"], capsys)
    assert needle in line
    if "unknown model" in needle:
        assert "a hub id (ORG/NAME) or a model folder" in line


_LLAMA = '{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, '
_LLAMA += '"num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 1000'


@pytest.mark.parametrize(
    "tail, needle",
    [
        (', "hidden_size": "256"}', 'hidden_size="256" must be a whole number'),
        (', "hidden_size": 256.0}', "hidden_size=256.0 must be a whole number"),
        (', "num_hidden_layers": true}', "num_hidden_layers=true must be a whole number"),
        (', "vocab_size": null}', "vocab_size=null must be a whole number"),
        (', "hidden_size": NaN}', "hidden_size=nan must be a whole number"),
        (', "num_attention_heads": 0}', "num_attention_heads=0 must be a whole number in 1.."),
        (', "num_key_value_heads": 0}', "num_key_value_heads=0 must be a whole number in 1.."),
        (', "rms_norm_eps": "small"}', 'rms_norm_eps="small" must be a finite number'),
        (', "tie_word_embeddings": "no"}', 'tie_word_embeddings="no" must be true or false'),
        (', "rope_scaling": ' + "[" * 50_000 + "]" * 50_000 + "}", "nested too deeply"),
        (', "vocab_size": ' + "9" * 5000 + "}", "not a readable JSON file (Exceeds the limit"),
        (
            ', "vocab_size": ' + "9" * 4000 + "}",
            "vocab_size=99999999999999999999... (4,000 characters) must be",
        ),
    ],
    ids=[
        "str",
        "float",
        "bool",
        "null",
        "nan",
        "zero_heads",
        "zero_kv",
        "eps_str",
        "flag_str",
        "deep",
        "huge",
        "big",
    ],
)
def test_a_config_json_of_wrong_types_is_one_line(tmp_path: Path, capsys, tail: str, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(_LLAMA + tail)
    line = _refusal([f"model.config_path={path}", f"run_dir={tmp_path / 'run'}"], capsys)
    assert line.startswith(f"finetune: error: model.config_path={path}: ") and needle in line, line
    assert not (tmp_path / "run").exists()


def test_a_hub_id_alone_is_read_as_model_equals_it(hub_cache: Path) -> None:
    cfg, plan = planned("model.hub_id=Org/Small", "mode=plan")
    _, by_model = planned("model=Org/Small", "mode=plan")
    assert (cfg.model.shape, cfg.name) == ("hub", "Small_lora")
    assert plan.to_dict() == by_model.to_dict()
