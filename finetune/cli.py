"""Entry point: compose the Hydra config once, validate it, run the requested stages.

    python -m finetune                                      # embedded default: tiny recipe on the CPU
    python -m finetune +recipe=llama70b_qlora mode=plan     # will it fit, and how should it run?
    python -m finetune mode=plan model=llama3_1_8b method=lora hardware=auto train.seq_len=8192 plan.out=plan.json

Bad input ends with a one-line message naming the key and exit code 2; no traceback.
"""

from __future__ import annotations

import os
import re
import sys
import typing
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from finetune.config import Config, HardwareConfig, group_choices, package_dir, recipe_names, register_configs
from finetune.errors import (
    INTERRUPTED_EXIT_CODE,
    ConfigError,
    DiskFullError,
    FinetuneError,
    interrupt_on_signals,
    is_disk_full,
)

_GROUPS = ("model", "method", "hardware", "data", "train", "plan", "launch", "eval", "export")
DEFAULT_RECIPE = "tiny"


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """The two spellings the product card promises, made plain Hydra overrides.

    - no `+recipe=` and no model chosen: the embedded default recipe (`tiny`) is
      added, so `hardware=h200` or `method=qlora` alone runs the embedded default
      there; a job built around a model (model=...) starts from configs/config.yaml
      alone, so no tiny-only value leaks into it;
    - `smoke=true|false` sets `smoke.enabled` (`smoke` is a section with `steps` and `sibling` too).
    """
    out = []
    for item in overrides:
        m = re.fullmatch(r"smoke=(\w+)", item)
        out.append(f"smoke.enabled={m.group(1)}" if m else item)
    chosen = any(re.match(r"\+{0,2}(recipe|model)=", item) for item in out)
    if not chosen:
        out.insert(0, f"+recipe={DEFAULT_RECIPE}")
    return out


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
    from finetune import secrets

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
        return f"{key}: {first}"
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


# ---------------------------------------------------------------- hardware at the edge


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


def resolve_host_hardware(hw: HardwareConfig) -> HardwareConfig:
    """`hardware=cpu`: the memory and cores of this machine, read now (RAM stands in for GPU memory)."""
    if hw.device != "cpu":
        return hw
    import psutil

    ram_gb = psutil.virtual_memory().total / 1e9
    return replace(
        hw,
        gpu_memory_gb=hw.gpu_memory_gb or round(ram_gb, 2),
        host_memory_gb=hw.host_memory_gb or round(ram_gb, 2),
        vcpus=hw.vcpus or os.cpu_count(),
    )


# ---------------------------------------------------------------- stages


def run(cfg: Config) -> int:
    from finetune import stages

    return stages.run(cfg)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from finetune.secrets import install_log_filter

    install_log_filter()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        print("recipes:", ", ".join(recipe_names()))
        for group in ("model", "method", "hardware", "data"):
            print(f"{group}:", ", ".join(group_choices(group)))
        return 0
    restore = interrupt_on_signals()
    try:
        cfg = compose(args)
        if cfg.smoke.enabled and cfg.mode in ("all", "train"):
            from finetune import smoke

            smoke.run(cfg, args)
        return run(cfg)
    except FinetuneError as exc:
        print(f"finetune: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        from finetune.rundir import free_bytes

        where = exc.filename or os.getcwd()
        print(f"finetune: error: {DiskFullError(where, None, free_bytes(Path(where)))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        from finetune import stages

        name = getattr(exc, "signal_name", "SIGINT")
        print(
            f"finetune: stopped by {name} during {stages.current_stage}; what was written completely is kept "
            "(files, the data cache and checkpoints are written whole or not at all); run the same command "
            "again to continue",
            file=sys.stderr,
        )
        return INTERRUPTED_EXIT_CODE
    finally:
        restore()
