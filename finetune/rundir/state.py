"""What a run directory holds between stages: the resolved config, the plan, the engine record, read back
by every later stage and rank (which never parse the command line or re-plan); and the resume policy that
refuses to write a config over checkpoints trained under another one."""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from finetune.core.config import Config
from finetune.core.errors import ConfigError, FinetuneError, LaunchError
from finetune.core.secrets import scrub
from finetune.planner import Plan
from finetune.rundir import checkpoints
from finetune.rundir.files import atomic_write_text, read_own_text
from finetune.rundir.layout import CONFIG_FILE, ENGINE_FILE, PLAN_FILE, ROLLOUT_FILE, checkpoint_dir
from finetune.rundir.shell import command_line


def save_config(cfg: Config, run_dir: Path) -> Path:
    """The resolved config that every rank and later stage reads (no command-line parsing there).

    The pipeline checks `check_resumable` first: a config is never written over checkpoints it does not fit.
    """
    from omegaconf import OmegaConf

    path = run_dir / CONFIG_FILE
    atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.structured(scrub(asdict(cfg)))))
    return path


# What the checkpoints of a run depend on: resuming them under other values would be a different run.
_IGNORED = {"model": {"trust_remote_code", "allow_pickle_weights"}, "data": {"cache_dir", "num_proc"}}
_TRAIN_KEYS = ("seq_len", "batch_size", "seed")


def _resume_facts(d: dict) -> dict[str, Any]:
    facts = {}
    for section in ("model", "method", "data"):
        for key, value in (d.get(section) or {}).items():
            if key not in _IGNORED.get(section, ()):
                facts[f"{section}.{key}"] = value
    for key in _TRAIN_KEYS:
        facts[f"train.{key}"] = (d.get("train") or {}).get(key)
    return facts


def check_resumable(cfg: Config, run_dir: Path) -> None:
    """Refuse to overwrite the config of a run that has checkpoints with one its checkpoints do not belong to.

    Only when resuming (resume=true or a path): resume=false discards the checkpoints anyway.
    """
    import yaml

    path = Path(run_dir) / CONFIG_FILE
    if cfg.resume is False or not path.is_file() or not checkpoints.listing(checkpoint_dir(run_dir)):
        return
    try:
        old = yaml.safe_load(read_own_text(path)) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return
    if not isinstance(old, dict):
        return
    before, after = _resume_facts(old), _resume_facts(scrub(asdict(cfg)))
    changed = [k for k in after if k in before and before[k] != after[k]]
    if changed:
        key = changed[0]
        raise ConfigError(
            f"run_dir={run_dir} has checkpoints trained with {key}={before[key]!r}, not {after[key]!r}"
            + (f" (and {len(changed) - 1} more change(s))" if len(changed) > 1 else "")
            + ": resume=false starts over (discarding them), or choose another run_dir"
        )


def _rerun(run_dir: Path, *args: str) -> str:
    return command_line("python", "-m", "finetune", *args, f"run_dir={run_dir}")


def _damaged(path: Path, exc: BaseException, again: str) -> LaunchError:
    lines = str(exc).strip().splitlines()
    why = f"{type(exc).__name__}: {lines[0][:160]}" if lines else type(exc).__name__
    return LaunchError(f"{path}: damaged ({why}); write it again: {again}")


def load_plan(run_dir: Path) -> Plan:
    """`plan.json` back into a `Plan`, with its hardware profile and process layout (workers read it;
    they never re-plan)."""
    path = Path(run_dir) / PLAN_FILE
    again = _rerun(run_dir, "mode=plan")
    if not path.is_file():
        raise LaunchError(f"{path}: missing; run the plan stage ({again}) first")
    try:
        return Plan.from_dict(json.loads(read_own_text(path)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _damaged(path, exc, again) from None


def load_engine(run_dir: Path) -> dict[str, Any]:
    """`engine.json`: the engine, world size, engine files and SFTConfig arguments the launcher wrote."""
    path = Path(run_dir) / ENGINE_FILE
    again = _rerun(run_dir, "mode=launch", "launch.dry_run=true")
    if not path.is_file():
        raise LaunchError(
            f"{path}: missing; the launcher writes it: train with {_rerun(run_dir, 'mode=train')} "
            "(or mode=launch; launch.dry_run=true writes it without starting)"
        )
    try:
        engine = json.loads(read_own_text(path))
        if not isinstance(engine, dict) or not isinstance(engine.get("trainer_kwargs"), dict):
            raise ValueError("not an engine record")
        int(engine["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _damaged(path, exc, again) from None
    return engine


def load_rollout(run_dir: Path) -> Optional[dict[str, Any]]:
    """`rollout.json` (an objective that generates: where its rollout runs), or None where there is none."""
    path = Path(run_dir) / ROLLOUT_FILE
    if not path.is_file():
        return None
    try:
        rollout = json.loads(read_own_text(path))
        if not isinstance(rollout, dict) or not isinstance(rollout.get("mode"), str):
            raise ValueError("not a rollout plan")
    except (OSError, ValueError) as exc:
        raise _damaged(path, exc, _rerun(run_dir, "mode=plan")) from None
    return rollout


def load_config(run_dir: Path) -> Config:
    """Read `config.yaml` back into the typed `Config` (what workers do instead of parsing argv)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise LaunchError(f"{path}: missing; run the pipeline ({_rerun(run_dir)}) first")
    try:
        node = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(io.StringIO(read_own_text(path))))
        cfg = OmegaConf.to_object(node)
    except FinetuneError:
        raise
    except (OSError, ValueError, YAMLError, OmegaConfBaseException) as exc:
        raise _damaged(path, exc, f"{_rerun(run_dir, 'mode=plan')} with the run's other settings") from None
    assert isinstance(cfg, Config)
    return cfg
