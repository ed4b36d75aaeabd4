"""`python -m finetune ... mode=plan` end to end: exit codes, plan.json, the table, bad input."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, child_env, run_cli

from finetune.planner.contract import CONTRACT_HARDWARE


def _wide_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """`python -m finetune ARGS` with COLUMNS=120: the width the plan table is printed at."""
    return run_cli(*args, env=child_env(COLUMNS="120"), cwd=cwd, timeout=120)


def test_plan_70b_qlora_fits_one_h100(tmp_path: Path):
    out = tmp_path / "plan.json"
    run_dir = tmp_path / "run"
    r = _wide_cli(
        "+recipe=llama70b_qlora", "mode=plan", f"plan.out={out}", f"run_dir={run_dir}", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert plan["fits"] is True
    assert plan["hardware"]["name"] == "h100" and plan["hardware"]["gpus"] == 1
    assert plan["params"] == {"total": 70_553_706_496, "trainable": 207_093_760, "active": 70_553_706_496}
    assert plan["strategy"]["activation_checkpointing"] is True
    assert json.loads((run_dir / "plan.json").read_text()) == plan
    assert (run_dir / "config.yaml").is_file()
    for word in ("FITS", "weights", "trainable_state", "activations", "logits", "overhead", "alternatives"):
        assert word in r.stdout


def test_plan_contract_command_with_groups(tmp_path: Path):
    out = tmp_path / "p.json"
    r = _wide_cli(
        "mode=plan", "model=llama3_1_70b", "method=lora", "hardware=h100", "train.seq_len=8192",
        f"plan.out={out}", f"run_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr  # exit 0 whether or not it fits
    plan = json.loads(out.read_text())
    assert plan["fits"] is False
    assert plan["reasons"] and plan["suggestions"]
    assert any(a["fits"] for a in plan["alternatives"])
    assert "DOES NOT FIT" in r.stdout


def test_hardware_auto_picks_cheapest_that_fits(tmp_path: Path):
    out = tmp_path / "p.json"
    r = _wide_cli(
        "+recipe=llama70b_lora", "hardware=auto", "mode=plan", f"plan.out={out}", f"run_dir={tmp_path / 'r'}"
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    fitting = [a for a in plan["alternatives"] if a["fits"]]
    assert plan["hardware"]["usd_per_month"] == min(a["usd_per_month"] for a in fitting)
    # Profiles without a known price are not weighed, and the plan says which were skipped.
    assert all(a["usd_per_month"] is not None for a in plan["alternatives"])
    skipped = next(r for r in plan["reasons"] if r.startswith("hardware=auto: skipped"))
    assert "a100_80gb" in skipped and "l40s" in skipped and "h100," not in skipped


def test_hardware_local_on_this_machine_plans_for_what_it_finds(tmp_path: Path):
    """No GPU here: hardware=local plans for the CPU, as hardware=cpu does, and says why."""
    import psutil
    import torch

    out = tmp_path / "p.json"
    r = _wide_cli(
        "+recipe=tiny", "hardware=local", "mode=plan", f"plan.out={out}", f"run_dir={tmp_path / 'r'}"
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    ram = round(psutil.virtual_memory().total / 1e9, 2)
    if torch.cuda.is_available():
        assert plan["hardware"]["gpus"] == torch.cuda.device_count()
        assert plan["reasons"][0].startswith(f"hardware=local: {torch.cuda.device_count()} x ")
    else:
        assert {k: plan["hardware"][k] for k in CONTRACT_HARDWARE} == {
            "name": "local", "gpus": 1, "gpu_memory_gb": ram, "host_memory_gb": ram, "usd_per_month": None,
        }  # fmt: skip
        assert plan["hardware"]["device"] == "cpu" and plan["hardware"]["vcpus"] == os.cpu_count()
        assert plan["reasons"][0].startswith("hardware=local: no CUDA GPU on this machine")
        assert "planning for the CPU as hardware=cpu does" in plan["reasons"][0]
        assert "on local (" in r.stdout and f"free under {tmp_path / 'r'}" in plan["reasons"][0]


def test_local_config_json(tmp_path: Path):
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "p.json"
    r = _wide_cli(
        "mode=plan",
        f"model.config_path={path}",
        "hardware=h100",
        f"plan.out={out}",
        f"run_dir={tmp_path / 'r'}",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["params"]["total"] == 8_030_261_248


@pytest.mark.parametrize(
    "args,needle",
    [
        (["mode=plan", "train.seq_len=0"], "train.seq_len=0"),
        (["mode=plan", "method.lora_rank=-1"], "method.lora_rank=-1"),
        (["+recipe=does_not_exist"], "choose from gpt_oss_20b_lora, llama70b_full"),
        (["mode=plan", "model=gpt5"], "choose from gemma3_12b, gemma3_12b_vision, gpt_oss_120b, gpt_oss_20b"),
        (["mode=plan", "hardware=tpu_v5"], "unknown hardware; choose from a100_40gb"),
        (["mode=plan", "train.bogus=1"], "train.bogus: unknown key"),
        (["mode=plan", "train.batch_size=many"], "train.batch_size"),
        (["mode=plan", "model=llama3_1_8b", "train.seq_len=999999"], "train.seq_len=999999 exceeds"),
        (
            ["mode=plan", "model.config_path=/nonexistent/config.json"],
            "model.config_path=/nonexistent/config.json",
        ),
        (
            ["mode=plan", "train.seq_len=auto", "run_dir=/tmp/finetune-no-such-run"],
            "train.seq_len=auto needs",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle):
    r = _wide_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]


def test_help_lists_choices():
    r = _wide_cli("--help")
    assert r.returncode == 0
    assert "llama70b_qlora" in r.stdout and "h200x8" in r.stdout
