"""GRPO's rollout plan in bytes: colocate share, server split, refusals, the generation time term.

Llama 3.1 8B: 8,030,261,248 parameters (16.06 GB in bf16), KV cache 2 x 32 layers x 8 heads x 128 x 2 B
= 131,072 bytes a token; 70B: 70,553,706,496 parameters, 327,680 bytes a token. One round: 8 prompts
x 8 generations of 256 prompt + 512 completion tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.core.config import ModelConfig
from finetune.core.config.grpo import GRPOObjective
from finetune.planner.rollout import (
    DECODE_BANDWIDTH_EFFICIENCY,
    VLLM_OVERHEAD_BYTES,
    kv_bytes_per_token,
    plan_rollout,
    rollout_job,
)

REPO = Path(__file__).resolve().parent.parent
H100 = dict(device="cuda", gpu_bytes=80e9, hbm_bytes_per_s=3.35e12, vllm_available=True)
GRPO = GRPOObjective(num_generations=8, max_completion_length=512)


def model(name: str) -> ModelConfig:
    return ModelConfig(**yaml.safe_load((REPO / "configs" / "model" / f"{name}.yaml").read_text()))


def job(name: str):  # type: ignore[no-untyped-def]
    return rollout_job(model(name), GRPO, generation_batch_size=64, prompt_tokens=256, steps_per_generation=4)


def test_kv_cache_and_weights_in_bytes() -> None:
    assert kv_bytes_per_token(model("llama3_1_8b")) == 131_072
    assert kv_bytes_per_token(model("llama3_1_70b")) == 327_680
    j = job("llama3_1_8b")
    assert j.weight_bytes == 16_060_522_496
    # 64 sequences of 768 tokens
    assert j.kv_bytes(64) == 64 * 768 * 131_072 == 6_442_450_944


def test_8b_on_one_h100_colocates_and_says_what_each_side_gets() -> None:
    j = job("llama3_1_8b")
    p = plan_rollout(j, gpus=1, train_peak=lambda n: 30e9, **H100)
    need = 16_060_522_496 + 6_442_450_944 + VLLM_OVERHEAD_BYTES
    assert p.mode == "colocate" and p.fits
    assert p.vllm_bytes_per_gpu == pytest.approx(need)
    # 24.5 GB of 80 GB: 0.306, rounded up to the next 5%
    assert p.vllm_gpu_memory_utilization == 0.35
    assert p.train_budget_bytes == pytest.approx(0.65 * 80e9)
    assert (p.train_gpus, p.server_gpus) == (1, 0)
    # 512 decoding steps, each reading the weights and 64 x (256 + 256) tokens of KV cache on average
    per_token = (16_060_522_496 + 64 * 512 * 131_072) / (3.35e12 * DECODE_BANDWIDTH_EFFICIENCY)
    assert p.generation_s_per_step == pytest.approx(512 * per_token / 4)
    assert "colocate: vLLM takes 0.35 of each GPU" in p.reason


def test_one_gpu_that_cannot_hold_both_sides_is_refused_with_the_alternative() -> None:
    p = plan_rollout(job("llama3_1_8b"), gpus=1, train_peak=lambda n: 60e9, **H100)
    assert p.mode == "colocate" and not p.fits
    assert p.train_peak_bytes == 60e9 and p.train_budget_bytes == pytest.approx(52e9)
    assert "server split on more GPUs" in p.alternative
    server = plan_rollout(job("llama3_1_8b"), gpus=1, train_peak=lambda n: 30e9, requested="server", **H100)
    assert not server.fits and server.alternative == "objective.generation=colocate"


def test_70b_on_8_gpus_gets_the_smallest_server_that_holds_it() -> None:
    j = job("llama3_1_70b")
    seen: list[int] = []

    def train_peak(n: int) -> float:
        seen.append(n)
        return 240e9 / n + 10e9  # sharded: less a GPU with more GPUs

    p = plan_rollout(j, gpus=8, train_peak=train_peak, **H100)
    assert p.mode == "server" and p.fits
    # weights 141.1 GB: tensor parallel 2 needs 70.55 + 8.05 + 2 = 80.6 GB > 72 GB (0.9 of 80); 4 holds it
    assert (p.server_gpus, p.tensor_parallel, p.train_gpus) == (4, 4, 4)
    assert p.vllm_bytes_per_gpu == pytest.approx(
        141_107_412_992 / 4 + 64 * 768 * 327_680 / 4 + VLLM_OVERHEAD_BYTES
    )
    assert p.train_peak_bytes == pytest.approx(70e9) and seen[-1] == 4
    assert "colocate does not fit" in p.reason


def test_a_split_where_training_cannot_fit_is_refused() -> None:
    p = plan_rollout(job("llama3_1_70b"), gpus=8, train_peak=lambda n: 100e9, **H100)
    assert p.mode == "server" and not p.fits
    assert p.alternative.startswith("neither split fits") and "more GPUs" in p.alternative


def test_cpu_and_no_vllm_generate_inside_the_trainer_with_the_kv_cache_on_the_training_side() -> None:
    j = job("llama3_1_8b")
    cpu = plan_rollout(
        j,
        device="cpu",
        gpus=1,
        gpu_bytes=24e9,
        hbm_bytes_per_s=None,
        train_peak=lambda n: 1e9,
        vllm_available=False,
    )
    assert cpu.mode == "transformers" and cpu.fits and cpu.generation_s_per_step is None
    assert cpu.train_peak_bytes == pytest.approx(1e9 + 6_442_450_944)
    gpu = plan_rollout(j, gpus=2, train_peak=lambda n: 30e9, **{**H100, "vllm_available": False})
    assert gpu.mode == "transformers" and "vLLM not installed" in gpu.reason
    assert gpu.train_peak_bytes == pytest.approx(30e9 + 6_442_450_944 / 2)


def test_the_planner_is_still_pure() -> None:
    import subprocess
    import sys

    code = "import sys, finetune.planner.rollout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_generating_inside_the_trainer_under_zero3_counts_the_whole_model_each_rank_gathers() -> None:
    """TRL generates under ZeRO-3 inside `GatheredParameters` over the whole model (ds3_gather_for_generation):
    each rank holds every weight while it samples. Llama 3.1 8B LoRA on 8 GPUs: the 16,060,522,496 bytes of the
    bf16 base and 7/8 of the 41,943,040 adapter weights (bf16 under DeepSpeed) beside the weights term's
    1/8 of the base and its two gathered layers (218,112,000 parameters each)."""
    from helpers import planned

    from finetune.planner import make_job, runtime
    from finetune.planner.weights import generation_gathered

    expected = 16_060_522_496 + 41_943_040 * 2 * 7 / 8 - (16_060_522_496 / 8 + 2 * 2 * 218_112_000)
    for engine, gathered in (("zero3", expected), ("fsdp", 0.0)):
        cfg, plan = planned(
            "+recipe=llama8b_grpo_8gpu",
            f"train.sharding={engine}",
            f"train.engine={engine}",
            "objective.generation=transformers",
        )
        planned_job = make_job(
            cfg.model, cfg.method, plan.hardware, cfg.train, plan.seq_len, objective=cfg.objective.spec
        )
        assert plan.strategy.sharding == engine and planned_job.adapter == 41_943_040
        held = generation_gathered(planned_job, plan.strategy, runtime(planned_job, plan.strategy))
        assert held == pytest.approx(gathered)
    # the rollout plan adds it to the training side in the trainer's own generation, and says so
    j = job("llama3_1_8b")
    p = plan_rollout(
        j, gpus=8, train_peak=lambda n: 40e9, requested="transformers", gathered_bytes=expected, **H100
    )
    assert p.train_peak_bytes == pytest.approx(40e9 + j.kv_bytes(64 / 8) + expected)
    assert "gathers the whole model on each rank to generate (+13.3 GB)" in p.reason
    assert "train.engine=fsdp" in p.alternative
    colocated = plan_rollout(j, gpus=1, train_peak=lambda n: 30e9, gathered_bytes=expected, **H100)
    assert colocated.mode == "colocate" and colocated.train_peak_bytes == pytest.approx(30e9)  # vLLM samples


def test_a_rollout_that_does_not_fit_makes_the_plan_not_fit_and_launch_refuses_it(tmp_path) -> None:
    """Colocated vLLM whose KV cache cannot fit one H100 beside training: plan.json says the job does not fit,
    with the rollout's reason first and its way out among the suggestions, and mode=launch refuses to start."""
    import json

    from finetune import rundir
    from finetune.core.composition import compose
    from finetune.core.errors import LaunchError
    from finetune.launch import stage
    from finetune.pipeline.stages import plan_stage, resolve

    cfg = resolve(
        compose(
            [
                "+recipe=llama8b_grpo",
                f"run_dir={tmp_path / 'run'}",
                "objective.max_completion_length=16384",
                "train.seq_len=20000",
            ]
        )
    )
    run_dir = rundir.prepare(cfg)
    rundir.save_config(cfg, run_dir)
    plan = plan_stage(cfg, run_dir, quiet=True)
    written = json.loads((run_dir / rundir.PLAN_FILE).read_text())
    rollout = json.loads((run_dir / rundir.ROLLOUT_FILE).read_text())
    assert rollout["mode"] == "colocate" and rollout["fits"] is False
    assert plan.gpu_memory.total < plan.usable_gpu_memory_gb  # the training side alone would fit
    assert written["fits"] is False and not plan.fits
    assert written["reasons"][0] == f"rollout does not fit: {rollout['reason']}"
    assert rollout["alternative"] in written["suggestions"]
    with pytest.raises(LaunchError, match="the plan does not fit: rollout does not fit: colocate"):
        stage.run(cfg, run_dir, plan, launch=cfg.launch)
