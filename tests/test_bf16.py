"""bf16 on the CPU, as the GPUs run it: every method x loss path x checkpointing trains and evaluates.

CPU autocast runs bf16 where the CPU has no native bf16 too (slowly), so the dtypes flow here as they
do on an H100: accelerate's mixed-precision wrapper hands fp32 hidden states back while a LoRA or QLoRA
base keeps its head in bf16, and full fine-tuning keeps fp32 weights under bf16 autocast. A dtype mismatch
fails at the first step (chunked loss) or after training (the worker's evaluation):
`expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import last_losses, tiny_cfg, train_run

STEPS = 3


def _train_bf16(run_dir: Path, tiny_data, method: str, chunked: bool, checkpointing: bool) -> dict:
    """A few bf16 steps of `method` on 8 rows (micro-batch 2), through either loss path, checkpointing or not."""
    cfg = tiny_cfg(
        f"method={method}",
        "method.precision=bf16",
        "method.learning_rate=3e-3",
        f"train.max_steps={STEPS}",
        "train.save_steps=1000",
        "train.warmup_ratio=0.0",
        run_dir=run_dir / "run",
    )
    return train_run(
        cfg,
        tiny_data,
        n_train=8,
        n_eval=8,
        max_generate=2,
        chunked_loss=chunked,
        activation_checkpointing=checkpointing,
        micro_batch_size=2,
        grad_accum_steps=1,
    )


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("chunked", [False, True], ids=["trl-loss", "chunked-loss"])
@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_bf16_trains_and_the_eval_stage_scores_it(
    tmp_path, tiny_cache, tiny_data, method, chunked, checkpointing
):
    m = _train_bf16(tmp_path, tiny_data, method, chunked, checkpointing)
    t, engine = m["train"], m["train"]["engine"]
    assert t["precision"] == "bf16" and t["steps"] == STEPS
    assert engine["mixed_precision"] == "bf16" and engine["loss"] == ("chunked" if chunked else "trl")
    # full: fp32 weights under autocast; LoRA: bf16 base, fp32 adapters; QLoRA: bf16 adapters, 4-bit base (uint8)
    expected_dtypes = {
        "full": ["float32"],
        "lora": ["bfloat16", "float32"],
        "qlora": ["bfloat16", "uint8"],  # bf16 adapters (QLoRA's default) on the 4-bit base
    }[method]
    assert engine["parameter_dtypes"] == expected_dtypes
    assert (
        t["strategy"]["chunked_loss"] is chunked
        and t["strategy"]["activation_checkpointing"] is checkpointing
    )
    assert engine["activation_checkpointing"] is checkpointing
    losses = last_losses(Path(m["train"]["output_dir"]).parent)
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    # The eval stage scores the saved output, loaded in bf16 as training ran it.
    base, trained = m["eval"]["base"], m["eval"]["trained"]
    assert math.isfinite(base["loss"]) and math.isfinite(trained["loss"])
    assert trained["loss"] < base["loss"] - 0.3, (base["loss"], trained["loss"])
    assert 0.0 <= trained["exact_match"] <= 1.0


def test_chunked_and_trl_loss_agree_in_bf16(tmp_path, tiny_cache, tiny_data):
    """Same data, same seed: the first step's loss (before any update) is the same through either path."""
    ours = _train_bf16(tmp_path / "ours", tiny_data, "lora", chunked=True, checkpointing=False)
    trl = _train_bf16(tmp_path / "trl", tiny_data, "lora", chunked=False, checkpointing=False)
    first_ours = last_losses(Path(ours["train"]["output_dir"]).parent)[0]
    first_trl = last_losses(Path(trl["train"]["output_dir"]).parent)[0]
    assert first_ours == pytest.approx(first_trl, rel=2e-3)
    assert ours["eval"]["base"]["loss"] == pytest.approx(trl["eval"]["base"]["loss"], rel=1e-6)


def test_heldout_loss_after_mixed_precision_wrapping_matches_plain_bf16(
    tiny_cache, tiny_model_cfg, tiny_data
):
    """accelerate's wrapper (autocast + fp32 outputs) around a bf16 LoRA model: the held-out loss is the
    one the bare bf16 model gives (it crashed: fp32 hidden states into a bf16 head)."""
    from accelerate.utils import convert_outputs_to_fp32
    from peft import get_peft_model

    from finetune.core.config import MethodConfig
    from finetune.evaluation.heldout import heldout_loss
    from finetune.modeling import tiny
    from finetune.modeling.loading import lora_config

    model = tiny.load_model(tiny_model_cfg).to(torch.bfloat16)
    model = get_peft_model(model, lora_config(MethodConfig(lora_dropout=0.0), tiny_model_cfg))
    evals = tiny_data[1].select(range(8))
    bare = heldout_loss(model, evals, pad_token_id=0)
    forward = model.forward.__func__
    model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(forward)).__get__(
        model
    )
    wrapped = heldout_loss(model, evals, pad_token_id=0)
    assert math.isfinite(bare) and wrapped == pytest.approx(bare, rel=1e-2)
