"""Typed configuration: one dataclass per concern (the schemas; pure, stdlib only).

Each section has its module here (model, method, hardware, data, train, plan, launch, eval,
export, objective); this one holds the root `Config`, the checks that span sections, and re-exports the
sections. The YAML files under `configs/` extend these schemas; finetune/core/composition.py
registers them in Hydra's ConfigStore and composes configs/, recipes/ and the command line once
(`OmegaConf.to_object`): everything downstream gets these objects, never a dict. Cross-field
checks live in `__post_init__` and raise `ConfigError` with the key's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from finetune.core.config.chat import ChatConfig
from finetune.core.config.checks import DATA_KEY, check_all_finite, check_choices, choice
from finetune.core.config.data import DataConfig
from finetune.core.config.dpo import DPOObjective
from finetune.core.config.evaluation import EvalConfig
from finetune.core.config.export import ExportConfig
from finetune.core.config.grpo import GRPOObjective
from finetune.core.config.hardware import HardwareConfig
from finetune.core.config.launch import LaunchConfig
from finetune.core.config.method import OPTIMIZERS, MethodConfig
from finetune.core.config.model import ModelConfig
from finetune.core.config.objective import ObjectiveConfig, SFTObjective, objective_settings
from finetune.core.config.plan import PlanConfig, SmokeConfig
from finetune.core.config.train import ATTENTIONS, SHARDINGS, TrainConfig
from finetune.core.config.ui import UiConfig
from finetune.core.errors import ConfigError

__all__ = [
    "ATTENTIONS",
    "MODES",
    "OPTIMIZERS",
    "RUNS_DIR",
    "SHARDINGS",
    "Config",
    "ChatConfig",
    "DataConfig",
    "EvalConfig",
    "ExportConfig",
    "HardwareConfig",
    "LaunchConfig",
    "MethodConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "SFTObjective",
    "DPOObjective",
    "GRPOObjective",
    "PlanConfig",
    "SmokeConfig",
    "TrainConfig",
    "UiConfig",
]

MODES = ("all", "plan", "data", "train", "eval", "export", "launch", "compare", "ui", "chat")
# The stages a finished run does again when asked (`redo=`); each later stage follows from what changed.
REDO_STAGES = ("train", "eval", "export")
# Where runs go by default: runs/<name> (mode=compare looks names up here too).
RUNS_DIR = "runs"

# A run's name names its folder (runs/<name>), the SLURM job and the tmux session: a plain name only.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


@dataclass
class Config:
    """The root: one object per concern, plus the stage to run and where."""

    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig, metadata=DATA_KEY)  # every field, unless marked
    train: TrainConfig = field(default_factory=TrainConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    ui: UiConfig = field(default_factory=UiConfig)
    # mode=chat: which of the run's models to talk to (finetune/evaluation/chat.py).
    chat: ChatConfig = field(default_factory=ChatConfig)
    # What the model is trained to do, with that objective's settings: an ObjectiveConfig subclass chosen by
    # `objective=NAME` (untyped here so each objective's own dataclass is the schema; None: SFT).
    objective: Any = None
    # Start from an earlier run's output (RUN_DIR: its adapter or model folder) instead of the base: SFT, then DPO.
    init_from: Optional[str] = None
    # The recipe's name; names the default run directory.
    name: str = "tiny"
    mode: str = choice("all", MODES)
    run_dir: Optional[str] = None  # default: runs/<name>
    # resume: true (last complete checkpoint), false (start fresh) or a checkpoint path.
    resume: Union[bool, str] = True
    # A finished stage is not run again: redo=train (starts over), eval or export runs that one again.
    redo: Optional[str] = choice(None, REDO_STAGES)
    # Show the libraries' own progress bars and repeated notices (quiet by default).
    verbose: bool = False
    # mode=compare: run directories (or names under runs/) to put side by side.
    runs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.objective: ObjectiveConfig = objective_settings(self.objective)
        check_all_finite(self, "")
        check_choices(self, "")
        if not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"name={self.name!r}: use letters, digits and . _ + - (at most 128, no '/' or '..'); "
                "it names the run directory runs/<name>"
            )
        if self.run_dir is not None and (
            not self.run_dir.strip() or re.search(r"[\x00-\x1f\x7f]", self.run_dir)
        ):
            raise ConfigError(
                f"run_dir={self.run_dir!r}: empty or holds control characters (a newline would end a line of "
                "launch.sh or slurm.sbatch)"
            )
        if self.init_from is not None and not Path(self.init_from).is_dir():
            raise ConfigError(
                f"init_from={self.init_from}: no such run directory (init_from starts from an earlier run's "
                "adapter/, model/ or export/merged/)"
            )
        if self.mode == "compare" and len(self.runs) < 1:
            raise ConfigError("mode=compare needs runs=[RUN_DIR,...]: the runs to put side by side")
        spec = self.objective.spec
        _ = self.record_kind  # an objective without image records on a vision-language model: one line
        if spec.sequences_setting is not None:
            # GRPO: a step's sequences are completions, in whole groups of num_generations
            per_example = getattr(self.objective, spec.sequences_setting)
            if self.train.batch_size % per_example:
                raise ConfigError(
                    f"train.batch_size={self.train.batch_size} must be a multiple of "
                    f"objective.{spec.sequences_setting}={per_example} (objective={spec.name} counts a "
                    "step's sequences in whole groups)"
                )
        least = spec.min_micro_batch
        for key, value in (
            ("micro_batch_size", self.train.micro_batch_size),
            ("batch_size", self.train.batch_size),
        ):
            if value is not None and value < least:
                raise ConfigError(
                    f"train.{key}={value}: objective={spec.name} needs at least {least} {spec.batch_unit} a "
                    "micro-batch"
                )
        self.objective.check_device(self.hardware.device)
        if self.method.optimizer == "paged_adamw_8bit" and self.hardware.device == "cpu":
            raise ConfigError(
                "method.optimizer=paged_adamw_8bit needs CUDA (paged memory); use adamw on hardware=cpu"
            )
        if self.hardware.device == "cpu":
            if self.train.attention in ("flex", "flash"):
                why = {
                    "flex": "FlexAttention has no backward on the CPU",
                    "flash": "flash-attn's kernels are CUDA kernels",
                }[self.train.attention]
                raise ConfigError(
                    f"train.attention={self.train.attention} needs CUDA ({why}); use sdpa or eager on hardware=cpu"
                )
            if self.train.liger:
                raise ConfigError(
                    "train.liger=true needs CUDA (Liger's kernels are Triton GPU kernels); leave it off on hardware=cpu"
                )

    @property
    def record_kind(self) -> str:
        """What the data stage prepares: the objective's record kind, or its image counterpart where the model
        takes images (finetune/core/objectives.py)."""
        return self.objective.spec.record_kind_for(self.model.takes_images)

    def record_module(self) -> Any:
        """The data module that prepares and saves this run's records (`record_kind`)."""
        return self.objective.spec.record_module(self.model.takes_images)

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir if self.run_dir else Path(RUNS_DIR) / self.name)
