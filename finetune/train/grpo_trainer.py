"""GRPO through TRL's `GRPOTrainer`: the project's rewards, its settings, generation where the plan says.

TRL samples `num_generations` completions per prompt, scores each with the reward functions (and a
learned reward model: `objective.reward_model`, a frozen sequence classifier; `reward_sources`), and
trains on the advantages within each group. What is ours: the rewards (`finetune/core/rewards.py`,
one finite number per completion or a one-line `RewardError`), the mapping of `GRPOObjective` onto
`GRPOConfig`, and the generation mode (`transformers` inside the trainer on the CPU and wherever vLLM is
absent; vLLM `colocate` or `server` on CUDA).

Data: rows of `prompt` (a string, or a list of chat messages) and `reference` (the checkable answer);
`prompt_rows` turns the bundled conversations into them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from trl import GRPOConfig, GRPOTrainer

from finetune import rundir
from finetune.core import rewards as reward_fns
from finetune.core.config import Config
from finetune.core.config.grpo import GRPOObjective
from finetune.core.errors import ConfigError
from finetune.core.rewards import Reward
from finetune.modeling import dtypes, reward_model
from finetune.planner import Plan
from finetune.train.base_trainer import RunTrainerMixin, WatchedCompanion, common_kwargs, shard_frozen
from finetune.train.callbacks import RunMonitor

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


def configured_rewards(objective: Any) -> list[Reward]:
    """The settings' rewards resolved (none when `objective.rewards=[]` leaves the reward model alone)."""
    if not objective.rewards:
        return []
    return reward_fns.resolve(
        objective.rewards, objective.reward_weights, timeout_s=objective.reward_timeout_s
    )


def reward_weights(objective: Any, rewards: Sequence[Reward]) -> list[float]:
    """GRPOConfig's `reward_weights`, in the order of `reward_sources`: each reward's, then the reward model's."""
    learned = [float(objective.reward_model_weight)] if objective.reward_model else []
    return [r.weight for r in rewards] + learned


def reward_sources(cfg: Config, tokenizer: Any) -> dict[str, Any]:
    """The trainer's `reward_funcs` and `reward_processing_classes`: the settings' rewards in TRL's calling
    convention, then the learned reward model when `objective.reward_model` names one (a frozen sequence
    classifier TRL scores each prompt + completion with, rendered by its tokenizer's chat template). Shared by
    every objective built on GRPO's settings."""
    rewards = configured_rewards(cfg.objective)
    funcs: list[Any] = [trl_reward_function(r) for r in rewards]
    classes: list[Any] = [None] * len(funcs)
    if cfg.objective.reward_model:
        model, reward_tokenizer = reward_model.load(
            cfg.objective.reward_model, cfg.model, dtypes.training_dtype(cfg)
        )
        funcs.append(model)
        classes.append(reward_tokenizer)
    return dict(reward_funcs=funcs, reward_processing_classes=classes)


def uses_vllm(mode: str) -> bool:
    """`colocate` and `server` sample through vLLM; `transformers` inside the trainer."""
    return mode in ("colocate", "server")


def generation_mode(cfg: Config, run_dir: Optional[Path] = None) -> str:
    """Where this run samples: on the server the launcher started when the plan split the GPUs
    (rollout.json), else `objective.generation`, with `auto` resolved on this machine (vLLM only on CUDA with
    vLLM installed)."""
    planned = rundir.load_rollout(run_dir) if run_dir is not None else None
    if planned is not None and planned.get("fits") and planned["mode"] == "server":
        return "server"
    mode = cfg.objective.generation
    if mode != "auto":
        return mode
    if cfg.hardware.device != "cuda":
        return "transformers"
    import importlib.util

    return "colocate" if importlib.util.find_spec("vllm") is not None else "transformers"


def grpo_arguments(grpo: GRPOObjective, rewards: Sequence[Reward], generation: str) -> dict[str, Any]:
    """GRPOConfig's own fields from ours; `generation` is the resolved mode (never `auto`)."""
    if generation == "auto":
        raise ConfigError("objective.generation=auto must be resolved before training")
    kwargs: dict[str, Any] = dict(
        num_generations=grpo.num_generations,
        max_completion_length=grpo.max_completion_length,
        temperature=grpo.temperature,
        beta=grpo.beta,
        loss_type=grpo.loss_type,
        mask_truncated_completions=grpo.mask_truncated_completions,
        reward_weights=reward_weights(grpo, rewards),
        # ZeRO-3: gather the sharded weights for transformers' generation (TRL's default, stated)
        ds3_gather_for_generation=True,
    )
    if grpo.steps_per_generation is not None:
        kwargs["steps_per_generation"] = grpo.steps_per_generation
    if uses_vllm(generation):
        kwargs.update(use_vllm=True, vllm_mode=generation)
        if generation == "colocate":
            kwargs["vllm_gpu_memory_utilization"] = grpo.vllm_gpu_memory_utilization
        else:
            # the launcher's server (launch.sh) on this node, at the address it was started with
            kwargs.update(
                vllm_server_host=grpo.vllm_server_host,
                vllm_server_port=grpo.vllm_server_port,
                vllm_server_timeout=grpo.vllm_server_timeout_s,
            )
    return kwargs


def build_grpo_config(
    grpo: GRPOObjective,
    rewards: Sequence[Reward],
    output_dir: Path,
    *,
    generation: str,
    activation_checkpointing: bool = False,
    **training: Any,
) -> GRPOConfig:
    """TRL's `GRPOConfig` outside a run directory (tests, scripts): ours plus the Trainer arguments given."""
    return GRPOConfig(
        output_dir=str(output_dir),
        # GRPOConfig defaults the deprecated `gradient_checkpointing` to True; the new name, set, wins silently
        activation_checkpointing=activation_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if activation_checkpointing else None,
        **grpo_arguments(grpo, rewards, generation),
        **training,
    )


def build_config(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> GRPOConfig:
    """The shared arguments plus GRPO's."""
    return GRPOConfig(**rollout_kwargs(cfg, plan, run_dir, compute_dtype))


def rollout_kwargs(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> dict[str, Any]:
    """The shared arguments plus GRPO's settings, for GRPOConfig and the configs of its kin (RLOO's). A batch
    (micro x accumulation x ranks) counts completions; it must hold whole groups of `objective.num_generations`."""
    kwargs = common_kwargs(cfg, plan, run_dir, compute_dtype)
    # TRL 1.16's GRPOConfig and RLOOConfig have no activation offloading (SFTConfig and DPOConfig do).
    if kwargs.pop("activation_offloading", False):
        spec = cfg.objective.spec
        raise ConfigError(
            f"plan.json: strategy.activation_offloading=true, which TRL's {spec.trl_trainer} does not run; "
            f"set train.activation_offloading=false for objective={spec.name}"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    completions = kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] * world
    if completions % cfg.objective.num_generations:
        raise ConfigError(
            f"train.batch_size: {completions} completions a step is not a multiple of objective.num_generations="
            f"{cfg.objective.num_generations}; make train.batch_size a multiple of it"
        )
    kwargs.update(
        grpo_arguments(cfg.objective, configured_rewards(cfg.objective), generation_mode(cfg, run_dir))
    )
    # The held-out prompts are scored by the evaluation (base, trained, merged under the same sampling),
    # not by TRL's in-training evaluation, which would sample num_generations completions of each.
    kwargs.update(eval_strategy="no", per_device_eval_batch_size=cfg.objective.num_generations)
    return kwargs


# TRL's logged keys summarised into metrics.json (train.grpo): first and last logged value, and the mean.
_LOGGED = {
    "reward": "reward",
    "reward_std": "reward_std",
    "completion_mean_length": "completions/mean_length",
    "completion_clipped_ratio": "completions/clipped_ratio",
    "kl": "kl",
    "step_time": "step_time",
}


def objective_metrics(log_history: list[dict]) -> dict[str, Any]:
    """Reward mean and spread, completion lengths, KL (beta > 0), per-reward means: first, last, mean over
    the logged steps, so a run shows whether the reward rose."""
    logged = [h for h in log_history if "reward" in h]

    def summary(key: str) -> Optional[dict[str, float]]:
        values = [float(h[key]) for h in logged if key in h]
        if not values:
            return None
        return {"first": values[0], "last": values[-1], "mean": sum(values) / len(values)}

    out: dict[str, Any] = {"logged_steps": len(logged)}
    for name, key in _LOGGED.items():
        if (value := summary(key)) is not None:
            out[name] = value
    names = [
        k[len("rewards/") : -len("/mean")]
        for k in (logged[0] if logged else {})
        if k.startswith("rewards/") and k.endswith("/mean")
    ]
    out["rewards"] = {name: summary(f"rewards/{name}/mean") for name in names}
    return out


def prepare_reward_model(trainer: Any) -> dict[str, WatchedCompanion]:
    """The learned reward model among the trainer's reward functions as the plan counts it: divided over the ranks
    like the policy under FSDP2 (TRL partitions it under ZeRO-3 itself), its forwards watched for the engine
    record. Shared by every trainer built on GRPO's settings."""
    watched = {}
    for i, func in enumerate(trainer.reward_funcs):
        if isinstance(func, torch.nn.Module):
            if trainer.is_fsdp_enabled:
                func = trainer.reward_funcs[i] = shard_frozen(func, trainer.accelerator)
            watched[reward_model.LOGGED_NAME] = WatchedCompanion(func)
    return watched


class FinetuneGRPOTrainer(RunTrainerMixin, GRPOTrainer):
    """GRPOTrainer on the data stage's prompts, with the run's checkpoints and state."""

    def __init__(self, *args: Any, monitor: Optional[RunMonitor] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._init_run(monitor)
        self.companions = prepare_reward_model(self)


Trainer = FinetuneGRPOTrainer


def trainer_kwargs(cfg: Config, plan: Plan, tokenizer: Any, eval_dataset: Any) -> dict[str, Any]:
    """GRPO's own arguments of the trainer: the rewards in TRL's calling convention and the learned reward model
    (no held-out rows: the evaluation scores the held-out prompts)."""
    return reward_sources(cfg, tokenizer)


def build_grpo_trainer(
    model: Any,
    tokenizer: Any,
    train_dataset: Any,
    rewards: Sequence[Reward],
    args: GRPOConfig,
    peft_config: Optional[Any] = None,
    callbacks: Optional[list[Any]] = None,
) -> GRPOTrainer:
    """TRL's trainer on our rewards outside a run directory (tests, scripts)."""
    return GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward_function(r) for r in rewards],
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
