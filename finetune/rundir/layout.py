"""The run directory's layout: every file and folder name a stage writes, once (README "runs/tiny/").

Every module names these files and folders through the constants and helpers here, never by a string
of its own.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_FILE = "config.yaml"  # the resolved config every stage and rank reads
# What the run's checkpoints were trained under (rundir/state.py): the resume check compares with it.
RESUME_FILE = "resume.json"
IDENTITY_FILE = "identity.json"  # inside adapter/ or model/: what the folder is (modeling/outputs.py)
VLLM_SERVER_LOG = (
    "vllm_server.log"  # GRPO: the output of the `trl vllm-serve` launch.sh starts beside the trainer
)
ROLLOUT_FILE = "rollout.json"  # GRPO: where generation runs and what it holds (planner/rollout.py)
PLAN_FILE = "plan.json"  # the plan (planner/MEMORY_MODEL.md, "The plan contract"), written by the plan stage
DATA_DIR = "data"  # the data stage's prepared rows: data/train (packed), data/eval (one sample a row)
DATA_TRAIN_DIR = "train"
DATA_EVAL_DIR = "eval"
DATA_STATS_FILE = "data_stats.json"
DATA_HISTOGRAM_FILE = "data_tokens.png"
METRICS_FILE = "metrics.json"  # training's metrics (`train`) and the eval stage's scores (`eval`)
ADAPTER_DIR = "adapter"  # the trained adapter (LoRA, QLoRA) with the tokenizer
MODEL_DIR = "model"  # the trained model (full fine-tuning) with the tokenizer
CHECKPOINT_DIR = "checkpoints"  # resumable checkpoints (finetune.rundir.checkpoints)
TENSORBOARD_DIR = "tensorboard"
TRACKING_FILE = "tracking.json"  # train.report_to: the MLflow run the training and evaluation log to
MLFLOW_DB_FILE = "mlflow.db"  # MLflow's store when MLFLOW_TRACKING_URI is unset, with its artifacts:
MLFLOW_ARTIFACTS_DIR = "mlartifacts"
WANDB_DIR = "wandb"  # W&B's run files (offline runs under WANDB_MODE=offline)
TRAIN_LOG_FILE = "train_log.jsonl"  # logged dicts a line, read by the loss curves when present
PROFILE_FILE = "profile_ops.txt"  # train.profile: one step's operators
EVAL_DIR = "eval"  # the evaluation stage: eval/metrics.json, samples.jsonl, report.md, loss_curves.png
EVAL_METRICS_FILE = "metrics.json"
EVAL_SAMPLES_FILE = "samples.jsonl"
EVAL_REPORT_FILE = "report.md"
EVAL_CURVES_FILE = "loss_curves.png"
EXPORT_DIR = "export"  # the export stage: export/merged, export/adapter, merge_check.json, serve.sh
MERGED_DIR = "merged"
EXPORT_ADAPTER_DIR = "adapter"
MERGE_CHECK_FILE = "merge_check.json"
SERVE_FILE = "serve.sh"
EXPORT_SUMMARY_FILE = "export.json"
EXPORT_GGUF_DIR = "gguf"  # export.gguf: MODEL.gguf and its Ollama Modelfile
MODELFILE = "Modelfile"
MODEL_CARD_FILE = "README.md"  # the Hub model card of export/
LAUNCH_SCRIPT = "launch.sh"  # mode=launch: the command that starts the ranks
LAUNCH_LOG = "launch.log"  # launch.detach=true: the detached run's output
LAUNCH_PID_FILE = "launch.pid"  # launch.detach=true under nohup
SBATCH_FILE = "slurm.sbatch"
DEEPSPEED_FILE = "deepspeed.json"  # the engine settings the launcher writes for the ranks
ACCELERATE_FSDP_FILE = "accelerate_fsdp.yaml"
ACCELERATE_FILE = "accelerate.yaml"  # launcher=accelerate with a DDP or ZeRO-3 plan
ENGINE_FILE = "engine.json"  # the engine, world size, files and SFTConfig arguments: what each rank reads
SMOKE_DIR = "smoke"  # smoke=true: the sibling's run directory, inside the real one
SMOKE_REPORT_FILE = "smoke_report.json"
COMPARE_DIR = "compare"  # mode=compare without run_dir: runs/compare
COMPARE_JSON_FILE = "compare.json"
COMPARE_MD_FILE = "compare.md"
LOCK_FILE = ".lock"
# Written into every folder finetune creates as a run directory (and into RUN_DIR/data): what holds it is ours
# to replace; a folder without it is the user's and is never written over or deleted.
OWNER_FILE = ".finetune-run"


def trained_dir(run_dir: Path, uses_adapters: bool) -> Path:
    """Where training saves its output: RUN_DIR/adapter (LoRA, QLoRA) or RUN_DIR/model (full fine-tuning)."""
    return Path(run_dir) / (ADAPTER_DIR if uses_adapters else MODEL_DIR)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def eval_dir(run_dir: Path) -> Path:
    return Path(run_dir) / EVAL_DIR


def export_dir(run_dir: Path) -> Path:
    return Path(run_dir) / EXPORT_DIR


def merged_dir(run_dir: Path) -> Path:
    """The merged model export writes: RUN_DIR/export/merged."""
    return export_dir(run_dir) / MERGED_DIR


# The lock's descriptors a launched child inherits (finetune/rundir/lock.py).
LOCK_FDS_ENV = "FINETUNE_LOCK_FDS"
