"""The training stage: load per method, evaluate the base, train, save, evaluate again, write metrics.

    python -m finetune.train RUN_DIR          # one rank (what torchrun runs); reads config.yaml + plan.json

Reads the packed data the data stage wrote (`finetune.data.stage.load_prepared`),
trains with the plan's strategy, saves the adapter (`RUN_DIR/adapter`) or the
model (`RUN_DIR/model`) with the tokenizer, and writes `RUN_DIR/metrics.json`:
`train` {steps, final_loss, tokens_per_second, peak_memory_gb, planned_memory_gb, ...}
and `eval` {base: {loss, exact_match, ...}, trained: {...}} on the held-out split.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional, Union

from finetune import rundir
from finetune.config import Config, HardwareConfig
from finetune.planner import Alternative, Estimate, Memory, Plan, Strategy

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"


def load_plan(run_dir: Path, hardware: HardwareConfig) -> Plan:
    """`plan.json` back into a `Plan` (workers read it; they never re-plan)."""
    from finetune.errors import LaunchError

    path = Path(run_dir) / rundir.PLAN_FILE
    if not path.is_file():
        raise LaunchError(
            f"{path}: missing; run the plan stage (python -m finetune mode=plan run_dir={run_dir}) first"
        )
    d = json.loads(path.read_text())
    est = d["estimate"]
    return Plan(
        fits=d["fits"],
        hardware=hardware,
        params_total=d["params"]["total"],
        params_trainable=d["params"]["trainable"],
        strategy=Strategy(**d["strategy"]),
        gpu_memory=Memory(**{k: v for k, v in d["gpu_memory_gb"].items() if k != "total"}),
        host_memory_gb=d["host_memory_gb"],
        disk_checkpoint_gb=d["disk_gb"]["checkpoint"],
        disk_export_gb=d["disk_gb"]["export"],
        estimate=Estimate(**est),
        seq_len=d["seq_len"],
        reasons=tuple(d.get("reasons", ())),
        suggestions=tuple(d.get("suggestions", ())),
        alternatives=tuple(Alternative(**a) for a in d.get("alternatives", ())),
        usable_gpu_memory_gb=d.get("usable_gpu_memory_gb", 0.0),
        merge_host_memory_gb=d.get("merge_host_memory_gb", 0.0),
    )


def resume_checkpoint(cfg: Config, run_dir: Path) -> Optional[str]:
    """`resume=true`: the last complete checkpoint under RUN_DIR/checkpoints, if any; a path: that one."""
    from transformers.trainer_utils import get_last_checkpoint

    from finetune.errors import ConfigError
    from finetune.train.trainer import CHECKPOINT_DIR

    if isinstance(cfg.resume, str):
        if not Path(cfg.resume).is_dir():
            raise ConfigError(f"resume={cfg.resume}: no such checkpoint folder")
        return cfg.resume
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not cfg.resume or not folder.is_dir():
        return None
    return get_last_checkpoint(str(folder))


def _final_loss(log_history: list[dict]) -> Optional[float]:
    for entry in reversed(log_history):
        if "loss" in entry:
            return float(entry["loss"])
    return None


# Below this many parameters a CPU run uses one thread (see `cpu_threads`).
SMALL_MODEL_PARAMS = 100_000_000


def cpu_threads(total_params: int) -> Optional[int]:
    """One intra-op thread for small models on the CPU, unless OMP_NUM_THREADS says otherwise.

    The tiny model's matmuls are too small to split across cores with profit, and
    on a shared machine a second OpenMP thread spin-waits for a busy core: measured
    on 2 shared cores, a LoRA step of 4 x 256 tokens took 0.16 s on one thread and
    2.5-10 s on two. Returns the thread count set, or None when left alone.
    """
    import torch

    if os.environ.get("OMP_NUM_THREADS") or total_params >= SMALL_MODEL_PARAMS:
        return None
    torch.set_num_threads(1)
    return 1


def _rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e9


def run(
    cfg: Config,
    run_dir: Union[str, Path],
    plan: Plan,
    *,
    datasets: Optional[tuple[Any, Any]] = None,
    max_generate: Optional[int] = 256,
) -> dict:
    """Train per `cfg` and `plan`; save; evaluate base vs trained; write and return metrics.json's content.

    `datasets` (train, eval) replaces the data stage's output (tests); `max_generate`
    caps the held-out prompts answered by generation (None: all).
    """
    import transformers

    from finetune.train import callbacks as cb
    from finetune.train.evaluate import evaluate
    from finetune.train.models import load_for_training, load_tokenizer, trainable_parameters
    from finetune.train.trainer import build_trainer

    run_dir = Path(run_dir)
    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    baseline_gb = _rss_gb()
    if datasets is None:
        from finetune.data.stage import load_prepared

        datasets = load_prepared(run_dir)
    train_ds, eval_ds = datasets

    tokenizer = load_tokenizer(cfg.model)
    transformers.set_seed(cfg.train.seed)  # the adapters' random init is part of the run's seed
    model, compute_dtype = load_for_training(cfg, plan.strategy.activation_checkpointing)
    trainable, total = trainable_parameters(model)
    if cfg.hardware.device == "cpu":
        cpu_threads(total)
    log.info(
        "model: %s %s, %s of %s parameters trainable",
        cfg.method.name,
        cfg.model.name,
        f"{trainable:,}",
        f"{total:,}",
    )

    base = evaluate(model, tokenizer, eval_ds, max_generate=max_generate)

    monitor = cb.RunMonitor(cfg.hardware.device, plan.gpu_memory.total, baseline_gb=baseline_gb)
    early = cb.EarlyStop(cfg.train.loss_spike_factor, cfg.train.eval_rise_patience)
    trainer = build_trainer(
        cfg,
        plan,
        run_dir,
        model,
        tokenizer,
        train_ds,
        eval_ds,
        compute_dtype,
        callbacks=[monitor, early, cb.RichProgress(monitor)],
        monitor=monitor,
    )
    t_train = time.perf_counter()
    resumed_from = resume_checkpoint(cfg, run_dir)
    trainer.train(resume_from_checkpoint=resumed_from)
    train_seconds = time.perf_counter() - t_train

    out_dir = run_dir / (ADAPTER_DIR if cfg.method.uses_adapters else MODEL_DIR)
    trainer.save_model(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))

    trained = evaluate(model, tokenizer, eval_ds, max_generate=max_generate, examples=5)
    state = trainer.state
    metrics = {
        "train": {
            "steps": state.global_step,
            "final_loss": _final_loss(state.log_history),
            "tokens_per_second": round(monitor.tokens_per_second, 2),
            "peak_memory_gb": round(monitor.measured_gb(), 4),
            "planned_memory_gb": round(plan.gpu_memory.total, 4),
            "peak_memory_source": "cuda_max_allocated"
            if cfg.hardware.device == "cuda"
            else "process_peak_rss",
            "memory_over_plan": monitor.warned,
            "tokens": monitor.tokens_seen,
            "train_seconds": round(train_seconds, 2),
            "wall_seconds": round(time.perf_counter() - t0, 2),
            "stopped_early": early.reason,
            "resumed_from": resumed_from,
            "method": cfg.method.name,
            "precision": "bf16" if str(compute_dtype).endswith("bfloat16") else "fp32",
            "trainable_parameters": trainable,
            "total_parameters": total,
            "strategy": asdict(plan.strategy),
            "output_dir": str(out_dir),
        },
        "eval": {"base": base, "trained": trained},
    }
    if trainer.is_world_process_zero():
        path = run_dir / METRICS_FILE
        existing = json.loads(path.read_text()) if path.is_file() else {}
        rundir.write_json(path, {**existing, **metrics})
    return metrics


def run_worker(run_dir: Union[str, Path]) -> dict:
    """One rank: config and plan from the run directory (no command-line parsing here)."""
    from finetune.stages import resolve

    cfg = resolve(rundir.load_config(Path(run_dir)))
    cfg = replace(cfg, run_dir=str(run_dir))
    return run(cfg, Path(run_dir), load_plan(Path(run_dir), cfg.hardware))
