"""The frozen models an objective puts beside the policy (`ObjectiveSpec.companions`: a distillation teacher, a
learned reward model), resolved at the edge: each named as `model=` names a model (a preset under
configs/model/, a local folder with a config.json, a hub id, or a finished run directory's trained model or
merged export), read into its shape for the planner and loaded frozen for training and evaluation.

A companion whose head is the language model's ("lm") is compared with the policy over the vocabulary token by
token, so it must share the policy's vocabulary: a mismatch is refused in one line before anything loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.core.composition import package_dir
from finetune.core.config import Config, ModelConfig
from finetune.core.errors import ConfigError
from finetune.core.objectives import Companion
from finetune.modeling.loading import load_pretrained
from finetune.modeling.models import model_source
from finetune.modeling.resolve import resolve_model
from finetune.planner.companions import CompanionShape

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# A finished run's full model, then its merged export: what a run directory's trained output is as one model.
_RUN_OUTPUTS = ("model", "export/merged")


@dataclass(frozen=True)
class Resolved:
    """A companion with where its weights load from and its model's facts."""

    companion: Companion
    source: str  # what from_pretrained loads: a folder or a hub id
    model: ModelConfig

    def shape(self) -> CompanionShape:
        c = self.companion
        return CompanionShape(c.role, self.model, c.head, c.logit_copies)


def _key(companion: Companion) -> str:
    return f"objective.{companion.role}={companion.model}"


def _run_output(run: Path, key: str) -> Path:
    for name in _RUN_OUTPUTS:
        if (run / name / "config.json").is_file():
            return run / name
    raise ConfigError(
        f"{key}: the run directory holds no model/ or export/merged/ with a model in it "
        "(an adapter run is a model once exported: run its mode=export first)"
    )


def _preset(name: str, key: str) -> ModelConfig:
    from omegaconf import OmegaConf

    path = package_dir("configs") / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"{key}: not a preset (configs/model/), a folder with a config.json, a run directory or a hub id"
        )
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    model = OmegaConf.to_object(merged)
    assert isinstance(model, ModelConfig)
    return model


def resolve(companion: Companion) -> Resolved:
    """Where the companion loads from and its shape, read from its config.json or its preset."""
    key, name = _key(companion), companion.model
    folder = Path(name).expanduser()
    if folder.is_dir():
        if (folder / "config.yaml").is_file() and not (folder / "config.json").is_file():
            folder = _run_output(folder, key)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{key}: no config.json in that folder (nor a run directory's model)")
        model = resolve_model(ModelConfig(name=folder.name, config_path=str(folder / "config.json")))
        return Resolved(companion, str(folder), model)
    if name.startswith(("/", "./", "../", "~")):
        raise ConfigError(f"{key}: no such folder")
    if _HUB_ID.fullmatch(name):
        model = resolve_model(ModelConfig(name=name.split("/")[-1], hub_id=name, shape="hub"))
        return Resolved(companion, name, model)
    model = _preset(name, key)
    return Resolved(companion, model_source(model), model)


def resolve_all(cfg: Config) -> tuple[Resolved, ...]:
    """The config's companions, resolved; a language-model companion with another vocabulary is refused."""
    out = []
    for companion in cfg.objective.spec.companions_of(cfg.objective):
        resolved = resolve(companion)
        theirs, ours = resolved.model.vocab_size, cfg.model.vocab_size
        if companion.head == "lm" and theirs != ours:
            raise ConfigError(
                f"{_key(companion)}: its vocabulary has {theirs:,} tokens, the student's ({cfg.model.name}) "
                f"{ours:,}: the {companion.role} must share the student's tokenizer"
            )
        out.append(resolved)
    return tuple(out)


def shapes(cfg: Config) -> tuple[CompanionShape, ...]:
    """What the planner counts of each companion."""
    return tuple(r.shape() for r in resolve_all(cfg))


def load_frozen(cfg: Config, resolved: Resolved, dtype: Any) -> Any:
    """The companion in `dtype`, frozen and in eval mode (through the weight-safety check)."""
    if resolved.companion.head != "lm":
        raise ConfigError(f"{_key(resolved.companion)}: head={resolved.companion.head} does not load here")
    # The student's trust and pickle settings: the companion is loaded under the same rules.
    model = load_pretrained(cfg.model, resolved.source, dtype=dtype)
    model.requires_grad_(False)
    return model.eval()
