"""serve.sh: the vLLM commands parsed back, and run against a stand-in `vllm` that prints its arguments."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import plan_for

from finetune.core.config.export import ExportConfig
from finetune.export import serve
from finetune.pipeline.cli import compose


def _job(*overrides: str, **export):
    cfg = replace(compose(list(overrides)), export=ExportConfig(**export))
    return cfg, plan_for(cfg)


def parse_script(text: str) -> dict[str, list[str]]:
    """{variant: argv (from `vllm`)} from serve.sh's case branches (each `exec vllm serve ...`)."""
    out, variant = {}, None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith(")") and not stripped.startswith("#") and " " not in stripped:
            variant = stripped[:-1]
        elif stripped.startswith("exec vllm serve"):
            out[variant] = shlex.split(stripped)[1:]
    return out


def flags(argv: list[str]) -> dict[str, str]:
    """--key value pairs (a flag without a value maps to '')."""
    result, i = {}, 3
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            result[argv[i]] = argv[i + 1]
            i += 2
        else:
            result[argv[i]] = ""
            i += 1
    return result


def test_70b_qlora_on_one_h200_fits_only_as_fp8():
    cfg, plan = _job(
        "model=llama3_1_70b", "method=qlora", "hardware=h200", "train.seq_len=8192", "name=llama70b"
    )
    commands = {
        c.variant: c
        for c in serve.serve_commands(
            cfg, plan, merged=True, adapter=True, base_source="meta-llama/Llama-3.1-70B-Instruct"
        )
    }
    assert list(commands) == ["merged", "lora", "fp8"]

    merged = flags(list(commands["merged"].argv))
    assert commands["merged"].argv[:3] == ("vllm", "serve", "./merged")
    assert merged["--served-model-name"] == "llama70b" and merged["--max-model-len"] == "8192"
    assert merged["--tensor-parallel-size"] == "1" and merged["--dtype"] == "bfloat16"
    assert "do not fit h200" in commands["merged"].note and "141" in commands["merged"].note

    fp8 = flags(list(commands["fp8"].argv))
    assert fp8["--quantization"] == "fp8" and fp8["--tensor-parallel-size"] == "1"
    assert "on 1 GPU(s) of h200" in commands["fp8"].note
    assert 70 < serve.weights_gb(cfg, plan, fp8=True) < 75 < 140 < serve.weights_gb(cfg, plan) < 142

    lora = flags(list(commands["lora"].argv))
    assert commands["lora"].argv[2] == "meta-llama/Llama-3.1-70B-Instruct"
    assert "--enable-lora" in lora and lora["--lora-modules"] == "llama70b=./adapter"
    assert lora["--max-lora-rank"] == "16" and lora["--served-model-name"] == "llama70b-base"
    assert "NF4" in commands["lora"].note


def test_tensor_parallel_from_the_profile_and_overrides():
    cfg, plan = _job("model=llama3_1_70b", "method=lora", "hardware=h200x8", "train.seq_len=4096")
    commands = {c.variant: c for c in serve.serve_commands(cfg, plan, merged=True, adapter=False)}
    assert flags(list(commands["merged"].argv))["--tensor-parallel-size"] == "2"  # 141 GB over 2 x 141 GB
    assert flags(list(commands["fp8"].argv))["--tensor-parallel-size"] == "1"
    assert "lora" not in commands

    cfg2 = replace(
        cfg,
        export=ExportConfig(tensor_parallel_size=8, max_model_len=32768, fp8=False, served_model_name="m"),
    )
    commands = serve.serve_commands(cfg2, plan, merged=True, adapter=False)
    assert [c.variant for c in commands] == ["merged"]
    f = flags(list(commands[0].argv))
    assert (
        f["--tensor-parallel-size"] == "8"
        and f["--max-model-len"] == "32768"
        and f["--served-model-name"] == "m"
    )


@pytest.mark.parametrize(("rank", "vllm_rank"), [(1, 1), (4, 8), (16, 16), (17, 32), (256, 256), (300, 320)])
def test_max_lora_rank_is_a_value_vllm_accepts(rank, vllm_rank):
    assert serve.max_lora_rank(rank) == vllm_rank


def test_serve_script_runs_each_variant_from_anywhere(tmp_path):
    cfg, plan = _job(
        "model=llama3_1_8b", "method=lora", "hardware=h100", "train.seq_len=4096", "name=llama8b"
    )
    commands = serve.serve_commands(
        cfg, plan, merged=True, adapter=True, base_source="meta-llama/Llama-3.1-8B"
    )
    export = tmp_path / "export"
    serve.write(cfg, export / "serve.sh", commands)
    text = (export / "serve.sh").read_text()
    assert os.access(export / "serve.sh", os.X_OK)
    assert subprocess.run(["bash", "-n", str(export / "serve.sh")]).returncode == 0

    parsed = parse_script(text)
    assert parsed == {c.variant: list(c.argv) for c in commands}

    # A stand-in vllm on PATH records its working directory and arguments.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text(
        '#!/usr/bin/env python3\nimport json, os, sys\nprint(json.dumps({"cwd": os.getcwd(), "argv": sys.argv[1:]}))\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for variant in ("", "merged", "lora", "fp8"):
        args = ["bash", str(export / "serve.sh")] + ([variant] if variant else [])
        done = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
        seen = json.loads(done.stdout)
        assert Path(seen["cwd"]) == export  # ./merged and ./adapter resolve next to serve.sh
        assert ["vllm", *seen["argv"]] == parsed[variant or "merged"]
    bad = subprocess.run(["bash", str(export / "serve.sh"), "nope"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_a_reward_model_is_served_merged_by_the_pooling_runner(tmp_path):
    cfg, plan = _job(
        "model=llama3_1_8b", "method=lora", "objective=reward", "hardware=h100", "train.seq_len=2048"
    )
    assert cfg.objective.spec.head == "score"
    commands = serve.serve_commands(
        cfg, plan, merged=True, adapter=True, base_source="meta-llama/Llama-3.1-8B"
    )
    # the score head is trained whole beside the adapter: no base-plus-adapter variant
    assert [c.variant for c in commands] == ["merged", "fp8"]
    for c in commands:
        argv = list(c.argv)
        assert argv[:3] == ["vllm", "serve", "./merged"]
        f = flags(argv)
        assert f["--runner"] == "pooling" and f["--convert"] == "classify"
    serve.write(cfg, tmp_path / "serve.sh", commands)
    text = (tmp_path / "serve.sh").read_text()
    assert (
        serve.POOLING_NOTE in text
        and subprocess.run(["bash", "-n", str(tmp_path / "serve.sh")]).returncode == 0
    )
    assert parse_script(text) == {c.variant: list(c.argv) for c in commands}

    # a policy keeps vLLM's default runner
    policy, plan = _job("model=llama3_1_8b", "method=lora", "hardware=h100", "train.seq_len=2048")
    for c in serve.serve_commands(policy, plan, merged=True, adapter=True, base_source="b"):
        assert "--runner" not in c.argv


def test_a_reward_model_exported_without_merging_is_refused_in_one_line(tmp_path):
    from finetune.export import merge
    from finetune.export import stage as export_stage

    cfg = compose(["objective=reward", "export.merge=false", f"run_dir={tmp_path}"])
    with pytest.raises(merge.ExportError, match=r"^export.merge=false: objective=reward trains a score head"):
        export_stage.run(cfg, tmp_path, plan_for(cfg))
    assert list(tmp_path.iterdir()) == []  # refused before anything is read or written
