"""Export on the tiny model: merges are exact (LoRA, QLoRA), refusals are clear, what ships is complete."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import make_adapter_run, plan_for, tiny_cfg

from finetune.core.config.export import ExportConfig
from finetune.export import merge
from finetune.export import stage as export_stage

# Export alone (no evaluation of the merged model: tests/test_eval.py covers that).
NO_EVAL = dict(evaluate_merged=False)


def _export_cfg(run_dir: Path, method: str = "lora", **export):
    """The tiny `method` run in `run_dir`, exported with these export settings (and NO_EVAL)."""
    return replace(
        tiny_cfg(f"method={method}", run_dir=run_dir), export=ExportConfig(**{**NO_EVAL, **export})
    )


@pytest.fixture(scope="module")
def held_out(tiny_data):
    return tiny_data[1].select(range(12))


def _logits(model, inputs):
    return merge.logits_on(model, inputs)


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _inputs(held_out, n=3):
    return [torch.tensor(held_out[i]["input_ids"][:64]) for i in range(n)]


def test_lora_merge_matches_the_adapter_model_and_ships_everything(tmp_path, tiny_cache, held_out):
    from finetune.modeling import tiny
    from finetune.modeling.loading import attach_adapter

    run = tmp_path / "run"
    cfg = _export_cfg(run)
    make_adapter_run(run, cfg.model, cfg.method)
    summary = export_stage.run(cfg, run, plan_for(cfg), eval_dataset=held_out)

    out = run / "export"
    check = json.loads((out / "merge_check.json").read_text())
    assert check["ok"] and check["max_abs_diff"] <= check["tolerance"] == 1e-3
    assert check["max_abs_diff"] < 1e-4 and check["top1_agreement"] == 1.0 and check["tokens"] > 50
    assert check["base"] == "original" and check["dtype"] == "fp32"

    # What ships: safetensors shards, tokenizer with its chat template, generation config; no adapter leftovers.
    merged = out / "merged"
    assert [p.name for p in merged.glob("*.safetensors")] and not list(merged.glob("*.bin"))
    assert (merged / "tokenizer.json").is_file() and (merged / "generation_config.json").is_file()
    assert not (merged / "adapter_config.json").exists()
    gen = json.loads((merged / "generation_config.json").read_text())
    tok = tiny.load_tokenizer(cfg.model)
    assert gen["eos_token_id"] == tok.eos_token_id and gen["pad_token_id"] == tok.pad_token_id
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())

    # The adapter alone, with its size.
    assert (out / "adapter" / "adapter_config.json").is_file()
    weights = (out / "adapter" / "adapter_model.safetensors").stat().st_size
    assert summary["adapter"]["weights_bytes"] == weights > 0
    assert json.loads((out / "export.json").read_text())["adapter"]["size_bytes"] >= weights

    # Independently: the merged model reloaded from disk equals base + adapter, and differs from the base
    # (a random, non-zero B makes the check meaningful).
    from transformers import AutoModelForCausalLM

    inputs = _inputs(held_out)
    reloaded = _logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), inputs)
    base = tiny.load_model(cfg.model)
    base_logits = _logits(base, inputs)
    adapter_logits = _logits(attach_adapter(base, run / "adapter"), inputs)
    assert _max_diff(reloaded, adapter_logits) < 1e-4
    assert _max_diff(reloaded, base_logits) > 0.05


@pytest.mark.parametrize("merge_base", ["original", "dequantized"])
def test_qlora_merges_into_a_16_bit_base_exactly(tmp_path, tiny_cache, held_out, merge_base):
    """QLoRA: merged in fp32/bf16, never NF4; equals the adapter on that (original or dequantized) base."""
    from transformers import AutoModelForCausalLM

    from finetune.modeling.loading import attach_adapter
    from finetune.modeling.variants import load_base

    run = tmp_path / "run"
    cfg = _export_cfg(run, "qlora", qlora_merge_base=merge_base)
    make_adapter_run(run, cfg.model, cfg.method)
    export_stage.run(cfg, run, plan_for(cfg), eval_dataset=held_out)

    check = json.loads((run / "export" / "merge_check.json").read_text())
    assert check["ok"] and check["max_abs_diff"] < 1e-4 and not check["lossy"]
    assert check["base"] == ("original" if merge_base == "original" else "nf4 dequantized")
    config = json.loads((run / "export" / "merged" / "config.json").read_text())
    assert "quantization_config" not in config

    inputs = _inputs(held_out)
    merged = _logits(
        AutoModelForCausalLM.from_pretrained(run / "export" / "merged", dtype=torch.float32), inputs
    )
    trained = _logits(attach_adapter(load_base(cfg, torch.float32, quantized=True), run / "adapter"), inputs)
    if merge_base == "dequantized":
        # The adapter on the dequantized NF4 base is the trained model itself: the merge reproduces it.
        assert _max_diff(merged, trained) < 1e-4
    else:
        # The original weights differ from their NF4 rounding: the merge equals the adapter on the
        # original base, and the trained (NF4) model only approximately.
        original = _logits(attach_adapter(load_base(cfg, torch.float32), run / "adapter"), inputs)
        assert _max_diff(merged, original) < 1e-4
        assert _max_diff(merged, trained) > 1e-3


def test_lossy_4bit_merge_only_when_asked(tmp_path, tiny_cache, held_out, caplog):
    run = tmp_path / "run"
    cfg = _export_cfg(run, "qlora", allow_lossy_4bit_merge=True, tolerance=10.0)
    make_adapter_run(run, cfg.model, cfg.method)
    with caplog.at_level("WARNING"):
        summary = export_stage.run(cfg, run, plan_for(cfg), eval_dataset=held_out)
    assert "allow_lossy_4bit_merge=true" in caplog.text
    check = summary["merge_check"]
    assert check["lossy"] and check["base"] == "nf4 (lossy)" and check["max_abs_diff"] > 1e-4
    assert "quantization_config" in json.loads((run / "export" / "merged" / "config.json").read_text())
    serve = summary["serve"]
    assert "bitsandbytes" in serve["merged"]["argv"] and "fp8" not in serve


def test_merge_refused_without_host_ram_for_the_base(tmp_path, tiny_cache, held_out):
    run = tmp_path / "run"
    cfg = _export_cfg(run)
    make_adapter_run(run, cfg.model, cfg.method)
    plan = replace(plan_for(cfg), merge_host_memory_gb=1e6)
    with pytest.raises(
        merge.ExportError, match=r"merging needs 1000000.0 GB of host RAM.*export.merge=false"
    ):
        export_stage.run(cfg, run, plan, eval_dataset=held_out)
    assert not (run / "export" / "merged").exists()

    # export.merge=false ships the adapter alone; serve.sh has only the base + adapter variant.
    cfg = _export_cfg(run, merge=False)
    summary = export_stage.run(cfg, run, plan, eval_dataset=held_out)
    assert list(summary["serve"]) == ["lora"] and not (run / "export" / "merged").exists()
    assert "merge_check" not in summary


def test_failed_merge_check_ships_nothing(tmp_path, tiny_cache, held_out):
    run = tmp_path / "run"
    cfg = _export_cfg(run, tolerance=1e-12)
    make_adapter_run(run, cfg.model, cfg.method)
    with pytest.raises(merge.ExportError, match="merge check failed") as failed:
        export_stage.run(cfg, run, plan_for(cfg), eval_dataset=held_out)
    # The numbers are in the one line; nothing is written (a check never stands beside another model).
    assert "> export.tolerance=1e-12 (mean " in str(failed.value) and " tokens); nothing was exported" in str(
        failed.value
    )
    assert not (run / "export").exists() and not (run / ".export.tmp").exists()


def test_full_finetune_exports_the_model(tmp_path, tiny_cache, held_out):
    from finetune.modeling import tiny

    run = tmp_path / "run"
    cfg = _export_cfg(run, "full")
    model = tiny.load_model(cfg.model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.01)
    model.save_pretrained(run / "model")
    tiny.load_tokenizer(cfg.model).save_pretrained(run / "model")
    summary = export_stage.run(cfg, run, plan_for(cfg), eval_dataset=held_out)
    assert summary["merge_check"]["ok"] and summary["merge_check"]["max_abs_diff"] == 0.0
    assert (run / "export" / "merged" / "model.safetensors").is_file()
    assert "adapter" not in summary and list(summary["serve"]) == ["merged", "fp8"]


def test_check_inputs_fall_back_to_regression_prompts(tiny_tokenizer):
    rows = [[{"role": "user", "content": "hello there"}], [{"role": "user", "content": "bonjour"}]]
    inputs = merge.check_inputs(None, tiny_tokenizer, 4, 5, rows)
    assert len(inputs) == 2 and all(0 < len(x) <= 5 for x in inputs)


def test_host_memory_check():
    assert merge.check_host_memory(1.0, available_gb=2.0) == 2.0
    with pytest.raises(merge.ExportError, match="3.0 GB of host RAM"):
        merge.check_host_memory(3.0, available_gb=2.0)


def test_export_config_validation():
    from finetune.core.errors import ConfigError

    with pytest.raises(ConfigError, match="export.qlora_merge_base"):
        ExportConfig(qlora_merge_base="nf4")
    with pytest.raises(ConfigError, match="export.tolerance"):
        ExportConfig(tolerance=0)
    with pytest.raises(ConfigError, match="export.gpu_memory_utilization"):
        ExportConfig(gpu_memory_utilization=1.5)
    assert ExportConfig().tolerance_for("bf16") > ExportConfig().tolerance_for("fp32")
    assert ExportConfig(tolerance=0.5).tolerance_for("fp32") == 0.5


def test_export_yaml_matches_the_schema():
    import yaml

    from finetune.core.composition import package_dir

    raw = yaml.safe_load((package_dir("configs") / "export" / "default.yaml").read_text())
    assert raw == {k: v for k, v in ExportConfig().__dict__.items()}
