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
    # KTO's unpaired examples: the bundled pairs unpaired (scripts/make_bundled_labelled.py).
    "labelled": RecordKind(
        "prompt + completion + label (desirable or not), tokenized as TRL's prompt_ids / completion_ids / label",
        "finetune.data.labelled",
        "labelled.jsonl",
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


@dataclass(frozen=True)
class ScoreKind:
    """What the evaluation adds on the held-out split beside the generation metrics and the regression set."""

    description: str  # for people
    metrics: tuple[str, ...]  # the names it adds to each model's scores
    # Its scorer ("module:Class" under finetune/evaluation/): `Scorer(cfg, run_dir, eval_dataset, tokenizer,
    # variants)` once per evaluation, then `.score(model, variant, items, answers)` for each model, returning
    # {metric: value} (empty where the held-out split holds nothing it scores).
    scorer: str


SCORES: dict[str, ScoreKind] = {
    "preference": ScoreKind(
        "the implicit rewards beta x log(pi / pi_ref) of the held-out pairs' two answers, the settings' beta",
        (
            "preference_accuracy",
            "reward_margin",
            "reward_chosen",
            "reward_rejected",
            "logprob_accuracy",
        ),
        "finetune.evaluation.preference:Scorer",
    ),
    "rewards": ScoreKind(
        "the settings' rewards (and learned reward model) on the generated answers to the held-out prompts",
        ("mean_reward", "pass_rate", "reward_model_score"),
        "finetune.evaluation.reward_scores:Scorer",
    ),
    "kto": ScoreKind(
        "the implicit rewards beta x log(pi / pi_ref) of the held-out desirable and undesirable completions, "
        "the settings' beta",
        (
            "desirable_margin",
            "separation_accuracy",
            "reward_desirable",
            "reward_undesirable",
            "logprob_separation",
        ),
        "finetune.evaluation.kto_scores:Scorer",
    ),
    "odds_ratio": ScoreKind(
        "ORPO's log odds ratio of the held-out pairs' chosen answer over the rejected one (mean per-token "
        "log-probabilities, no reference)",
        ("odds_ratio_accuracy", "log_odds_ratio", "chosen_logprob"),
        "finetune.evaluation.odds_scores:OddsRatioScorer",
    ),
    "logprob_margin": ScoreKind(
        "CPO's and SimPO's reward margin beta x (log p(chosen) - log p(rejected)) of the held-out pairs, "
        "length-normalised where the settings say, against their target margin (SimPO's gamma)",
        ("margin_accuracy", "reward_margin", "margin_met"),
        "finetune.evaluation.odds_scores:MarginScorer",
    ),
    "reward_model": ScoreKind(
        "a reward model's scores of the held-out pairs' two sequences: how often the chosen one scores higher, and by how much",
        ("pair_accuracy", "score_margin", "score_chosen", "score_rejected"),
        "finetune.evaluation.reward_model_scores:Scorer",
    ),
    "distill": ScoreKind(
        "the student's agreement with the teacher on the held-out assistant tokens: top-1 agreement and the mean "
        "KL(teacher || student) per token",
        ("teacher_top1_agreement", "teacher_kl"),
        "finetune.evaluation.distill_scores:Scorer",
    ),
}


# What a model's forward ends in: the LM head (logits over the vocabulary: a policy that generates) or a
# sequence-classification head (transformers' AutoModelForSequenceClassification, num_labels=1: one value a
# sequence, read at its last token; a reward model).
HEADS = ("lm", "score")


@dataclass(frozen=True)
class Companion:
    """A frozen model that runs forward-only beside the policy in each training step, with its own weights: a
    distillation teacher, a learned reward model scoring rollouts. The planner counts its weights (sharded like
    the policy where the engine shards), its forward's working memory and its time; the training stage loads it.
    (The reference model is not one: it is the policy's own base, `reference`.)"""

    role: str  # what it does, for people and the plan's term names: "teacher", "reward_model"
    # The model, named as `model=` names one: a preset, a hub id, a folder, or a run directory's trained output.
    model: str
    # What its forward ends in: "lm" (logits over the vocabulary) or "score" (one value per sequence).
    head: str = "lm"
    # Where the loss compares the policy's whole logits with this companion's (distillation): the [tokens,
    # vocabulary] copies it holds at its peak beside those two logits; 0 where nothing compares them whole.
    logit_copies: float = 0.0


def load(path: str) -> Any:
    """The module ("a.b") or attribute ("a.b:Name") an import path names."""
    module, _, attribute = path.partition(":")
    loaded: ModuleType = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded


def _trl(name: str) -> Any:
    """A class of TRL's top level ("DPOTrainer") or at an import path ("trl.experimental.orpo:ORPOTrainer")."""
    return load(name if ":" in name else f"trl:{name}")


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
    # TRL's trainer and its config class, for people and the checks (the trainer module subclasses them): a name
    # in `trl`, or an import path ("trl.experimental.orpo:ORPOTrainer") for those outside its top level.
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
    # The settings field whose value above 0 turns a `when_kl` reference on (GRPO's and RLOO's `beta`).
    kl_setting: Optional[str] = None
    # Forwards of the reference a trained sequence when it runs (KTO: 2, the completion and the mismatched one of
    # its KL estimate), and forward-only passes of the policy a trained sequence beside the one it trains on
    # (KTO's KL estimate: 1); both under no_grad, their time counted, their transient peak the reference's.
    reference_forwards: int = 1
    policy_extra_forwards: int = 0
    # Examples a micro-batch holds at least (KTO: 2, its KL estimate pairs each prompt with another example's
    # completion of the same micro-batch); the planner's micro-batches stop there.
    min_micro_batch: int = 1
    # The model generates inside the training step (rollouts): the planner adds the generation term, and the
    # settings carry the rollout's shape (`num_generations`, `max_completion_length`, `generation`, ...).
    generates: bool = False
    # Its loss is next-token cross-entropy over labelled tokens, which the project's chunked loss can compute
    # (finetune/modeling/chunked_loss.py); otherwise TRL's own loss runs (DPO: its fused per-token log-probs).
    chunked_loss: bool = False
    # Its TRL trainer takes the model's whole logits of every sequence and their log-softmax (ORPO, CPO), rather
    # than TRL's fused LM head (DPO): the planner's loss term counts them.
    full_logits: bool = False
    # What the trained model's forward ends in (one of HEADS): "lm" (the policy's LM head), or "score" (a
    # sequence-classification head trained in its place: no vocabulary logits, no generation; the model loads as
    # a sequence classifier in every stage, and LoRA trains the head in full beside the adapters).
    head: str = "lm"
    # The scores the evaluation adds (a key of SCORES), or None.
    scores: Optional[str] = None
    # Its companion models ("module:function" taking the `objective` settings, returning Companions), or None.
    companions: Optional[str] = None
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
        if self.head not in HEADS:
            raise ValueError(f"ObjectiveSpec {self.name}: head={self.head!r} is not one of {HEADS}")
        if self.sequences_per_example < 1:
            raise ValueError(f"ObjectiveSpec {self.name}: sequences_per_example must be at least 1")
        if self.reference_forwards < 1 or self.policy_extra_forwards < 0 or self.min_micro_batch < 1:
            raise ValueError(
                f"ObjectiveSpec {self.name}: reference_forwards and min_micro_batch must be at least 1, "
                "policy_extra_forwards at least 0"
            )
        if self.scores is not None and self.scores not in SCORES:
            raise ValueError(
                f"ObjectiveSpec {self.name}: scores={self.scores!r} is not one of {sorted(SCORES)}"
            )

    @property
    def uses_reference(self) -> bool:
        """A reference model may run (always, or when its settings ask for a KL term)."""
        return self.reference != "none"

    def kl_reference(self, settings: Any) -> bool:
        """A `when_kl` reference runs under these `objective` settings (its KL coefficient is above 0)."""
        return (
            self.reference == "when_kl"
            and self.kl_setting is not None
            and getattr(settings, self.kl_setting) > 0
        )

    @property
    def generates_text(self) -> bool:
        """The trained model answers prompts (an LM head): the evaluation generates, scores its held-out loss and
        the regression set; a score head is scored by its objective's own scores alone."""
        return self.head == "lm"

    @property
    def eval_metrics(self) -> tuple[str, ...]:
        """The metrics the evaluation adds on the held-out split."""
        return SCORES[self.scores].metrics if self.scores else ()

    def settings_class(self) -> type:
        """The dataclass of the `objective` section for this objective."""
        return load(self.settings)

    def trainer_module(self) -> ModuleType:
        """The module that builds this objective's TRL config and trainer."""
        return load(self.trainer)

    def trl_classes(self) -> tuple[type, type]:
        """TRL's trainer and config classes this objective builds on (its trainer module imported first: it
        imports them as they must be, trl.experimental's import-time notice filtered there)."""
        self.trainer_module()
        return _trl(self.trl_trainer), _trl(self.trl_config)

    def scorer_class(self) -> Optional[type]:
        """The evaluation's scorer of this objective's own scores, or None."""
        return load(SCORES[self.scores].scorer) if self.scores else None

    def companions_of(self, settings: Any) -> tuple[Companion, ...]:
        """The frozen models the settings put beside the policy (none for most objectives)."""
        return tuple(load(self.companions)(settings)) if self.companions else ()

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
        kl_setting="beta",
        generates=True,
        scores="rewards",
        companions="finetune.core.config.grpo:companions",
        export="the RL-tuned policy, merged per the method (the reference, when beta > 0, is not exported)",
    ),
    "kto": ObjectiveSpec(
        "kto",
        "Kahneman-Tversky optimisation: unpaired completions labelled desirable or not, each made more or less "
        "likely than the reference against a KL estimate",
        record_kind="labelled",
        settings="finetune.core.config.kto:KTOObjective",
        trainer="finetune.train.kto_trainer",
        trl_trainer="KTOTrainer",
        trl_config="KTOConfig",
        batch_unit="examples",
        reference="always",
        reference_forwards=2,
        policy_extra_forwards=1,
        min_micro_batch=2,
        scores="kto",
        export="the KTO-tuned policy, merged per the method (the reference is not exported)",
    ),
    "orpo": ObjectiveSpec(
        "orpo",
        "odds-ratio preference optimisation: the chosen answer's NLL plus its odds made higher than the rejected "
        "one's, with no reference model",
        record_kind="preferences",
        settings="finetune.core.config.orpo:ORPOObjective",
        trainer="finetune.train.orpo_trainer",
        trl_trainer="trl.experimental.orpo:ORPOTrainer",
        trl_config="trl.experimental.orpo:ORPOConfig",
        sequences_per_example=2,
        batch_unit="pairs",
        full_logits=True,
        scores="odds_ratio",
        export="the preference-tuned policy, merged per the method (no reference model exists)",
    ),
    "simpo": ObjectiveSpec(
        "simpo",
        "simple preference optimisation: the chosen answer's mean per-token log-probability made higher than the "
        "rejected one's by a target margin, with no reference model",
        record_kind="preferences",
        settings="finetune.core.config.cpo:SimPOObjective",
        trainer="finetune.train.cpo_trainer",
        trl_trainer="trl.experimental.cpo:CPOTrainer",
        trl_config="trl.experimental.cpo:CPOConfig",
        sequences_per_example=2,
        batch_unit="pairs",
        full_logits=True,
        scores="logprob_margin",
        export="the preference-tuned policy, merged per the method (no reference model exists)",
    ),
    "cpo": ObjectiveSpec(
        "cpo",
        "contrastive preference optimisation: the chosen answer made more likely than the rejected one, plus its "
        "NLL, with no reference model",
        record_kind="preferences",
        settings="finetune.core.config.cpo:CPOObjective",
        trainer="finetune.train.cpo_trainer",
        trl_trainer="trl.experimental.cpo:CPOTrainer",
        trl_config="trl.experimental.cpo:CPOConfig",
        sequences_per_example=2,
        batch_unit="pairs",
        full_logits=True,
        scores="logprob_margin",
        export="the preference-tuned policy, merged per the method (no reference model exists)",
    ),
    "reward": ObjectiveSpec(
        "reward",
        "reward modelling: a score head trained to rank the chosen answer of each pair above the rejected one "
        "(Bradley-Terry), for GRPO's objective.reward_model or vLLM's reward task",
        record_kind="preferences",
        settings="finetune.core.config.reward:RewardObjective",
        trainer="finetune.train.reward_trainer",
        trl_trainer="RewardTrainer",
        trl_config="RewardConfig",
        sequences_per_example=2,
        batch_unit="pairs",
        head="score",
        scores="reward_model",
        export="a reward model (a sequence classifier, one score a sequence): merged per the method, for vLLM's "
        "reward task, TRL's reward_funcs or objective.reward_model",
    ),
    "rloo": ObjectiveSpec(
        "rloo",
        "REINFORCE leave-one-out: completions sampled per prompt, scored by verifiable rewards, each one's "
        "baseline the mean reward of the others",
        record_kind="prompts",
        settings="finetune.core.config.rloo:RLOOObjective",
        trainer="finetune.train.rloo_trainer",
        trl_trainer="RLOOTrainer",
        trl_config="RLOOConfig",
        sequences_setting="num_generations",
        reference="when_kl",
        kl_setting="beta",
        generates=True,
        scores="rewards",
        companions="finetune.core.config.grpo:companions",  # a learned reward model, as GRPO's
        export="the RL-tuned policy, merged per the method (the reference, when beta > 0, is not exported)",
    ),
    "distill": ObjectiveSpec(
        "distill",
        "knowledge distillation: the student matches a frozen teacher's next-token distributions on the assistant "
        "turns of conversations (a forward KL, reverse KL or JSD)",
        record_kind="conversations",
        settings="finetune.core.config.distill:DistillObjective",
        trainer="finetune.train.distill_trainer",
        trl_trainer="trl.experimental.gkd:GKDTrainer",
        trl_config="trl.experimental.gkd:GKDConfig",
        scores="distill",
        companions="finetune.core.config.distill:companions",
        export="the distilled student, merged per the method (the teacher is not exported)",
    ),
}
