"""RLOO's plan against what TRL's RLOOTrainer runs: the completions a step in whole groups, the rollout (where
generation runs and its time on a GPU), and a measured CPU step's peak against the plan's total.

The measured step is the pipeline's own: `+recipe=tiny_rloo` at 8 completions a step (the tiny model, LoRA r32
on the seven projections, fp32 on the CPU, completions of at most 8 tokens, transformers' generation in the
trainer, beta = 0.05 so the reference forward runs: TRL's "ref" copy of the starting adapter, under no_grad
in the rollout) through `mode=data` then `mode=train` (the worker process, 3 steps), and `+recipe=tiny_grpo`
the same way. The plan is made at the rows TRL trains on (the longest kept prompt + max_completion_length).
Measured (transformers 5.25): RLOO 0.719 GB, GRPO 0.718 GB, both planned at 0.722 GB (the plan 0.4% over; 0.674,
5.3% under, before it counted the worker's imports of the installed mlflow and wandb, MEMORY_MODEL.md section 6):
what RLOO runs beyond GRPO (the policy's and the reference's log-probabilities in every rollout) adds nothing to
the peak.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import planned, run_modes


def _three_steps(tmp_path: Path, recipe: str) -> tuple[dict, dict]:
    run = tmp_path / recipe
    args = [
        f"+recipe={recipe}",
        "train.batch_size=8",
        "train.max_steps=3",
        "train.report_to=[]",
        f"run_dir={run}",
    ]
    run_modes(args, run)
    plan = json.loads((run / "plan.json").read_text())
    return plan, json.loads((run / "metrics.json").read_text())["train"]


@pytest.mark.slow  # two data stages and two workers of 3 steps: about 3 minutes on 2 shared cores
def test_cpu_step_peak_is_grpo_s_and_within_5_percent_of_the_plan(tiny_cache: Path, tmp_path: Path) -> None:
    plan, train = _three_steps(tmp_path, "tiny_rloo")
    # one micro-batch of the step's 8 completions (2 groups of 4), at the rows TRL forms
    assert (plan["strategy"]["micro_batch_size"], plan["strategy"]["grad_accum_steps"]) == (8, 1)
    assert plan["seq_len"] < 128 and any("rows" in r for r in plan["reasons"])
    assert train["steps"] == 3 and "kl" in train["rloo"]  # beta > 0: the reference forward ran
    assert train["peak_memory_source"] == "process_peak_rss"
    grpo_plan, grpo = _three_steps(tmp_path, "tiny_grpo")
    assert grpo_plan["gpu_memory_gb"] == plan["gpu_memory_gb"]
    assert train["peak_memory_gb"] == pytest.approx(grpo["peak_memory_gb"], rel=0.02)
    assert train["peak_memory_gb"] == pytest.approx(train["planned_memory_gb"], rel=0.05)


def test_completions_come_in_whole_groups_and_the_rollout_is_planned_as_grpo_s(tmp_path: Path) -> None:
    """RLOO's step is counted in completions (num_generations per prompt), and its rollout (vLLM colocated on
    an H100: its share, the training side re-planned on the rest, the generation time) is the arithmetic of
    GRPO's for the same shape: 4 prompts x 8 completions of 512 tokens after prompts of up to 512."""
    from helpers import command_line_plan

    cfg, _ = planned("+recipe=llama8b_rloo")
    assert cfg.objective.spec.sequences_setting == "num_generations"
    assert cfg.train.batch_size % cfg.objective.num_generations == 0
    rloo = command_line_plan(tmp_path / "rloo", "+recipe=llama8b_rloo")
    # the same KL coefficient (the recipe's 0.05; GRPO's default is 0): the same reference forward a round
    grpo = command_line_plan(tmp_path / "grpo", "+recipe=llama8b_grpo", "objective.beta=0.05")
    assert rloo["fits"] and rloo["strategy"] == grpo["strategy"]
    assert rloo["gpu_memory_gb"] == grpo["gpu_memory_gb"] and rloo["estimate"] == grpo["estimate"]
    rollouts = [json.loads((tmp_path / n / "cli-run" / "rollout.json").read_text()) for n in ("rloo", "grpo")]
    assert rollouts[0] == rollouts[1]
    assert rollouts[0]["mode"] == "colocate" and rollouts[0]["generation_s_per_step"] > 0
    # 8B weights in bf16 (16.06 GB) + the KV cache of the 32 completions (4.29 GB) + vLLM's 2 GB
    assert rollouts[0]["vllm_bytes_per_gpu"] == pytest.approx(16_060_522_496 + 4.295e9 + 2e9, rel=1e-3)


LLAMA8B_PARAMS = 8_030_261_248
TINY_PARAMS = 918_656


@pytest.mark.parametrize("recipe", ["rloo", "grpo"])
@pytest.mark.parametrize("sharding", ["zero3", "fsdp"])
def test_full_fine_tuning_with_a_kl_term_holds_the_reference_copy_sharded_like_the_policy(recipe, sharding):
    """Under full fine-tuning with beta > 0 TRL's GRPOTrainer and RLOOTrainer build a frozen reference copy in the
    policy's dtype and prepare it with the policy's engine (`prepare_deepspeed` / `prepare_fsdp`): 8B in bf16 over
    8 ranks, 2 x 8,030,261,248 / 8 bytes a rank more than with beta = 0; its forward (2 FLOPs a weight a trained
    token, in the rollout) lengthens the step. LoRA keeps no copy (the base with the adapter disabled)."""
    base = (f"+recipe=llama8b_{recipe}", "hardware=h100x8", f"train.sharding={sharding}",
            "train.micro_batch_size=1", "train.activation_checkpointing=true")  # fmt: skip
    _, kl = planned(*base, "method=full", "objective.beta=0.05")
    _, none = planned(*base, "method=full", "objective.beta=0")
    assert kl.strategy == none.strategy and kl.params_total == LLAMA8B_PARAMS
    assert (kl.gpu_memory.weights - none.gpu_memory.weights) * 1e9 == pytest.approx(2 * LLAMA8B_PARAMS / 8)
    assert kl.estimate.step_seconds > none.estimate.step_seconds
    _, lora_kl = planned(*base, "method=lora", "objective.beta=0.05")
    _, lora_none = planned(*base, "method=lora", "objective.beta=0")
    assert lora_kl.gpu_memory.weights == lora_none.gpu_memory.weights


def test_the_cpu_plan_counts_the_fp32_reference_copy():
    """One CPU process, fp32: the copy is the tiny model's 918,656 parameters at 4 bytes (TRL builds it with the
    policy's dtype), the weights term doubled."""
    _, kl = planned("+recipe=tiny_rloo", "method=full", "objective.beta=0.05")
    _, none = planned("+recipe=tiny_rloo", "method=full", "objective.beta=0")
    assert kl.params_total == TINY_PARAMS and none.gpu_memory.weights * 1e9 == pytest.approx(4 * TINY_PARAMS)
    assert (kl.gpu_memory.weights - none.gpu_memory.weights) * 1e9 == pytest.approx(4 * TINY_PARAMS)
