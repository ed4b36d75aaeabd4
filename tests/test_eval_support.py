"""Shared test helpers (no tests here): configs, plans, in-process training, staged configs, adapter runs.

`with_stages` gives a composed config the `eval` and `export` sections as typed
objects (a Config subclass, so it works whether or not the root Config has them).
`make_adapter_run` writes what the training stage leaves behind: the adapter
(small LoRA with random, non-zero B so a merge changes the weights), and a
checkpoint's trainer_state.json with a log history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from finetune.core.config import Config
from finetune.core.config.evaluation import EvalConfig
from finetune.core.config.export import ExportConfig


@dataclass
class StagedConfig(Config):
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


def compose_tiny(*overrides: str) -> Config:
    """The real composed config (recipe tiny) with command-line style overrides."""
    from finetune.pipeline.cli import compose

    return compose(list(overrides))


def plan_for(cfg: Config, **strategy: Any) -> Any:
    """The planner's plan for `cfg` on this machine (hardware=cpu resolved as the pipeline does),
    with strategy fields overridden."""
    from dataclasses import replace

    from finetune.core.composition import load_profiles
    from finetune.pipeline.stages import resolve
    from finetune.planner import make_plan

    cfg = resolve(cfg)
    plan = make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, load_profiles())
    return replace(plan, strategy=replace(plan.strategy, **strategy)) if strategy else plan


def write_engine(cfg: Config, plan: Any, run_dir: Path) -> None:
    """What the launcher writes before the ranks start (engine.json and the engine's files): the in-process
    runs below skip the launcher, and the worker reads them."""
    from finetune.launch.engines import write_engine_files

    write_engine_files(cfg, plan, Path(run_dir))


def prepare_run(cfg: Config) -> Path:
    """A run directory as `python -m finetune mode=train` leaves it for the worker: config.yaml, the data,
    plan.json and the launcher's engine files (the ranks are not started)."""
    from finetune import rundir
    from finetune.data import stage as data_stage
    from finetune.pipeline.stages import plan_stage, resolve

    cfg = resolve(cfg)
    run = rundir.prepare(cfg)
    rundir.save_config(cfg, run)
    data_stage.run(cfg, run)
    write_engine(cfg, plan_stage(cfg, run, quiet=True), run)
    return run


def train_in_process(
    cfg: Config,
    tiny_data: Any,
    *,
    n_eval: int,
    max_generate: int,
    n_train: Optional[int] = None,
    **strategy: Any,
) -> dict:
    """`finetune.train.stage.run` in this process on the tiny data (the first `n_train` training rows and
    `n_eval` eval rows), planned for this machine with `strategy` fixed (the batch shape)."""
    from finetune.pipeline.stages import resolve
    from finetune.train import stage

    cfg = resolve(cfg)
    train, evals = tiny_data
    if n_train:
        train = train.select(range(n_train))
    datasets = (train, evals.select(range(n_eval)))
    plan = plan_for(cfg, **strategy)
    write_engine(cfg, plan, Path(cfg.run_dir))
    return stage.run(cfg, Path(cfg.run_dir), plan, datasets=datasets, max_generate=max_generate)


def with_stages(cfg: Config, eval: Optional[EvalConfig] = None, export: Optional[ExportConfig] = None) -> Any:
    values = {f.name: getattr(cfg, f.name) for f in fields(Config) if f.name not in ("eval", "export")}
    return StagedConfig(
        **values,
        eval=eval or getattr(cfg, "eval", None) or EvalConfig(),
        export=export or getattr(cfg, "export", None) or ExportConfig(),
    )


def fast_eval(**overrides: Any) -> EvalConfig:
    """Few prompts, few tokens, no progress bars: seconds on two CPU cores."""
    settings: dict[str, Any] = dict(num_samples=6, max_new_tokens=6, batch_size=8, progress=False)
    settings.update(overrides)
    return EvalConfig(**settings)


def write_log_history(run_dir: Path, steps: int = 20) -> None:
    history = [{"step": s, "loss": 3.0 / s**0.3} for s in range(1, steps + 1)]
    history += [{"step": s, "eval_loss": 3.2 / s**0.25} for s in (5, 10, 15, 20)]
    ckpt = run_dir / "checkpoints" / f"checkpoint-{steps}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": steps, "log_history": history}))


def make_adapter_run(run_dir: Path, model_cfg: Any, method: Any, seed: int = 0, b_std: float = 0.05) -> Path:
    """RUN_DIR/adapter from the tiny model + PEFT directly: random A and B (non-zero), like a trained one."""
    import torch
    from peft import get_peft_model

    from finetune.modeling import tiny
    from finetune.modeling.models import lora_config

    torch.manual_seed(seed)
    model = tiny.load_model(model_cfg)
    peft_model = get_peft_model(model, lora_config(method))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    out = run_dir / "adapter"
    peft_model.save_pretrained(str(out))
    tiny.load_tokenizer(model_cfg).save_pretrained(str(out))
    write_log_history(run_dir)
    return out
