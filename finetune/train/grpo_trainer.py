"""GRPO through TRL's `GRPOTrainer`: the project's rewards, its settings, generation where the plan says.

TRL samples `num_generations` completions per prompt, scores each with the reward functions, and
trains on the advantages within each group. What is ours: the rewards (`finetune/evaluation/rewards.py`,
one finite number per completion or a one-line `RewardError`), the mapping of `GrpoConfig` onto
`GRPOConfig`, and the generation mode (`transformers` inside the trainer on the CPU and wherever vLLM is
absent; vLLM `colocate` or `server` on CUDA).

Data: rows of `prompt` (a string, or a list of chat messages) and `reference` (the checkable answer);
`prompt_rows` turns the bundled conversations into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from trl import GRPOConfig, GRPOTrainer

from finetune.core.config.grpo import GrpoConfig
from finetune.core.errors import ConfigError
from finetune.evaluation.rewards import Reward

REFERENCE_COLUMN = "reference"


def _text(item: Any) -> str:
    """A completion or prompt as text: TRL hands conversational ones as message lists."""
    if isinstance(item, str):
        return item
    if isinstance(item, list) and item and isinstance(item[-1], dict):
        return str(item[-1].get("content", ""))
    return str(item)


def prompt_rows(conversations: Sequence[dict]) -> list[dict]:
    """Chat records (`messages` ending with the assistant's answer) as GRPO rows: the conversation up to
    the answer is the prompt, the answer is the reference the rewards check."""
    rows = []
    for i, record in enumerate(conversations):
        messages = record.get("messages")
        if not messages or messages[-1].get("role") != "assistant":
            raise ConfigError(
                f"GRPO prompts: record {i} does not end with an assistant answer to check against"
            )
        rows.append({"prompt": list(messages[:-1]), REFERENCE_COLUMN: str(messages[-1]["content"])})
    return rows


def trl_reward_function(reward: Reward) -> Any:
    """`reward` in TRL's calling convention: (prompts, completions, **dataset columns) -> list of floats."""

    def reward_fn(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        references = columns.get(REFERENCE_COLUMN)
        if references is None:
            raise ConfigError(
                f"GRPO data: no {REFERENCE_COLUMN!r} column for reward {reward.name!r} to check"
            )
        return reward.score([_text(p) for p in prompts], [_text(c) for c in completions], list(references))

    # TRL logs each reward as rewards/<__name__>/mean: the configured name, not "reward_fn"
    reward_fn.__name__ = reward.name
    reward_fn.__qualname__ = reward.name
    return reward_fn


def uses_vllm(mode: str) -> bool:
    """`colocate` and `server` sample through vLLM; `transformers` inside the trainer."""
    return mode in ("colocate", "server")


def build_grpo_config(
    grpo: GrpoConfig,
    rewards: Sequence[Reward],
    output_dir: Path,
    *,
    generation: str,
    activation_checkpointing: bool = False,
    **training: Any,
) -> GRPOConfig:
    """TRL's `GRPOConfig` from ours; `generation` is the resolved mode (never `auto`), `training` the
    Trainer arguments shared with SFT (batch, schedule, precision, intervals, seed)."""
    if generation == "auto":
        raise ConfigError("grpo.generation=auto must be resolved by the planner before training")
    vllm: dict[str, Any] = {}
    if uses_vllm(generation):
        vllm = dict(use_vllm=True, vllm_mode=generation)
        if generation == "colocate":
            vllm["vllm_gpu_memory_utilization"] = grpo.vllm_gpu_memory_utilization
        else:
            vllm.update(
                vllm_server_port=grpo.vllm_server_port, vllm_server_timeout=grpo.vllm_server_timeout_s
            )
    extra: dict[str, Any] = {}
    if grpo.steps_per_generation is not None:
        extra["steps_per_generation"] = grpo.steps_per_generation
    return GRPOConfig(
        output_dir=str(output_dir),
        num_generations=grpo.num_generations,
        max_completion_length=grpo.max_completion_length,
        temperature=grpo.temperature,
        beta=grpo.beta,
        reward_weights=[r.weight for r in rewards],
        # GRPOConfig defaults the deprecated `gradient_checkpointing` to True; the new name, set, wins silently
        activation_checkpointing=activation_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if activation_checkpointing else None,
        **vllm,
        **extra,
        **training,
    )


def build_grpo_trainer(
    model: Any,
    tokenizer: Any,
    train_dataset: Any,
    rewards: Sequence[Reward],
    args: GRPOConfig,
    peft_config: Optional[Any] = None,
    callbacks: Optional[list[Any]] = None,
) -> GRPOTrainer:
    """TRL's trainer on our rewards (weights already in `args.reward_weights`)."""
    return GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward_function(r) for r in rewards],
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
