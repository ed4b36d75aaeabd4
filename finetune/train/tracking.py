"""The run in the user's experiment trackers (`train.report_to`): MLflow, Weights & Biases, Trackio.

Training metrics go through transformers' own callbacks (`report_to` in the trainer's arguments); this
module only sets up where they go, before the trainer starts, and adds what the run knows afterwards:

- MLflow: rank 0 creates the run (or reuses the one RUN_DIR/tracking.json names, when training resumes)
  and hands its id to transformers' `MLflowCallback` through `MLFLOW_RUN_ID`; after evaluation and export
  the pipeline logs the resolved config and the plan as parameters, the evaluation's scores as metrics and
  plan.json, config.yaml, eval/metrics.json, eval/report.md and export/README.md as artifacts to that same run
  (`log_results`). Where MLFLOW_TRACKING_URI is unset, the store is RUN_DIR/mlflow.db.
- W&B: its run files go to RUN_DIR/wandb (WANDB_DIR); WANDB_MODE=offline needs no network or key.
- Trackio: its defaults (a local store under the Hugging Face cache); TRACKIO_DIR moves it.

Secrets stay out of the run directory: tracking.json holds the tracking URI without its user and password,
and every file is written through `rundir` (scrubbed).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import ConfigError, LaunchError
from finetune.core.nested import flatten
from finetune.rundir.layout import (
    MLFLOW_ARTIFACTS_DIR,
    MLFLOW_DB_FILE,
    MODEL_CARD_FILE,
    TRACKING_FILE,
    WANDB_DIR,
)

log = logging.getLogger(__name__)

# The Python package each tracker needs, and the extra that installs it.
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}
EXTRA = "finetune[tracking]"

# MLflow's limits on one log_batch call.
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
# The run-directory files logged as artifacts, when present.
ARTIFACTS = (
    rundir.PLAN_FILE,
    rundir.CONFIG_FILE,
    f"{rundir.EVAL_DIR}/{rundir.EVAL_METRICS_FILE}",
    f"{rundir.EVAL_DIR}/{rundir.EVAL_REPORT_FILE}",
    f"{rundir.EXPORT_DIR}/{MODEL_CARD_FILE}",
)


def check_installed(cfg: Config) -> None:
    """One line before anything heavy runs when a tracker in train.report_to is not installed."""
    for name in cfg.train.report_to:
        package = PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"train.report_to=[{name}] needs the {package} package: pip install '{EXTRA}' "
                f"(or leave {name} out of train.report_to)"
            )


def without_credentials(uri: str) -> str:
    """`uri` with any user and password of its network location removed (what is written down)."""
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def mlflow_uri(run_dir: Path) -> str:
    """Where MLflow logs: MLFLOW_TRACKING_URI, else an SQLite store in the run directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(run_dir).resolve() / MLFLOW_DB_FILE}"


def read_record(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/tracking.json, or {} before a tracker was set up."""
    path = Path(run_dir) / TRACKING_FILE
    if not path.is_file():
        return {}
    try:
        doc = json.loads(rundir.read_own_text(path))
    except ValueError:
        return {}  # written whole or not at all: a damaged one starts a new run
    return doc if isinstance(doc, dict) else {}


def prepare(cfg: Config, run_dir: Path, main_process: bool) -> None:
    """Before the trainer starts, on each rank: where each tracker in train.report_to writes. The run is
    created (or reused) on the main process only; transformers' callbacks log from it alone."""
    check_installed(cfg)
    run_dir = Path(run_dir)
    trackers = cfg.train.report_to
    if "wandb" in trackers:
        # W&B creates and appends in place, and links its newest run and logs inside its folder (its own
        # links): the folders on the way are checked, not W&B's folder's contents.
        folder = run_dir / WANDB_DIR
        rundir.check_folder(folder.parent, deep=False)
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise LaunchError(f"{folder}: not a folder finetune made (a link or a file); move it away")
        folder.mkdir(exist_ok=True)
        os.environ.setdefault("WANDB_DIR", str(run_dir))
        os.environ.setdefault("WANDB_PROJECT", "finetune")
        os.environ.setdefault("WANDB_NAME", cfg.name)
    if "mlflow" in trackers and main_process:
        run_id = start_mlflow_run(cfg, run_dir)
        os.environ["MLFLOW_RUN_ID"] = run_id


def start_mlflow_run(cfg: Config, run_dir: Path) -> str:
    """The MLflow run of this run directory: the one tracking.json names on the same tracking server, else
    a new one in the experiment MLFLOW_EXPERIMENT_NAME (default: the run's name). Sets the environment
    transformers' MLflowCallback reads, so it logs to this run."""
    from mlflow.tracking import MlflowClient

    uri = mlflow_uri(run_dir)
    client = MlflowClient(tracking_uri=uri)
    known = read_record(run_dir).get("mlflow") or {}
    if known.get("run_id") and known.get("tracking_uri") == without_credentials(uri):
        experiment = client.get_experiment(known["experiment_id"])
        run_id = str(known["run_id"])
    else:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.name
        found = client.get_experiment_by_name(name)
        # The default store in the run directory keeps its artifacts there too (not in the working directory).
        local = "MLFLOW_TRACKING_URI" not in os.environ
        artifacts = (Path(run_dir).resolve() / MLFLOW_ARTIFACTS_DIR).as_uri() if local else None
        experiment_id = found.experiment_id if found else client.create_experiment(name, artifacts)
        experiment = client.get_experiment(experiment_id)
        run = client.create_run(
            experiment_id, run_name=cfg.name, tags={"finetune.run_dir": str(Path(run_dir).resolve())}
        )
        run_id = run.info.run_id
        record = {**read_record(run_dir), "mlflow": {
            "tracking_uri": without_credentials(uri), "experiment_id": experiment.experiment_id,
            "experiment": experiment.name, "run_id": run_id,
        }}  # fmt: skip
        rundir.write_json(Path(run_dir) / TRACKING_FILE, record)
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ["MLFLOW_EXPERIMENT_NAME"] = experiment.name
    return run_id


def flat_params(obj: Any) -> dict[str, str]:
    """Nested dicts as MLflow parameters: `train.seq_len` -> "128" (lists as JSON)."""
    return {k: json.dumps(v) if isinstance(v, (list, tuple)) else str(v) for k, v in flatten(obj).items()}


def run_params(run_dir: Path) -> dict[str, str]:
    """The resolved config (config.yaml) and the plan's total memory, strategy and parameter counts."""
    import yaml

    run_dir = Path(run_dir)
    params: dict[str, str] = {}
    config = run_dir / rundir.CONFIG_FILE
    if config.is_file():
        params.update(flat_params(yaml.safe_load(rundir.read_own_text(config)) or {}))
    plan_file = run_dir / rundir.PLAN_FILE
    if plan_file.is_file():
        plan = json.loads(rundir.read_own_text(plan_file))
        params.update(flat_params({"plan": {
            "fits": plan.get("fits"), "gpu_memory_gb": (plan.get("gpu_memory_gb") or {}).get("total"),
            "strategy": plan.get("strategy") or {}, "params": plan.get("params") or {},
            "hardware": (plan.get("hardware") or {}).get("name"),
        }}))  # fmt: skip
    return params


def eval_metrics(run_dir: Path) -> dict[str, float]:
    """The evaluation's scores, `eval.VARIANT.METRIC` (base, trained, merged), from eval/metrics.json."""
    path = rundir.eval_dir(run_dir) / rundir.EVAL_METRICS_FILE
    if not path.is_file():
        return {}
    doc = json.loads(rundir.read_own_text(path))
    out: dict[str, float] = {}
    for variant, scores in doc.items():
        if not isinstance(scores, dict):
            continue
        for metric, value in scores.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"eval.{variant}.{metric}".replace("/", ".")] = float(value)
    return out


def log_results(cfg: Config, run_dir: Path) -> Optional[str]:
    """After evaluation and export: the run's parameters, scores and files to its MLflow run (the one training
    logged to, or a new one when it did not). Returns the run id; None when mlflow is not in train.report_to."""
    if "mlflow" not in cfg.train.report_to:
        return None
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    run_id = start_mlflow_run(cfg, run_dir)
    client = MlflowClient(tracking_uri=mlflow_uri(run_dir))
    logged = client.get_run(run_id).data.params
    params = run_params(run_dir)
    changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
    if changed:  # MLflow keeps a parameter's first value; what changed since is said, not logged
        log.warning("MLflow run %s keeps its earlier values of %s", run_id, ", ".join(changed[:5]))
    new = [Param(k, v) for k, v in params.items() if k not in logged]
    for i in range(0, len(new), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=new[i : i + _PARAMS_PER_BATCH])
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, 0) for k, v in eval_metrics(run_dir).items()]
    for i in range(0, len(metrics), _METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[i : i + _METRICS_PER_BATCH])
    for name in ARTIFACTS:
        path = Path(run_dir) / name
        if path.is_file():
            folder = str(Path(name).parent) if Path(name).parent != Path(".") else None
            client.log_artifact(run_id, str(path), artifact_path=folder)
    client.set_terminated(run_id)
    return run_id
