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
