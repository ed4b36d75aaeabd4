"""What a run directory holds between stages: the resolved config, the plan, the engine record, read back
by every later stage and rank (which never parse the command line or re-plan); and the resume policy that
refuses to write a config over checkpoints trained under another one."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from finetune.core import userfiles
from finetune.core.config import Config
from finetune.core.errors import ConfigError, FinetuneError, LaunchError
from finetune.core.secrets import scrub
from finetune.planner import Plan
from finetune.rundir import checkpoints
from finetune.rundir.files import atomic_write_text, read_own_text
from finetune.rundir.layout import (
    ADAPTER_DIR,
    CONFIG_FILE,
    ENGINE_FILE,
    EXPORT_DIR,
    IDENTITY_FILE,
    MERGED_DIR,
    MODEL_DIR,
    PLAN_FILE,
    RESUME_FILE,
    ROLLOUT_FILE,
    checkpoint_dir,
)
from finetune.rundir.shell import command_line


def save_config(cfg: Config, run_dir: Path) -> Path:
    """The resolved config that every rank and later stage reads (no command-line parsing there), and, in
    every mode but `plan`, the facts its checkpoints will be trained under (`resume.json`).

    The pipeline checks `check_resumable` first: a config is never written over checkpoints it does not fit.
    """
    from omegaconf import OmegaConf

    path = run_dir / CONFIG_FILE
    atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.structured(scrub(asdict(cfg)))))
    if cfg.mode != "plan":  # planning trains nothing: the checkpoints' facts stay theirs
        atomic_write_text(run_dir / RESUME_FILE, json.dumps(resume_facts(cfg), indent=1) + "\n")
    return path


# What the checkpoints of a run depend on: resuming them under other values would be a different run. Every
# key of these sections counts, less those that cannot change what training computes.
_SECTIONS = ("model", "method", "data")
_IGNORED = {
    "model": {"trust_remote_code", "allow_pickle_weights"},
    "data": {"cache_dir", "num_proc"},
    # the name is `objective` above; where generation runs and how long a reward may take: not what is trained
    "objective": {
        "name",
        "reward_timeout_s",
        "generation",
        "vllm_gpu_memory_utilization",
        "vllm_server_host",
        "vllm_server_port",
        "vllm_server_timeout_s",
    },
}
# train.max_steps and epochs may grow (a longer run continues the same one); micro-batch and accumulation
# are a layout of the same batch.
_TRAIN_KEYS = ("seq_len", "batch_size", "seed", "lr_scheduler", "warmup_ratio", "max_grad_norm")


def resume_facts(cfg: Config) -> dict[str, Any]:
    """The settings a run's checkpoints belong to: the model, method and data sections, the objective and its
    own settings section, the training keys that change what a step computes, `init_from` by the identity
    of what it starts from (a run there trained again is another start), and each frozen model beside the
    policy (a distillation teacher, a reward model) by the identity of what its folder holds now."""
    facts = _facts(scrub(asdict(cfg)), init_from_identity(cfg.init_from))
    for companion in cfg.objective.spec.companions_of(cfg.objective):
        identity = model_identity(companion.model)
        if identity is not None:
            facts[_identity_key(companion.role)] = identity
    # as they read back from resume.json (tuples as lists), so a comparison sees values, not types
    return json.loads(json.dumps(facts, default=str))


def _identity_key(role: str) -> str:
    return f"objective.{role} identity"


def _facts(d: dict, init_identity: Optional[str]) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    objective = (d.get("objective") or {}).get("name")
    if objective is not None:  # (a config written before objectives existed trained SFT, as the default)
        facts["objective"] = objective
    # the objective's section holds that objective's own settings (objective.beta, objective.num_generations)
    for section in (*_SECTIONS, "objective"):
        for key, value in (d.get(section) or {}).items():
            if key not in _IGNORED.get(section, ()):
                facts[f"{section}.{key}"] = value
    for key in _TRAIN_KEYS:
        facts[f"train.{key}"] = (d.get("train") or {}).get(key)
    facts["init_from"] = init_identity
    return facts


def init_from_identity(init_from: Optional[str]) -> Optional[str]:
    """What `init_from=RUN_DIR` starts from, as an identity: the SHA-256 its output's identity.json records
    (adapter/, model/ or export/merged/, as loading picks them), else its files' names, sizes and times."""
    if not init_from:
        return None
    run = Path(init_from)
    for folder in (run / ADAPTER_DIR, run / MODEL_DIR, run / EXPORT_DIR / MERGED_DIR):
        if folder.is_dir():
            return _folder_identity(folder)
    return f"path:{run.resolve()}"


def model_identity(name: str) -> Optional[str]:
    """What a model named as `model=` names one holds now, where it is a local folder: a run directory's output
    (`init_from_identity`) or a model folder's own (`_folder_identity`); None for a preset or a hub id, whose
    name is what it is."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return None
    if (folder / "config.json").is_file():
        return _folder_identity(folder)
    return init_from_identity(str(folder))


# identity.json is a few hundred bytes
_IDENTITY_LIMIT = 1 << 20


def _folder_identity(folder: Path) -> str:
    """The SHA-256 a model folder's identity.json records (finetune wrote it), else its files' names, sizes and
    modification times (a model saved there again differs)."""
    try:
        doc = json.loads(userfiles.read_text(folder / IDENTITY_FILE, "identity", _IDENTITY_LIMIT))
        return f"sha256:{doc['identity']['sha256']}"
    except (FinetuneError, ValueError, KeyError, TypeError):  # missing, not a file, damaged: by its files
        pass
    files = sorted(p for p in folder.iterdir() if p.is_file())
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return "files:" + hashlib.sha256(repr(stats).encode()).hexdigest()


def _recorded_facts(run_dir: Path) -> Optional[dict[str, Any]]:
    """The facts the checkpoints were trained under: resume.json, or (a run directory written before it
    existed) those of config.yaml; None when neither can be read."""
    import yaml

    try:
        doc = json.loads(read_own_text(run_dir / RESUME_FILE))
        if isinstance(doc, dict):
            return doc
    except (OSError, ValueError):
        pass
    try:
        old = yaml.safe_load(read_own_text(run_dir / CONFIG_FILE)) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(old, dict):
        return None
    return _facts(old, init_from_identity(old.get("init_from")))


def check_init_from(cfg: Config, run_dir: Path) -> None:
    """`init_from` naming this run's own directory would start training from the output it replaces."""
    if cfg.init_from and Path(cfg.init_from).resolve() == Path(run_dir).resolve():
        raise ConfigError(
            f"init_from={cfg.init_from} is this run's own directory: start from an earlier run, and give this "
            "one its own (name=NEW_NAME or run_dir=PATH)"
        )


def check_resumable(cfg: Config, run_dir: Path) -> None:
    """Refuse to overwrite the facts of a run that has checkpoints with ones its checkpoints do not belong to.

    Only when resuming (resume=true or a path): resume=false discards the checkpoints anyway. Never for
    mode=plan, which trains nothing and leaves the checkpoints' facts as they are.
    """
    check_init_from(cfg, run_dir)
    if cfg.mode != "plan":
        check_resume_facts(cfg, run_dir)


def check_resume_facts(cfg: Config, run_dir: Path) -> None:
    """`check_resumable` whatever the mode: what each launch checks before training (rundir/preflight.py), so
    ranks started by hand after a mode=plan under other settings do not resume checkpoints they do not fit."""
    if cfg.resume is False or not checkpoints.listing(checkpoint_dir(run_dir)):
        return
    before = _recorded_facts(Path(run_dir))
    if before is None:
        return
    after = resume_facts(cfg)
    changed = [k for k in after if k in before and before[k] != after[k]]
    if changed:
        key = changed[0]
        if key == "init_from":
            what = f"init_from starting from {before[key] or 'the base'}, not {after[key] or 'the base'}"
        elif key.endswith(" identity"):
            setting = key.removesuffix(" identity")
            what = f"{setting} holding {before[key]}, which holds {after[key]} now (another model)"
        else:
            what = f"{key}={before[key]!r}, not {after[key]!r}"
        raise ConfigError(
            f"run_dir={run_dir} has checkpoints trained with {what}"
            + (f" (and {len(changed) - 1} more change(s))" if len(changed) > 1 else "")
            + ": to keep both, give this experiment its own run directory (name=NEW_NAME or run_dir=PATH); "
            "resume=false here starts this one over (its checkpoints are discarded)"
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
