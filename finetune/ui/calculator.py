"""The plan page's settings: the form's fields, the command line they stand for, and its plan.

A form becomes the overrides of `python -m finetune ... mode=plan` and is planned in-process by the pipeline's
own plan stage (`stages.resolve`, `stages.plan_stage`), so the page's plan is the command line's plan.json.
Every field is checked against its choices or as a whole number before it becomes an override, so no
page input reaches Hydra's grammar as anything but one value. A pasted config.json is read as data,
written to a private temporary folder for transformers to read offline, and refused when it names
code of its own (`auto_map`); the page never sets `model.trust_remote_code`.
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlencode

from finetune.core.composition import compose, group_choices, recipe_names
from finetune.core.config import HardwareConfig
from finetune.core.errors import ConfigError
from finetune.pipeline import stages
from finetune.planner import Plan
from finetune.planner.timing import HOURS_PER_MONTH
from finetune.rundir.shell import command_line

# The model field's value that plans the pasted config.json instead of a preset.
PASTED = "config.json"
# The largest config.json the page reads (a real one is a few KB).
MAX_CONFIG_BYTES = 1_000_000
# Hardware the page does not offer: `local` reads the machine the server runs on, not the one to rent.
HIDDEN_HARDWARE = ("local",)

# The form's fields and the overrides they become, in the order the command shows them.
CHOICE_OVERRIDES = {
    "recipe": "+recipe",
    "model": "model",
    "method": "method",
    "objective": "objective",
    "hardware": "hardware",
}
NUMBER_OVERRIDES = {
    "seq_len": "train.seq_len",
    "micro_batch": "train.micro_batch_size",
    "dataset_tokens": "train.dataset_tokens",
}

# A hub id as the hub spells it: ORG/NAME (never a path: no leading '/', '.' or '~').
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

# Planning composes through Hydra's global state: one plan at a time.
_LOCK = threading.Lock()


def choices(field: str) -> list[str]:
    """The values a choice field accepts, "" (the recipe's or the default's) aside."""
    if field == "recipe":
        return recipe_names()
    if field == "model":
        return [*group_choices("model"), PASTED]
    if field == "hardware":
        return [h for h in group_choices("hardware") if h not in HIDDEN_HARDWARE]
    return group_choices(field)


@dataclass(frozen=True)
class PlanForm:
    """The page's settings, as the address carries them; an empty field keeps the recipe's (or default) value."""

    recipe: str = ""
    model: str = ""
    # A model by hub id (ORG/NAME) instead of a preset: `model=ORG/NAME`, where composition resolves hub ids.
    hub_id: str = ""
    # The pasted config.json, read when `model` is PASTED.
    config: str = ""
    method: str = ""
    objective: str = ""
    hardware: str = ""
    seq_len: str = ""
    micro_batch: str = ""
    dataset_tokens: str = ""

    @classmethod
    def from_query(cls, query: Mapping[str, Sequence[str]]) -> PlanForm:
        """The form of a parsed query string (`urllib.parse.parse_qs`); unknown keys are ignored."""
        return cls(**{f.name: (query.get(f.name) or [""])[-1].strip() for f in fields(cls)})

    def query(self) -> str:
        """The address's query string: the fields that are set, the pasted config only when it is planned."""
        items = [(f.name, getattr(self, f.name)) for f in fields(self)]
        return urlencode([(k, v) for k, v in items if v and (k != "config" or self.model == PASTED)])

    def overrides(self, config_path: str = PASTED) -> list[str]:
        """The command line's overrides for these settings (before `mode=plan`); ConfigError names a bad field."""
        out = []
        if self.hub_id and self.model:
            raise ConfigError(
                f"hub_id={self.hub_id[:80]!r} and model={self.model[:60]!r}: choose one of them"
            )
        for name, key in CHOICE_OVERRIDES.items():
            value = getattr(self, name)
            if value:
                _check_choice(name, value)
                out.append(f"model.config_path={config_path}" if value == PASTED else f"{key}={value}")
            if name == "model" and self.hub_id:
                if not HUB_ID.fullmatch(self.hub_id) or ".." in self.hub_id:
                    raise ConfigError(f"hub_id={self.hub_id[:80]!r}: write a hub id as ORG/NAME")
                out.append(f"model={self.hub_id}")
        for name, key in NUMBER_OVERRIDES.items():
            value = getattr(self, name)
            if value:
                if not re.fullmatch(r"\d{1,15}", value):
                    raise ConfigError(f"{name}={value[:40]!r}: write a whole number ({key})")
                out.append(f"{key}={int(value)}")
        return out

    def command(self) -> str:
        """The command that writes the same plan.json (a pasted config saved as config.json beside it)."""
        return command_line("python", "-m", "finetune", *self.overrides(), "mode=plan", "plan.out=plan.json")


def _check_choice(name: str, value: str) -> None:
    valid = choices(name)
    if value not in valid:
        raise ConfigError(f"{name}={value[:60]!r} is not one of {', '.join(valid)}")


def read_pasted(text: str) -> dict[str, Any]:
    """The pasted config.json as data: refused when malformed, too large, or naming code of its own."""
    if not text.strip():
        raise ConfigError("config.json: paste the model's config.json (or choose a preset model)")
    if len(text.encode()) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config.json: larger than {MAX_CONFIG_BYTES // 1000} KB; a model's config is a few KB"
        )
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config.json: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError("config.json: a JSON object of the model's settings ({...}) is expected")
    if "auto_map" in doc:
        raise ConfigError(
            "config.json: its auto_map names the model's own Python code, which finetune does not run; "
            "plan a model of an architecture transformers ships"
        )
    return doc


@dataclass(frozen=True)
class Alternative:
    """One row of the page's alternatives: the planner's verdict and total, and what the hardware costs."""

    hardware: str
    fits: bool
    total_gb: float
    usd_per_hour: Optional[float]
    run_hours: Optional[float]
    run_usd: Optional[float]


@dataclass(frozen=True)
class Planned:
    """A plan as the page shows it: plan.json's contents, the command, the priced alternatives."""

    form: PlanForm
    plan: Plan
    payload: dict[str, Any]
    title: str
    command: str
    alternatives: tuple[Alternative, ...]


def usd_per_hour(hw: HardwareConfig) -> Optional[float]:
    """The profile's price an hour, all its nodes (the planner's cost: usd_per_month x nodes / 730)."""
    return None if hw.usd_per_month is None else hw.usd_per_month * hw.nodes / HOURS_PER_MONTH


def make(form: PlanForm, profiles: Mapping[str, HardwareConfig]) -> Planned:
    """Plan `form` as `python -m finetune <form.overrides()> mode=plan` does; ConfigError/PlanError on bad input."""
    with _LOCK, tempfile.TemporaryDirectory(prefix="finetune-ui-") as tmp:
        where = Path(tmp)
        config_path = where / "model" / PASTED
        if form.model == PASTED:
            config_path.parent.mkdir()
            config_path.write_text(json.dumps(read_pasted(form.config)))
        try:
            cfg = compose([*form.overrides(str(config_path)), "mode=plan", f"run_dir={where / 'run'}"])
            cfg = stages.resolve(cfg)
            plan = stages.plan_stage(cfg, where / "run", quiet=True)
        except ConfigError as exc:
            # the temporary file is the user's pasted config.json
            raise ConfigError(str(exc).replace(str(config_path), PASTED)) from None
        alternatives = tuple(_priced(cfg, plan, profiles))
    return Planned(
        form=form,
        plan=plan,
        payload=plan.to_dict(),
        title=f"{cfg.method.name} {cfg.model.name}" + (f" ({form.recipe})" if form.recipe else ""),
        command=form.command(),
        alternatives=alternatives,
    )


def _priced(cfg: Any, plan: Plan, profiles: Mapping[str, HardwareConfig]) -> list[Alternative]:
    """The planner's alternatives with each one's price an hour and, when the run length is known, for the run.

    The run on another profile is the same job planned there (`stages.config_plan`); an objective that
    generates is priced on its own hardware only (its rollout is planned for that one)."""
    rows = []
    for alt in plan.alternatives:
        hw = profiles.get(alt.hardware)
        hours = usd = None
        if alt.hardware == plan.hardware.name:
            hours, usd = plan.estimate.run_hours, plan.estimate.usd
        elif hw is not None and alt.fits and not cfg.objective.spec.generates:
            estimate = stages.config_plan(replace(cfg, hardware=hw), hw, plan.seq_len, profiles={}).estimate
            hours, usd = estimate.run_hours, estimate.usd
        rows.append(
            Alternative(
                hardware=alt.hardware,
                fits=alt.fits,
                total_gb=alt.total_gb,
                usd_per_hour=None if hw is None else usd_per_hour(hw),
                run_hours=hours,
                run_usd=usd,
            )
        )
    return rows
