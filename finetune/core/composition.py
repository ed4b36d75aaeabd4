"""Hydra: configs/ and recipes/ composed with the command line into one typed, validated `Config`.

    from finetune.core.composition import compose
    cfg = compose(["+recipe=llama70b_qlora", "hardware=h200", "mode=plan"])

The schemas (finetune/core/config/) are registered in Hydra's ConfigStore, the
recipes under the group `recipe` (package `_global_`) so `+recipe=NAME` works
although the folder is called `recipes/`. The entry point composes once and
converts once (`OmegaConf.to_object`): everything downstream gets the typed
objects, never a dict. `load_profiles` reads every hardware profile under
configs/hardware (the planner's alternatives and `hardware=auto`'s candidates).

Hydra and OmegaConf are imported inside the functions: `import finetune.core.config`
stays light for the planner and the workers.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.core import secrets
from finetune.core.config import Config, HardwareConfig, MethodConfig, ModelConfig, PlanConfig, TrainConfig
from finetune.core.config.data import DataConfig
from finetune.core.config.evaluation import EvalConfig
from finetune.core.config.export import ExportConfig
from finetune.core.config.launch import LaunchConfig
from finetune.core.config.objective import ObjectiveConfig
from finetune.core.errors import ConfigError, FinetuneError
from finetune.core.package import PACKAGE_DIR

# ---------------------------------------------------------------- the files


def package_dir(name: str) -> Path:
    """`configs/` or `recipes/`: inside the installed package, else at the repository root."""
    installed = PACKAGE_DIR / f"_{name}"
    return installed if installed.is_dir() else PACKAGE_DIR.parent / name


# `${finetune_package:data/smollm2}`: a path inside the installed package (data a config group ships).
PACKAGE_RESOLVER = "finetune_package"


def _package_path(relative: str) -> str:
    path = (PACKAGE_DIR / relative).resolve()
    if PACKAGE_DIR not in path.parents and path != PACKAGE_DIR:
        raise ConfigError(f"${{{PACKAGE_RESOLVER}:{relative}}}: not a path inside the finetune package")
    return str(path)


def register_configs() -> None:
    """Register the schemas and the recipes (group `recipe`, package `_global_`) in Hydra's ConfigStore, and
    the `finetune_package` resolver the shipped configs name their files with."""
    import yaml
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver(PACKAGE_RESOLVER, _package_path, replace=True)

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, schema in (
        ("model", ModelConfig),
        ("method", MethodConfig),
        ("hardware", HardwareConfig),
        ("data", DataConfig),
        ("train", TrainConfig),
        ("plan", PlanConfig),
        ("launch", LaunchConfig),
        ("eval", EvalConfig),
        ("export", ExportConfig),
        ("objective", ObjectiveConfig),
    ):
        cs.store(group=group, name=f"{group}_schema", node=schema)
    for path in sorted(package_dir("recipes").glob("*.yaml")):
        node = yaml.safe_load(path.read_text()) or {}
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in package_dir("recipes").glob("*.yaml"))


def group_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (package_dir("configs") / group).glob("*.yaml"))


# ---------------------------------------------------------------- the command line

_GROUPS = ("model", "method", "hardware", "data", "train", "plan", "launch", "eval", "export", "objective")
DEFAULT_RECIPE = "tiny"


# A model given by file rather than by group: `model.config_path=...` or `model.gguf_file=...`.
_MODEL_FILE = re.compile(r"\+{0,2}model\.(config_path|gguf_file)=(.+)")


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """The spellings the product card promises, made plain Hydra overrides.

    - no `+recipe=` and no model chosen: the embedded default recipe (`tiny`) is added, so `hardware=h200`
      or `method=qlora` alone runs the embedded default there. A model chosen by group (model=...), by its
      config.json (model.config_path=...) or by a GGUF file (model.gguf_file=...) starts from
      configs/config.yaml alone, so no tiny-only value (seq_len, LoRA rank, learning rate, steps) leaks
      into it;
    - a model given by file, without model= or model.name=, is named after the file (the run directory
      runs/<name>_<method>), not `tiny`; a config.json's model is then renamed by its config at resolve time
      (finetune/modeling/models.py);
    - `smoke=true|false` sets `smoke.enabled` (`smoke` is a section with `steps` and `sibling` too).
    """
    out = []
    for item in overrides:
        m = re.fullmatch(r"smoke=(\w+)", item)
        out.append(f"smoke.enabled={m.group(1)}" if m else item)
    by_group = any(re.match(r"\+{0,2}(recipe|model)=", item) for item in out)
    by_file = [m for m in (_MODEL_FILE.fullmatch(item) for item in out) if m and m.group(2) != "null"]
    if not by_group and not by_file:
        out.insert(0, f"+recipe={DEFAULT_RECIPE}")
    named = any(re.match(r"\+{0,2}model\.name=", item) for item in out)
    if by_file and not by_group and not named:
        out.append(f"model.name={_file_model_name(*by_file[-1].groups())}")
    return out


def _file_model_name(key: str, value: str) -> str:
    """A run-directory-safe name from the file: a GGUF file's stem, a config.json's folder."""
    path = Path(value.split("/", 1)[1] if value.startswith("package:") and "/" in value else value)
    stem = path.name.removesuffix(".gguf") if key == "gguf_file" else path.parent.name
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).strip("-._+")[:100]
    return name or "model"


def compose(overrides: Sequence[str]) -> Config:
    """Compose configs/ + recipes/ with the command-line overrides into one typed, validated `Config`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    overrides = normalize_overrides(overrides)
    _check_overrides(overrides)
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(package_dir("configs")), version_base="1.3"):
            raw = hydra_compose(config_name="config", overrides=list(overrides))
        cfg = OmegaConf.to_object(raw)
    except FinetuneError:
        raise
    except Exception as exc:  # Hydra and OmegaConf raise many types; all are bad input here.
        raise ConfigError(_one_line(exc)) from None
    assert isinstance(cfg, Config)
    _register_forwarded_secrets(cfg, overrides)
    return cfg


# `+launch.env.KEY=${oc.env:NAME}` (or `${oc.env:NAME,default}`): the one place an environment variable may
# be read into the config, forwarding it to the ranks by reference.
_FORWARDED = re.compile(r"\+{0,2}launch\.env\.([A-Za-z_]\w*)=\$\{oc\.env:([A-Za-z_]\w*)(?:,[^{}]*)?\}")


def _check_env_interpolation(item: str) -> None:
    """Refuse ${oc.env:...} anywhere but as the whole value of a launch.env entry.

    Refused rather than redacted: config.yaml must say what the run used, and a name or path read
    from the environment would land in clear in config.yaml, plan.json, folder names and scripts
    (redacting it there would make config.yaml name a run directory or data file that does not exist).
    The shell already expands `run_dir=$SCRATCH/x` visibly. A forwarded launch.env value is a secret
    by assumption: redacted everywhere, referenced by name in launch.sh (`_register_forwarded_secrets`).
    """
    if "oc.env" not in item or _FORWARDED.fullmatch(item):
        return
    key = item.split("=", 1)[0].lstrip("+")
    raise ConfigError(
        f"{key}: ${{oc.env:...}} is accepted only as the whole value of +launch.env.NAME (forwarded to the "
        f'ranks by reference); write the value itself, or let the shell expand it: {key}="$VAR"'
    )


def _register_forwarded_secrets(cfg: Config, overrides: Sequence[str]) -> None:
    for item in overrides:
        m = _FORWARDED.fullmatch(item)
        if not m:
            continue
        key, var = m.groups()
        value = cfg.launch.env.get(key)
        if value and os.environ.get(var) == value:
            secrets.register(value, var)


def _check_overrides(overrides: Sequence[str]) -> None:
    """Name the valid choices for an unknown group option or recipe before Hydra's long message."""
    for item in overrides:
        if not item.strip():
            raise ConfigError("an empty argument: write KEY=VALUE")
        _check_env_interpolation(item)
        added = re.fullmatch(r"\+{1,2}([\w.]+)=.*", item)
        if added and added.group(1) != "recipe" and not added.group(1).startswith("launch.env."):
            key = added.group(1)
            raise ConfigError(
                f"{key}: unknown key ('+' adds keys; only +recipe=NAME and +launch.env.NAME=VALUE are accepted)"
            )
        m = re.fullmatch(r"\+?\+?(\w+)=([\w.\-/]+)", item)
        if not m:
            continue
        key, value = m.groups()
        if key == "recipe":
            valid = recipe_names()
        elif key in _GROUPS and key not in ("train", "plan", "launch", "eval", "export"):
            valid = group_choices(key)
        else:
            continue
        if value not in valid:
            raise ConfigError(f"{key}={value}: unknown {key}; choose from {', '.join(valid)}")
        if key == "recipe" and not item.startswith("+"):
            raise ConfigError(
                f"recipe={value}: write +recipe={value} (a recipe is added on top of the defaults)"
            )


def _one_line(exc: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line errors as one line that names the key."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, FinetuneError):
        return str(cause)
    for err in (cause, exc):
        if err is None:
            continue
        text = str(err)
        first = text.splitlines()[0] if text else type(err).__name__
        full_key = re.search(r"full_key: (\S+)", text)
        if not full_key:
            continue
        key = full_key.group(1)
        if "not in" in first:
            return f"{key}: unknown key; valid keys: {', '.join(_valid_keys(key))}"
        return secrets.redact_echo(key, f"{key}: {first}")
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _valid_keys(full_key: str) -> list[str]:
    """The fields of the section that holds `full_key` (train.foo -> the fields of TrainConfig)."""
    import dataclasses

    node: Any = Config
    for part in full_key.split(".")[:-1]:
        node = typing.get_type_hints(node).get(part)
        if not dataclasses.is_dataclass(node):
            return []
    return sorted(f.name for f in dataclasses.fields(node))


# ---------------------------------------------------------------- the hardware profiles


def load_profiles() -> dict[str, HardwareConfig]:
    """Every GPU profile under configs/hardware (for alternatives and hardware=auto)."""
    from omegaconf import OmegaConf

    profiles = {}
    for name in group_choices("hardware"):
        if name in ("auto", "cpu", "local"):  # chosen, or read from the machine, at plan time
            continue
        node = OmegaConf.merge(
            OmegaConf.structured(HardwareConfig),
            OmegaConf.load(package_dir("configs") / "hardware" / f"{name}.yaml"),
        )
        hw = OmegaConf.to_object(node)
        assert isinstance(hw, HardwareConfig)
        profiles[name] = hw
    return profiles
