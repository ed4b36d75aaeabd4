"""The pipeline: plan -> data -> train -> eval -> export, each stage runnable alone (`mode=`).

Each stage reads what the previous one wrote into the run directory, so a
stage can be re-run or resumed without redoing the others.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

from finetune import rundir
from finetune.config import Config, ModelConfig
from finetune.errors import ConfigError, PlanError
from finetune.planner import Plan, make_plan

NOT_BUILT = ("train", "eval", "export", "compare")


def model_from_config_json(model: ModelConfig) -> ModelConfig:
    """`model.config_path=PATH`: architecture facts from a local Hugging Face config.json."""
    if not model.config_path:
        return model
    path = Path(model.config_path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model.config_path={path}: no such file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model.config_path={path}: not a readable JSON file ({exc})") from None
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        arch = "qwen2" if raw.get("model_type") == "qwen2" else "llama"
        return replace(
            model,
            name=raw.get("_name_or_path") or path.parent.name or model.name,
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
            max_position_embeddings=int(raw.get("max_position_embeddings", model.max_position_embeddings)),
            rope_theta=float(raw.get("rope_theta", model.rope_theta)),
            rms_norm_eps=float(raw.get("rms_norm_eps", model.rms_norm_eps)),
            hub_id=model.hub_id,
        )
    except KeyError as exc:
        raise ConfigError(f"model.config_path={path}: missing field {exc.args[0]!r}") from None


def resolve(cfg: Config) -> Config:
    """Facts read at the edge: a local config.json, this machine's memory for hardware=cpu."""
    from finetune.cli import resolve_host_hardware

    return replace(cfg, model=model_from_config_json(cfg.model), hardware=resolve_host_hardware(cfg.hardware))


def data_seq_len(run_dir: Path) -> Optional[int]:
    """The sequence length the data stage resolved for train.seq_len=auto, if it ran."""
    stats = run_dir / "data_stats.json"
    if not stats.is_file():
        return None
    value = json.loads(stats.read_text()).get("seq_len")
    return int(value) if value else None


def plan_stage(cfg: Config, run_dir: Path, quiet: bool = False) -> Plan:
    from finetune.cli import load_profiles
    from finetune.report import print_plan

    seq_len = None
    if cfg.train.seq_len == "auto":
        seq_len = data_seq_len(run_dir)
        if seq_len is None:
            raise PlanError("train.seq_len=auto needs the data stage: run mode=data (or mode=all) first")
    plan = make_plan(
        cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, load_profiles(), seq_len=seq_len
    )
    payload = plan.to_dict()
    rundir.write_json(run_dir / rundir.PLAN_FILE, payload)
    if cfg.plan.out:
        out = Path(cfg.plan.out)
        try:
            rundir.write_json(out, payload)
        except OSError as exc:
            raise ConfigError(f"plan.out={out}: cannot write ({exc.strerror})") from None
    if not quiet:
        print_plan(plan, title=f"{cfg.name}: {cfg.method.name} {cfg.model.name}")
        print(
            f"plan written to {run_dir / rundir.PLAN_FILE}" + (f" and {cfg.plan.out}" if cfg.plan.out else "")
        )
    return plan


def run(cfg: Config) -> int:
    cfg = resolve(cfg)
    if cfg.mode in NOT_BUILT:
        print(f"finetune: mode={cfg.mode} is not built yet (built: plan, data, all = plan + data)")
        return 2
    run_dir = rundir.prepare(cfg)
    rundir.save_config(cfg, run_dir)
    if cfg.mode == "plan":
        plan_stage(cfg, run_dir)
        return 0
    if cfg.mode == "launch":
        from finetune.launch import stage as launch_stage

        return launch_stage.run(cfg, run_dir, plan_stage(cfg, run_dir, quiet=True))
    if cfg.mode in ("data", "all"):
        from finetune.data import stage as data_stage

        data_stage.run(cfg, run_dir)
        if cfg.mode == "data":
            return 0
    plan_stage(cfg, run_dir)
    print("finetune: training, evaluation and export are not built yet; stopped after the plan and the data.")
    return 0
