"""Schema of the `objective` section: what the model is trained to do, and that objective's own settings.

`objective=dpo` on the command line (the Hydra group configs/objective/) chooses the objective and the
section's type at once: `ObjectiveConfig` is the base every objective's settings dataclass extends
(`SFTObjective` here, `DPOObjective` in objective.py, `GRPOObjective` in objective.py; finetune/core/objectives.py
names each objective's class), so `objective.beta=0.2` is checked against the chosen objective's fields.
Where training starts from (`init_from`) is the root's.

The settings once lived in root sections named after the objective (`objective.beta`); `former_key` turns such
a key into its `objective.` spelling, with a one-line pointer on stderr, until the next release.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

from finetune.core.config.checks import check_choices, choice
from finetune.core.errors import ConfigError
from finetune.core.objectives import DEFAULT_OBJECTIVE, OBJECTIVES, ObjectiveSpec


@dataclass
class ObjectiveConfig:
    """What the model is trained to do: `objective=NAME` on the command line, then `objective.KEY=VALUE`."""

    name: str = choice(DEFAULT_OBJECTIVE, OBJECTIVES)

    def __post_init__(self) -> None:
        check_choices(self, "objective", ObjectiveConfig)
        expected = self.spec.settings_class()
        if not isinstance(self, expected):
            raise ConfigError(
                f"objective.name={self.name}: the section is {type(self).__name__}, not {expected.__name__}; "
                f"choose the objective with objective={self.name}"
            )

    # A generating objective's settings choose where it samples (`generation`: vLLM colocated or served, or
    # transformers) and how many completions a prompt (`num_generations`), GRPO's; read only where it generates.
    samples_with_vllm = True

    def check_device(self, device: str) -> None:
        """Refuse settings this device cannot run (cpu | cuda | ...), in one line naming the key."""

    @property
    def generates(self) -> bool:
        """The training step samples completions (a rollout, planned by finetune/planner/rollout.py): the
        objective's description says so, or its settings where they choose (distillation's `lmbda`, `seq_kd`)."""
        return self.spec.generates

    def rollout_rows(self, data_rows: int, generated_rows: int) -> int:
        """The widest row a generating step trains on, of the data's rows and prompt + completion: the latter
        where every micro-batch is generated (GRPO's)."""
        return generated_rows

    def samplers(self) -> tuple[tuple[str, float], ...]:
        """Who samples a generating step's completions, and in which share of its generation rounds: `policy`
        (the trained model) in every round, GRPO's; a companion's role samples with that companion's weights."""
        return (("policy", 1.0),)

    @property
    def spec(self) -> ObjectiveSpec:
        """What this objective is (finetune/core/objectives.py): every distinction is read from it."""
        return OBJECTIVES[self.name]


@dataclass
class SFTObjective(ObjectiveConfig):
    """Supervised fine-tuning: no settings beyond the training section's."""

    name: str = choice("sft", OBJECTIVES)


def objective_settings(value: Any) -> ObjectiveConfig:
    """The `objective` section as its objective's dataclass: as given, or built from the mapping a run
    directory's config.yaml holds (its `name` chooses the class); None is the default objective."""
    if isinstance(value, ObjectiveConfig):
        return value
    fields = dict(value or {})
    name = fields.get("name", ObjectiveConfig.name)
    if name not in OBJECTIVES:
        raise ConfigError(f"objective.name={name!r} is not one of {', '.join(OBJECTIVES)}")
    schema = OBJECTIVES[name].settings_class()
    known = {f.name for f in dataclasses.fields(schema)}
    for key in fields:
        if key not in known:
            raise ConfigError(
                f"objective.{key}: unknown key for objective={name}; valid keys: {', '.join(sorted(known))}"
            )
    settings: ObjectiveConfig = schema(**fields)
    return settings


# `dpo.beta=0.2`, `+grpo.num_generations=4`: a root section named after an objective.
_FORMER = re.compile(r"(\+{0,2})(\w+)\.([\w.]+=.*)", re.DOTALL)


def former_key(item: str) -> Optional[str]:
    """`item` in its `objective.` spelling when it sets a key of a former objective section (`objective.beta=0.2`
    becomes `objective.beta=0.2`), telling the user the new key on stderr; None for every other override."""
    m = _FORMER.fullmatch(item)
    if not m or m.group(2) not in OBJECTIVES:
        return None
    new = f"objective.{m.group(3)}"
    old_key, new_key = item.split("=", 1)[0].lstrip("+"), new.split("=", 1)[0]
    print(
        f"finetune: {old_key} is now {new_key} (objective={m.group(2)}); the old key goes in the next release",
        file=sys.stderr,
    )
    return new
