"""What distinguishes one training objective from another: one description per objective (pure: stdlib only).

An objective is the axis beside model x method x hardware: what the model is trained to do with its
data. Every consumer reads the objective's facts from here instead of comparing its name: the data
stage (which record kind it prepares: `finetune.data.prepare.RECORD_KINDS`), the training stage (TRL's
trainer and config pair: `finetune.train.stage`'s table of trainer modules), the planner (how many
sequences one example puts through the model, whether a reference model runs and holds weights), the
evaluation (the metrics it adds beside the generation metrics and the regression set) and the export
(what the exported model is). Its tunable settings (DPO's beta and loss) are a typed section of the
config named by `settings` (finetune/core/config/objective.py).

Adding an objective (GRPO, say) is one `ObjectiveSpec` in `OBJECTIVES`, its configs/objective/NAME.yaml,
its settings section, a trainer module under finetune/train/ and, if its records are new, a record kind
in finetune/data/prepare.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# What the data stage prepares (finetune/data/prepare.py: one function per kind).
RECORD_KINDS = (
    "conversations",  # messages with assistant turns to learn, tokenized with masked labels and packed (SFT)
    "preferences",  # prompt + chosen + rejected, tokenized as TRL's prompt_ids / chosen_ids / rejected_ids (DPO)
    "prompts",  # prompts with reference answers, for rewards computed on generations (GRPO)
)

# When a frozen reference model runs beside the policy.
REFERENCES = (
    "none",  # never (SFT)
    "always",  # every step (DPO's implicit reward is the log-ratio to it)
    "when_kl",  # only when the settings ask for a KL term (GRPO with beta > 0)
)


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective's facts. `ObjectiveConfig.spec` is the entry for `objective.name`."""

    name: str
    description: str  # one line, for people
    record_kind: str  # one of RECORD_KINDS
    # TRL's trainer and its config class (trl.<name>); finetune/train/ holds one module per trainer.
    trl_trainer: str
    trl_config: str
    # Sequences one example puts through the model in a training step: 1 for SFT, 2 for DPO (chosen and
    # rejected, concatenated into one batch by TRL's collator). `sequences_setting` names the settings key
    # that gives the count instead (GRPO's num_generations).
    sequences_per_example: int = 1
    sequences_setting: Optional[str] = None
    # What `train.micro_batch_size` counts, for people ("8 pairs a step (16 sequences)"): TRL's batch is examples.
    batch_unit: str = "sequences"
    # The frozen reference model (one of REFERENCES): with adapters it is the base with the adapter disabled
    # (no second copy); with full fine-tuning a frozen copy or precomputed log-probabilities (the planner chooses).
    reference: str = "none"
    # The config section with this objective's settings (`dpo`), or None.
    settings: Optional[str] = None
    # The model generates inside the training step (rollouts): the planner adds the generation term.
    generates: bool = False
    # Its loss is next-token cross-entropy over labelled tokens, which the project's chunked loss can compute
    # (finetune/modeling/chunked_loss.py); otherwise TRL's own loss runs (DPO: its fused per-token log-probs).
    chunked_loss: bool = False
    # The metrics the evaluation adds on the held-out split, beside the generation metrics and the regression set.
    eval_metrics: tuple[str, ...] = ()
    # What the exported model is, for people (the export itself is the method's merge, the same for every objective).
    export: str = "the trained policy, merged per the method"

    def __post_init__(self) -> None:
        if self.record_kind not in RECORD_KINDS:
            raise ValueError(
                f"ObjectiveSpec {self.name}: record_kind={self.record_kind!r} is not one of {RECORD_KINDS}"
            )
        if self.reference not in REFERENCES:
            raise ValueError(
                f"ObjectiveSpec {self.name}: reference={self.reference!r} is not one of {REFERENCES}"
            )
        if self.sequences_per_example < 1:
            raise ValueError(f"ObjectiveSpec {self.name}: sequences_per_example must be at least 1")
        if self.reference != "none" and self.settings is None:
            raise ValueError(
                f"ObjectiveSpec {self.name}: a reference model needs a settings section (its beta)"
            )

    @property
    def uses_reference(self) -> bool:
        """A reference model may run (always, or when its settings ask for a KL term)."""
        return self.reference != "none"


OBJECTIVES: dict[str, ObjectiveSpec] = {
    "sft": ObjectiveSpec(
        "sft",
        "supervised fine-tuning: the assistant turns of conversations, next-token cross-entropy",
        record_kind="conversations",
        trl_trainer="SFTTrainer",
        trl_config="SFTConfig",
        chunked_loss=True,
    ),
    "dpo": ObjectiveSpec(
        "dpo",
        "direct preference optimisation: a chosen answer made more likely than a rejected one, against a reference",
        record_kind="preferences",
        trl_trainer="DPOTrainer",
        trl_config="DPOConfig",
        sequences_per_example=2,
        batch_unit="pairs",
        reference="always",
        settings="dpo",
        eval_metrics=("preference_accuracy", "reward_margin"),
        export="the preference-tuned policy, merged per the method (the reference is not exported)",
    ),
    "grpo": ObjectiveSpec(
        "grpo",
        "group relative policy optimisation: completions sampled per prompt, scored by verifiable rewards, "
        "the better ones of each group made more likely",
        record_kind="prompts",
        trl_trainer="GRPOTrainer",
        trl_config="GRPOConfig",
        sequences_setting="num_generations",
        reference="when_kl",
        settings="grpo",
        generates=True,
        eval_metrics=("mean_reward", "pass_rate"),
        export="the RL-tuned policy, merged per the method (the reference, when beta > 0, is not exported)",
    ),
}
