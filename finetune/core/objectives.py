"""What distinguishes one training objective from another: one description per objective (pure: stdlib only).

An objective is the axis beside model x method x hardware: what the model is trained to do with its
data. Every stage asks the objective's description instead of comparing its name: the data stage
prepares its record kind (`RECORD_KINDS`: the module under finetune/data/ that prepares and saves it),
the training stage builds its trainer from its trainer module (`trainer`: TRL's trainer and config pair
over finetune/train/base_trainer.py), the planner reads how many sequences one example puts through the
model and whether a reference model runs, the evaluation adds its scores (`scores`), and the export says
what the exported model is. Its tunable settings are the `objective` section of the config, typed per
objective (`settings`: a dataclass extending `finetune.core.config.objective.ObjectiveConfig`).

Modules are named by import path ("package.module" or "package.module:Name"), so this table stays pure
and an objective kept outside the package (a test's, a user's) registers the same way. Adding one is
docs/objectives/README.md: one entry in `OBJECTIVES`, its settings dataclass, its trainer module and
configs/objective/NAME.yaml.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

from finetune.core.errors import ConfigError


@dataclass(frozen=True)
class RecordKind:
    """What the data stage makes of an objective's input, and which module does it."""

    description: str  # for people
    # The module under finetune/data/ with `prepare(cfg, tokenizer, inp, path, console, scratch)` and
    # `save(prepared, out)`: the rows a cache entry holds and the training stage reads back.
    module: str
    # The data set shipped for it under finetune/data/bundled/ (what the tiny model trains on by default).
    bundled: str
    # The kind the same records become for a model that takes images (finetune/core/architectures.py's
    # `vision`): its messages carry image parts. None: this kind has no image counterpart.
    with_images: Optional[str] = None
    # "module:function" returning the bundled data's path where it is generated rather than shipped.
    generated: Optional[str] = None


RECORD_KINDS: dict[str, RecordKind] = {
    "conversations": RecordKind(
        "messages with assistant turns to learn, tokenized with masked labels and packed",
        "finetune.data.conversations",
        "chat.jsonl",
        with_images="image_conversations",
    ),
    "image_conversations": RecordKind(
        "messages with image parts (local files) and assistant turns to learn, one conversation a row, its "
        "images rendered by the model's processor as it trains",
        "finetune.data.image_conversations",
        "shapes/shapes.jsonl",
        generated="finetune.data.shapes:bundled_path",
    ),
    "preferences": RecordKind(
        "prompt + chosen + rejected, tokenized as TRL's prompt_ids / chosen_ids / rejected_ids",
        "finetune.data.preferences",
        "preferences.jsonl",
    ),
    # GRPO's prompts are the bundled conversations: their answers are checkable (finetune/core/tasks.py).
    "prompts": RecordKind(
        "prompts with reference answers, for rewards computed on generations",
        "finetune.data.prompts",
        "chat.jsonl",
    ),
}

# The objective of a config that names none (`objective=` left out).
DEFAULT_OBJECTIVE = "sft"

# When a frozen reference model runs beside the policy.
REFERENCES = (
    "none",  # never (SFT)
    "always",  # every step (DPO's implicit reward is the log-ratio to it)
    "when_kl",  # only when the settings ask for a KL term (GRPO with beta > 0)
)

# What the evaluation adds on the held-out split beside the generation metrics and the regression set
# (finetune/evaluation/stage.py reads the objective's settings for them).
SCORES = {
    # the implicit rewards beta x log(pi / pi_ref) of the held-out pairs' two answers, the settings' beta
    "preference": (
        "preference_accuracy",
        "reward_margin",
        "reward_chosen",
        "reward_rejected",
        "logprob_accuracy",
    ),
    # the settings' rewards on the generated answers to the held-out prompts
    "rewards": ("mean_reward", "pass_rate"),
}


def load(path: str) -> Any:
    """The module ("a.b") or attribute ("a.b:Name") an import path names."""
    module, _, attribute = path.partition(":")
    loaded: ModuleType = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective's facts. `cfg.objective.spec` is the entry for the chosen objective."""

    name: str
    description: str  # one line, for people
    record_kind: str  # a key of RECORD_KINDS
    # Its settings: the `objective` config section's dataclass ("module:Class", an ObjectiveConfig subclass).
    settings: str
    # Its trainer module (finetune/train/NAME_trainer.py): `Trainer` (TRL's trainer plus RunTrainerMixin),
    # `build_config` (TRL's config), `trainer_kwargs` and optionally `objective_metrics`.
    trainer: str
    # TRL's trainer and its config class, for people and the checks (the trainer module subclasses them).
    trl_trainer: str
    trl_config: str
    # Sequences one example puts through the model in a training step: 1 for SFT, 2 for DPO (chosen and
    # rejected, concatenated into one batch by TRL's collator). `sequences_setting` names the settings field
    # in whose whole multiples a step's sequences come instead (GRPO's num_generations).
    sequences_per_example: int = 1
    sequences_setting: Optional[str] = None
    # What `train.micro_batch_size` counts, for people ("8 pairs a step (16 sequences)"): TRL's batch is examples.
    batch_unit: str = "sequences"
    # The frozen reference model (one of REFERENCES): with adapters it is the base with the adapter disabled
    # (no second copy); with full fine-tuning a frozen copy or precomputed log-probabilities (the planner
    # chooses, or the settings' `reference`).
    reference: str = "none"
    # The model generates inside the training step (rollouts): the planner adds the generation term, and the
    # settings carry the rollout's shape (`num_generations`, `max_completion_length`, `generation`, ...).
    generates: bool = False
    # Its loss is next-token cross-entropy over labelled tokens, which the project's chunked loss can compute
    # (finetune/modeling/chunked_loss.py); otherwise TRL's own loss runs (DPO: its fused per-token log-probs).
    chunked_loss: bool = False
    # The scores the evaluation adds (a key of SCORES), or None.
    scores: Optional[str] = None
    # What the exported model is, for people (the export itself is the method's merge, the same for every objective).
    export: str = "the trained policy, merged per the method"

    def __post_init__(self) -> None:
        if self.record_kind not in RECORD_KINDS:
            raise ValueError(
                f"ObjectiveSpec {self.name}: record_kind={self.record_kind!r} is not one of {sorted(RECORD_KINDS)}"
            )
        if self.reference not in REFERENCES:
            raise ValueError(
                f"ObjectiveSpec {self.name}: reference={self.reference!r} is not one of {REFERENCES}"
            )
        if self.sequences_per_example < 1:
            raise ValueError(f"ObjectiveSpec {self.name}: sequences_per_example must be at least 1")
        if self.scores is not None and self.scores not in SCORES:
            raise ValueError(
                f"ObjectiveSpec {self.name}: scores={self.scores!r} is not one of {sorted(SCORES)}"
            )

    @property
    def uses_reference(self) -> bool:
        """A reference model may run (always, or when its settings ask for a KL term)."""
        return self.reference != "none"

    @property
    def eval_metrics(self) -> tuple[str, ...]:
        """The metrics the evaluation adds on the held-out split."""
        return SCORES[self.scores] if self.scores else ()

    def settings_class(self) -> type:
        """The dataclass of the `objective` section for this objective."""
        return load(self.settings)

    def trainer_module(self) -> ModuleType:
        """The module that builds this objective's TRL config and trainer."""
        return load(self.trainer)

    def record_kind_for(self, takes_images: bool) -> str:
        """The record kind the data stage prepares: the objective's, or its image counterpart for a model that
        takes images (refused where the objective has none)."""
        if not takes_images:
            return self.record_kind
        kind = RECORD_KINDS[self.record_kind].with_images
        if kind is None:
            raise ConfigError(
                f"objective={self.name} has no image data ({self.record_kind} records): a vision-language model "
                "trains with an objective whose records carry images (sft)"
            )
        return kind

    def record_module(self, takes_images: bool = False) -> ModuleType:
        """The data module that prepares and saves this objective's records."""
        return load(RECORD_KINDS[self.record_kind_for(takes_images)].module)


OBJECTIVES: dict[str, ObjectiveSpec] = {
    "sft": ObjectiveSpec(
        "sft",
        "supervised fine-tuning: the assistant turns of conversations, next-token cross-entropy",
        record_kind="conversations",
        settings="finetune.core.config.objective:SFTObjective",
        trainer="finetune.train.sft_trainer",
        trl_trainer="SFTTrainer",
        trl_config="SFTConfig",
        chunked_loss=True,
    ),
    "dpo": ObjectiveSpec(
        "dpo",
        "direct preference optimisation: a chosen answer made more likely than a rejected one, against a reference",
        record_kind="preferences",
        settings="finetune.core.config.dpo:DPOObjective",
        trainer="finetune.train.dpo_trainer",
        trl_trainer="DPOTrainer",
        trl_config="DPOConfig",
        sequences_per_example=2,
        batch_unit="pairs",
        reference="always",
        scores="preference",
        export="the preference-tuned policy, merged per the method (the reference is not exported)",
    ),
    "grpo": ObjectiveSpec(
        "grpo",
        "group relative policy optimisation: completions sampled per prompt, scored by verifiable rewards, "
        "the better ones of each group made more likely",
        record_kind="prompts",
        settings="finetune.core.config.grpo:GRPOObjective",
        trainer="finetune.train.grpo_trainer",
        trl_trainer="GRPOTrainer",
        trl_config="GRPOConfig",
        sequences_setting="num_generations",
        reference="when_kl",
        generates=True,
        scores="rewards",
        export="the RL-tuned policy, merged per the method (the reference, when beta > 0, is not exported)",
    ),
}
