"""GRPO and RLOO with a learned reward (`objective.reward_model`, a frozen companion) on two CPU ranks: the reward
model scores each rank's completions on that rank, held as the plan counts it: whole on each rank under DDP, half
on each under ZeRO-3 (TRL's partitioned copy) and FSDP2 (sharded like the policy).

    pytest -m extended tests/test_learned_reward_distributed.py

Driven through the CLI's modes; the engine record (metrics.json's train.engine) gives each rank's share of the
reward model's parameters and the forwards it ran there: one a step (a step's completions scored at once).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import HALF, SHORT_RUN, reward_model_folder, run_on_engine

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.extended]

STEPS = 2
SHARE = {"ddp": 1.0, "zero3": HALF, "fsdp2": HALF}


@pytest.mark.parametrize("engine", list(SHARE))
@pytest.mark.parametrize("objective", ["grpo", "rloo"])
def test_the_reward_model_scores_on_each_rank_held_as_planned(
    objective: str, engine: str, tiny_cache: Path, tiny_model_cfg, tmp_path: Path
) -> None:
    folder = reward_model_folder(tmp_path, tiny_model_cfg)
    run = run_on_engine(
        tmp_path, "run", engine, f"objective={objective}", "train.batch_size=4", "objective.num_generations=4",
        "objective.max_completion_length=6", f"objective.reward_model={folder}", "objective.reward_model_weight=0.5",
        "method.precision=bf16", "hardware=cpu", "train.micro_batch_size=2", "train.grad_accum_steps=1",
        *SHORT_RUN, steps=STEPS, timeout=1800,
    )  # fmt: skip
    train = run.metrics["train"]
    rewards = train[objective]["rewards"]
    assert set(rewards) == {"exact_match", "reward_model"} and rewards["reward_model"]["first"] != 0.0
    held = [r["companions"]["reward_model"] for r in run.engine["ranks"]]
    assert [h["forwards"] for h in held] == [STEPS, STEPS]
    assert [h["share"] for h in held] == pytest.approx([SHARE[engine]] * 2, abs=0.025)
