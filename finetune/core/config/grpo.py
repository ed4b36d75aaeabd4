"""Schema of GRPO's settings (`objective=grpo`): the rewards, the shape of the rollout, and where generation runs.

The names follow TRL's `GRPOConfig` (`num_generations`, `max_completion_length`, `beta`, ...), so a
user who knows TRL reads them as they are. `generation` says where completions are sampled:
`transformers` (inside the trainer, every device, what the CPU tests run), `colocate` (vLLM inside
each training process, sharing its GPU) or `server` (`trl vllm-serve` on GPUs of its own);
`auto` lets the planner choose (`finetune/planner/rollout.py`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from finetune.core import userfiles
from finetune.core.config.checks import DATA_KEY, check_positive, choice
from finetune.core.config.evaluation import check_metric_name
from finetune.core.config.objective import ObjectiveConfig
from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES, Companion

GENERATION_MODES = ("auto", "transformers", "colocate", "server")
# TRL 1.16's GRPOConfig.loss_type values (how the per-token losses are aggregated; `dapo` is TRL's default).
LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
# A format reward: the whole completion matches the pattern.
FORMAT_PREFIX = "format:"


def check_reward_name(name: str, key: str = "objective.rewards") -> None:
    """A reward name is a metric name (`check_metric_name`) or `format:<pattern>`."""
    if name.startswith(FORMAT_PREFIX):
        try:
            re.compile(name[len(FORMAT_PREFIX) :])
        except re.error as exc:
            raise ConfigError(f"{key}: {name!r} is not a valid regular expression ({exc})") from None
        return
    check_metric_name(name, key)


REWARD_MODEL_KEY = "objective.reward_model"


def check_reward_model(path: str) -> str:
    """What `objective.reward_model=PATH` names, from its files alone: "run" (a run directory of an objective that
    trains a score head, by its config.yaml) or "folder" (a saved one-label sequence classifier, by its
    config.json); anything else is one line naming the key."""
    folder = Path(path).expanduser()
    if (folder / "config.yaml").exists():
        try:
            doc = yaml.safe_load(userfiles.read_text(folder / "config.yaml", REWARD_MODEL_KEY))
        except (ValueError, RecursionError, yaml.YAMLError) as exc:
            raise ConfigError(f"{REWARD_MODEL_KEY}={path}: config.yaml cannot be read ({exc})") from None
        section = doc.get("objective") if isinstance(doc, dict) else None
        name = section.get("name", "sft") if isinstance(section, dict) else "sft"
        if name not in OBJECTIVES or OBJECTIVES[name].head != "score":
            raise ConfigError(
                f"{REWARD_MODEL_KEY}={path}: a run of objective={name}, which trains no reward model (train one "
                "with objective=reward, then point this at its run directory)"
            )
        return "run"
    if not (folder / "config.json").exists():
        raise ConfigError(
            f"{REWARD_MODEL_KEY}={path}: neither a reward-model run directory (config.yaml) nor a model folder "
            "(config.json)"
        )
    try:  # through the bounded reader: a FIFO or a device there is refused, not read forever
        config = json.loads(userfiles.read_text(folder / "config.json", REWARD_MODEL_KEY))
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{REWARD_MODEL_KEY}={path}: config.json cannot be read ({exc})") from None
    architectures = config.get("architectures") or [] if isinstance(config, dict) else []
    labels = (
        len(config.get("id2label") or {}) or config.get("num_labels", 2) if isinstance(config, dict) else 0
    )
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures) or labels != 1:
        raise ConfigError(
            f"{REWARD_MODEL_KEY}={path}: not a reward model (config.json: {', '.join(architectures) or 'no architectures'}, "
            f"{labels} labels); a reward model is a sequence classifier with one label (objective=reward's output)"
        )
    return "folder"


@dataclass
class GRPOObjective(ObjectiveConfig):
    """Group relative policy optimisation: `objective=grpo objective.num_generations=4`."""

    name: str = choice("grpo", OBJECTIVES)
    # The `loss_type` values this objective's TRL trainer takes (a subclass on another trainer names its own).
    loss_types = LOSS_TYPES
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """exact_match | contains | regex:<pattern> | format:<pattern> | package.module.function (one value a completion)."""
    reward_weights: Optional[list[float]] = None
    """One weight per reward in the sum GRPO ranks by; None: all 1."""
    reward_model: Optional[str] = None
    """A learned reward beside (or, with `rewards=[]`, instead of) the rewards: a reward-model run directory
    (objective=reward) or its exported folder, scoring each prompt + completion; None: the rewards alone."""
    reward_model_weight: float = 1.0
    """The reward model's weight in the sum GRPO ranks by."""
    reward_timeout_s: float = 60.0
    """How long one call of a reward function may take (a batch of completions); past it the run stops with
    one line naming the reward (exit 2) instead of hanging."""
    num_generations: int = 8
    """Completions sampled per prompt; their rewards are compared within the group."""
    max_completion_length: int = field(default=64, metadata=DATA_KEY)
    """Tokens generated per completion at most."""
    temperature: float = 1.0
    """Sampling temperature of the rollout (and of the evaluation's pass rate)."""
    beta: float = 0.0
    """KL coefficient; above 0 the reference model (with adapters: the base, adapter disabled) is used."""
    loss_type: str = "dapo"
    """How the per-token losses are aggregated (TRL's `loss_type`): dapo (TRL's default: over the active tokens
    of the accumulated batch), dr_grpo (over a constant, max_completion_length), grpo (per sequence), ..."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length out of the loss (TRL's guard against a policy that learns
    to stop emitting its end-of-turn token)."""
    steps_per_generation: Optional[int] = None
    """Optimizer steps trained on one generation batch; None: TRL's default (the accumulation steps)."""
    generation: str = "auto"
    """auto | transformers | colocate | server (see the module docstring)."""
    vllm_gpu_memory_utilization: float = 0.3
    """colocate: the share of each GPU vLLM reserves (its weights and KV cache)."""
    vllm_server_host: str = "127.0.0.1"
    """server: the address `trl vllm-serve` listens on and the trainer connects to (the launcher starts it
    on this node)."""
    vllm_server_port: int = 8000
    """server: the port `trl vllm-serve` listens on."""
    vllm_server_timeout_s: float = 240.0
    """server: how long the launcher waits for the server to answer before giving up (exit 2)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.rewards and not self.reward_model:
            raise ConfigError("objective.rewards: name at least one reward, or set objective.reward_model")
        for name in self.rewards:
            check_reward_name(name)
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ConfigError(
                f"objective.reward_weights: {len(self.reward_weights)} weights for {len(self.rewards)} rewards"
            )
        if self.reward_model is not None:
            check_reward_model(self.reward_model)
        if (
            not abs(self.reward_model_weight) <= 1e6
        ):  # the rewards' own bound (core/rewards.py WEIGHTED_LIMIT)
            raise ConfigError(
                f"objective.reward_model_weight={self.reward_model_weight} must lie within +-1e6"
            )
        if self.num_generations < 2:
            raise ConfigError(
                f"objective.num_generations={self.num_generations}: GRPO compares at least 2 completions of a prompt"
            )
        check_positive("objective.max_completion_length", self.max_completion_length)
        check_positive("objective.reward_timeout_s", self.reward_timeout_s)
        if not self.temperature > 0:
            raise ConfigError(f"objective.temperature={self.temperature} must be > 0 (the rollout samples)")
        if self.beta < 0:
            raise ConfigError(f"objective.beta={self.beta} must be >= 0")
        if self.loss_type not in self.loss_types:
            raise ConfigError(
                f"objective.loss_type={self.loss_type!r} must be one of {', '.join(self.loss_types)}"
            )
        if self.generation not in GENERATION_MODES:
            raise ConfigError(
                f"objective.generation={self.generation!r} must be one of {', '.join(GENERATION_MODES)}"
            )
        if not 0 < self.vllm_gpu_memory_utilization < 1:
            raise ConfigError(
                f"objective.vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must be between 0 and 1"
            )

    def check_device(self, device: str) -> None:
        if device == "cpu" and self.generation in ("colocate", "server"):
            raise ConfigError(
                f"objective.generation={self.generation} needs CUDA (vLLM); use transformers or auto on hardware=cpu"
            )


def companions(settings: GRPOObjective) -> tuple[Companion, ...]:
    """The learned reward model beside the policy when `objective.reward_model` names one (a forward over every
    completion of a step, frozen): ObjectiveSpec.companions of GRPO and of the objectives built on its settings."""
    if not getattr(settings, "reward_model", None):
        return ()
    return (Companion("reward_model", str(settings.reward_model), head="score"),)
