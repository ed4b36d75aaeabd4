"""A config file of one's own: `python -m finetune my.yaml key=value` and `+recipe=./my.yaml` compose exactly as
the same keys on the command line, in the recipes' schema; `init` writes a starter that runs as written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml


def _compose(*args: str):
    from finetune.core.composition import compose

    return compose([*args, "mode=plan"])


def test_a_user_yaml_composes_as_the_same_keys_on_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(
        "model: llama3_1_8b\nmethod: qlora\nhardware: h100\nname: mine\n"
        "train:\n  seq_len: 2048\n  batch_size: 8\ndata:\n  eval_fraction: 0.2\n"
    )
    same = (
        "model=llama3_1_8b",
        "method=qlora",
        "hardware=h100",
        "name=mine",
        "train.seq_len=2048",
        "train.batch_size=8",
        "data.eval_fraction=0.2",
    )
    by_file = _compose(str(path))
    assert by_file == _compose(*same)
    assert by_file == _compose(f"+recipe={path}")
    assert (by_file.method.name, by_file.hardware.name, by_file.train.seq_len) == ("qlora", "h100", 2048)
    # overrides on top of the file win, a group choice included
    over = _compose(str(path), "train.seq_len=512", "method=lora")
    assert over == _compose(*same, "train.seq_len=512", "method=lora")
    assert (over.train.seq_len, over.method.name) == (512, "lora")


def test_a_shipped_recipe_copied_out_is_a_user_yaml(tmp_path: Path) -> None:
    from finetune.core.composition import package_dir

    copy = tmp_path / "my_tiny.yaml"
    shutil.copy(package_dir("recipes") / "tiny.yaml", copy)
    assert _compose(str(copy)) == _compose("+recipe=tiny")


def test_a_user_yaml_may_name_a_model_folder(tmp_path: Path, monkeypatch) -> None:
    import json

    monkeypatch.chdir(tmp_path)
    Path("my-sft").mkdir()
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    config |= {"num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 1000}
    Path("my-sft/config.json").write_text(json.dumps(config))
    Path("job.yaml").write_text("model: ./my-sft\ntrain:\n  seq_len: 128\n")
    by_file = _compose("job.yaml")
    assert by_file == _compose("model=./my-sft", "train.seq_len=128")
    assert (by_file.name, by_file.model.config_path) == (
        "my-sft_lora",
        str(tmp_path.resolve() / "my-sft/config.json"),
    )


@pytest.mark.parametrize(
    "text, needle",
    [
        ("train:\n  seq_lenx: 3\n", "bad.yaml: train.seq_lenx: unknown key; valid keys: "),
        ("train:\n  seq_len: abc\n", "bad.yaml: train.seq_len='abc'"),
        ("train:\n  seq_len: 0\n", "bad.yaml: train.seq_len=0 must be > 0"),
        ("model: llama3_8b\n", "bad.yaml: model=llama3_8b: unknown model"),
        ("method: [lora]\n", "bad.yaml: method: give a name (model: NAME) or a section of keys"),
        ("train: [\n", "bad.yaml: not valid YAML (line 2: "),
        ("- a\n", "bad.yaml: not a mapping of sections"),
    ],
    ids=["unknown_key", "wrong_type", "out_of_range", "unknown_group", "group_list", "syntax", "not_mapping"],
)
def test_a_bad_user_yaml_is_one_line_naming_the_file_and_key(
    tmp_path: Path, capsys, monkeypatch, text: str, needle: str
) -> None:
    from finetune.pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_text(text)
    code = main(["bad.yaml", "mode=plan", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_a_missing_user_yaml_suggests_init(tmp_path: Path, capsys, monkeypatch) -> None:
    from finetune.pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["+recipe=./nofile.yaml", "mode=plan"]) == 2
    assert (
        "./nofile.yaml: no such file (a config file of your own: python -m finetune init"
        in capsys.readouterr().err
    )


def test_init_writes_a_commented_starter_that_runs_as_written(tmp_path: Path, capsys, monkeypatch) -> None:
    from finetune.pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["init", "job.yaml", "model=llama3_1_8b", "method=qlora", "hardware=h100"]) == 0
    text = Path("job.yaml").read_text()
    assert text.startswith("# job: a fine-tuning job of your own")
    assert "python -m finetune job.yaml mode=plan" in text
    values = yaml.safe_load(text)
    assert (values["model"], values["method"], values["hardware"]) == ("llama3_1_8b", "qlora", "h100")
    assert values["data"]["path"] is None
    cfg = _compose("job.yaml")
    assert (cfg.model.name, cfg.method.name, cfg.hardware.name, cfg.train.seq_len) == (
        "llama3_1_8b",
        "qlora",
        "h100",
        1024,
    )
    assert main(["job.yaml", "mode=plan", f"run_dir={tmp_path / 'run'}"]) == 0
    assert "FITS" in capsys.readouterr().out
    # never replaces a file; a bad choice writes nothing
    before = Path("job.yaml").read_bytes()
    assert main(["init", "job.yaml"]) == 2
    assert Path("job.yaml").read_bytes() == before
    assert main(["init", "other.yaml", "model=nonesuch"]) == 2
    err = capsys.readouterr().err
    assert "init other.yaml: model=nonesuch: unknown model" in err and "job.yaml: the file exists" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "run"]


def test_smoke_carries_a_user_yamls_choices_as_the_command_lines(tmp_path: Path) -> None:
    from finetune.core.composition import user_files
    from finetune.pipeline.smoke import sibling_overrides

    path = tmp_path / "big.yaml"
    path.write_text("model: llama3_1_70b\nmethod: qlora\nhardware: h100\ntrain:\n  seq_len: 2048\n")
    cfg = _compose(str(path), "smoke=true")
    carried = sibling_overrides(cfg, user_files([str(path), "smoke=true"])[0], "llama8b_qlora")
    assert carried[0] == "+recipe=llama8b_qlora"
    # the model and the file itself stay with the real run; the method and hardware go with the sibling
    assert "method=qlora" in carried and "hardware=h100" in carried
    assert not any(o.startswith(("model=", "+recipe=_file")) or o == str(path) for o in carried)
