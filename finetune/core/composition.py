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

import dataclasses
import os
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.core import secrets, userfiles
from finetune.core.config import Config, HardwareConfig, MethodConfig, ModelConfig, PlanConfig, TrainConfig
from finetune.core.config.data import DataConfig
from finetune.core.config.evaluation import EvalConfig
from finetune.core.config.export import ExportConfig
from finetune.core.config.launch import LaunchConfig
from finetune.core.config.objective import former_key
from finetune.core.errors import ConfigError, FinetuneError
from finetune.core.objectives import OBJECTIVES
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
    ):
        cs.store(group=group, name=f"{group}_schema", node=schema)
    # Each objective's settings are the `objective` section's schema when it is chosen: its YAML extends
    # NAME_schema; an objective without a YAML under configs/objective is chosen by its schema alone.
    for name, spec in OBJECTIVES.items():
        cs.store(group="objective", name=f"{name}_schema", node=spec.settings_class())
        if name not in group_choices("objective"):
            cs.store(group="objective", name=name, node=spec.settings_class())
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
_MODEL_FILE = re.compile(r"\+{0,2}model\.(config_path|gguf_file|hub_id)=(.+)")


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """The spellings the product card promises, made plain Hydra overrides.

    - `model=FOLDER` (a local model folder, as `save_pretrained` writes it) is `model.config_path=FOLDER/
      config.json`; `model=ORG/NAME` (a hub id, not a preset) is `model.hub_id=ORG/NAME model.shape=hub`:
      the architecture read from that model's own config.json (finetune/modeling/resolve.py);
    - no `+recipe=` and no model chosen: the embedded default recipe (`tiny`) is added, so `hardware=h200`
      or `method=qlora` alone runs the embedded default there. A model chosen by group (model=...), by its
      config.json (model.config_path=...), by a GGUF file (model.gguf_file=...) or by hub id starts from
      configs/config.yaml alone, so no tiny-only value (seq_len, LoRA rank, learning rate, steps) leaks
      into it;
    - a model given by file or hub id, without model.name=, is named after it (the run directory
      runs/<name>_<method>), not `tiny`; a config.json's model is then renamed by its config at resolve time
      (finetune/modeling/resolve.py);
    - `smoke=true|false` sets `smoke.enabled` (`smoke` is a section with `steps` and `sibling` too);
    - a key of a former objective section (`dpo.beta=0.2`) is its `objective.` key, with a pointer on stderr.
    """
    out: list[str] = []
    for item in overrides:
        item = former_key(item) or item
        m = re.fullmatch(r"smoke=(\w+)", item)
        out.extend([f"smoke.enabled={m.group(1)}"] if m else _model_spelling(item))
    by_group = any(re.match(r"\+{0,2}(recipe|model)=", item) for item in out)
    by_file = [m for m in (_MODEL_FILE.fullmatch(item) for item in out) if m and m.group(2) != "null"]
    if not by_group and not by_file:
        out.insert(0, f"+recipe={DEFAULT_RECIPE}")
    by_preset = any(re.match(r"\+{0,2}model=", item) for item in out)
    named = any(re.match(r"\+{0,2}model\.name=", item) for item in out)
    if by_file and not by_preset and not named:
        out.append(f"model.name={_file_model_name(*by_file[-1].groups())}")
    shaped = any(re.match(r"\+{0,2}model\.shape=", item) for item in out)
    if by_file and not by_preset and not shaped and {m.group(1) for m in by_file} == {"hub_id"}:
        out.append("model.shape=hub")
    return out


# A hub id as the hub spells it: ORG/NAME.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _model_spelling(item: str) -> list[str]:
    """`model=VALUE` where VALUE is a local folder or a hub id rather than a preset, as overrides; any other
    argument as it is."""
    m = re.fullmatch(r"model=(.+)", item)
    if not m or m.group(1) in group_choices("model"):
        return [item]
    value = m.group(1)
    folder = Path(value).expanduser()
    if folder.is_dir() or value.startswith(("/", "./", "../", "~")):
        config = folder / "config.json"
        if not config.is_file():
            why = "no config.json in that folder" if folder.is_dir() else "no such folder"
            raise ConfigError(
                f"model={value}: {why} (a model folder holds the config.json save_pretrained writes)"
            )
        return [f"model.config_path={config.resolve()}"]
    if _HUB_ID.fullmatch(value):
        return [f"model.hub_id={value}", "model.shape=hub"]
    return [item]


def _file_model_name(key: str, value: str) -> str:
    """A run-directory-safe name from the file: a GGUF file's stem, a config.json's folder, a hub id's NAME."""
    path = Path(value.split("/", 1)[1] if value.startswith("package:") and "/" in value else value)
    stem = path.name.removesuffix(".gguf") if key in ("gguf_file", "hub_id") else path.parent.name
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).strip("-._+")[:100]
    return name or "model"


def compose(overrides: Sequence[str]) -> Config:
    """Compose configs/ + recipes/ with the command-line overrides into one typed, validated `Config`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    overrides, files = user_files(overrides)
    try:
        overrides = normalize_overrides(overrides)
        _check_overrides(overrides, [f.name for f in files])
        register_configs()
        for f in files:
            f.register()
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
        cfg = _check_preset_hub_id(cfg)
    except ConfigError as exc:
        raise _in_file(exc, files) from None
    _register_forwarded_secrets(cfg, overrides)
    return cfg


# ---------------------------------------------------------------- a config file of one's own


@dataclasses.dataclass
class UserFile:
    """A YAML file of the user's own (`python -m finetune my.yaml`, `+recipe=./my.yaml`): the recipes'
    schema. A section given as a string (`model: Qwen/Qwen2.5-7B-Instruct`, `method: qlora`) chooses the
    group as `model=...` on the command line would; the rest is registered as a recipe is."""

    path: Path
    name: str
    node: dict
    choices: list[str]

    @property
    def keys(self) -> set[str]:
        """Every dotted key the file sets (train, train.seq_len, ...), to name the file in errors."""
        out: set[str] = set()

        def walk(node: Any, prefix: str) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    key = f"{prefix}{k}"
                    out.add(key)
                    walk(v, f"{key}.")

        walk(self.node, "")
        out |= {c.split("=", 1)[0] for c in self.choices}
        for entry in self.node.get("defaults") or []:
            if isinstance(entry, dict):
                out |= {str(k).split("/")[-1] for k in entry}
        return out

    def register(self) -> None:
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(group="recipe", name=self.name, node=self.node, package="_global_")


def _is_user_file(value: str) -> bool:
    return value not in recipe_names() and (value.endswith((".yaml", ".yml")) or "/" in value)


def user_files(overrides: Sequence[str]) -> tuple[list[str], list[UserFile]]:
    """The command line with each user YAML file (a bare `FILE.yaml` argument or `+recipe=PATH`) replaced by
    its group choices and `+recipe=<its registered name>`; a group the command line chooses too is left to
    the command line (it comes later, so it wins, as any key=value over the file does)."""
    import yaml

    out: list[str] = []
    files: list[UserFile] = []
    for i, item in enumerate(overrides):
        m = re.fullmatch(r"\+{1,2}recipe=(.+)", item)
        value = m.group(1) if m else item if "=" not in item and item.endswith((".yaml", ".yml")) else None
        if value is None or not _is_user_file(value):
            out.append(item)
            continue
        path = Path(value).expanduser()
        if not path.exists():  # not a regular file (a FIFO, a device): refused in one line by `userfiles`
            raise ConfigError(
                f"{value}: no such file (a config file of your own: python -m finetune init {value})"
            )
        try:
            node = yaml.safe_load(userfiles.read_text(path, "+recipe"))
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            line = f"line {where.line + 1}: " if where is not None else ""
            raise ConfigError(
                f"{value}: not valid YAML ({line}{getattr(exc, 'problem', None) or exc})"
            ) from None
        node = {} if node is None else node
        if not isinstance(node, dict) or not all(isinstance(k, str) for k in node):
            raise ConfigError(f"{value}: not a mapping of sections (model:, method:, train:, ...)")
        later = {re.sub(r"^\+*", "", o).split("=", 1)[0] for o in overrides[i + 1 :] if "=" in o}
        choices = []
        for group in _GROUPS:
            chosen = node.get(group)
            if isinstance(chosen, str):
                del node[group]
                if group not in later:
                    choices.append(f"{group}={chosen}")
            elif chosen is not None and not isinstance(chosen, dict):
                raise ConfigError(f"{value}: {group}: give a name (model: NAME) or a section of keys")
        stem = re.sub(r"\W+", "_", path.stem)
        files.append(UserFile(path, f"_file{len(files)}_{stem}", node, choices))
        out += [*choices, f"+recipe={files[-1].name}"]
    return out, files


def _in_file(exc: ConfigError, files: list[UserFile]) -> ConfigError:
    """An error about a key the user's file sets, naming the file first."""
    m = re.match(r"[+~]*([\w.]+)", str(exc))
    if not m:
        return exc
    key = m.group(1)
    for f in files:
        if key in f.keys or any(key.startswith(f"{k}.") for k in f.keys if "." in k):
            return ConfigError(f"{f.path}: {exc}")
    return exc


def _check_preset_hub_id(cfg: Config) -> Config:
    """A preset given another hub id is checked against that model's config.json when resolved
    (`model.shape=checked`), never planned as the preset unseen."""
    import yaml

    model = cfg.model
    preset = package_dir("configs") / "model" / f"{model.name}.yaml"
    if model.shape != "stated" or not model.hub_id or not preset.is_file():
        return cfg
    stated = (yaml.safe_load(preset.read_text()) or {}).get("hub_id")
    if stated == model.hub_id:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(model, shape="checked"))


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


def _check_overrides(overrides: Sequence[str], user_recipes: Sequence[str] = ()) -> None:
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
            valid = [*recipe_names(), *user_recipes]
        elif key == "objective":
            valid = sorted(OBJECTIVES)
        elif key in _GROUPS and key not in ("train", "plan", "launch", "eval", "export"):
            valid = group_choices(key)
        else:
            continue
        if value not in valid:
            also = ", a hub id (ORG/NAME) or a model folder" if key == "model" else ""
            raise ConfigError(f"{key}={value}: unknown {key}; choose from {', '.join(valid)}{also}")
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
            return f"{key}: unknown key; valid keys: {', '.join(_valid_keys(key, text))}"
        return secrets.redact_echo(key, f"{key}: {first}")
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _valid_keys(full_key: str, text: str = "") -> list[str]:
    """The fields of the section that holds `full_key` (train.foo -> the fields of TrainConfig; objective.foo
    -> those of the chosen objective's settings, the `object_type` Hydra's message names)."""
    node: Any = Config
    chosen = re.search(r"object_type=(\w+)", text)
    by_name = {s.settings_class().__name__: s.settings_class() for s in OBJECTIVES.values()}
    for part in full_key.split(".")[:-1]:
        node = typing.get_type_hints(node).get(part)
        if node is Any and chosen:
            node = by_name.get(chosen.group(1))
        if not dataclasses.is_dataclass(node):
            return []
    return sorted(f.name for f in dataclasses.fields(node))


# ---------------------------------------------------------------- the hardware profiles


def load_profiles() -> dict[str, HardwareConfig]:
    """Every GPU profile under configs/hardware (for alternatives and hardware=auto)."""
    from omegaconf import OmegaConf

    profiles = {}
    for name in group_choices("hardware"):
        if name in (
            "auto",
            "cpu",
            "local",
            "custom",
        ):  # chosen, read from the machine, or given, at plan time
            continue
        node = OmegaConf.merge(
            OmegaConf.structured(HardwareConfig),
            OmegaConf.load(package_dir("configs") / "hardware" / f"{name}.yaml"),
        )
        hw = OmegaConf.to_object(node)
        assert isinstance(hw, HardwareConfig)
        profiles[name] = hw
    return profiles
