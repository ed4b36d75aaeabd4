"""What ORPO's and CPO's trainers share (TRL's `ORPOTrainer` and `CPOTrainer`, in `trl.experimental`): the data
stage's tokenized pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`) handed over in the layout those trainers
batch, and the trainer's own tokenizing skipped.

Both trainers tokenize text pairs in `__init__` (three `Dataset.map` calls, `tokenize_row` the last) and batch
the result with `DPODataCollatorWithPadding`. Here `tokenize_row` passes the prepared row through, the maps run
on an in-memory copy (a map over the run directory's Arrow files would write cache files beside them), and
`PairCollator` builds TRL's `chosen_input_ids` / `chosen_labels` / ... from the token ids when it batches.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from finetune.core.config import Config
from finetune.core.errors import ConfigError
from finetune.data.rows import quiet_datasets
from finetune.planner import Plan
from finetune.train.base_trainer import RunTrainerMixin, common_kwargs
from finetune.train.callbacks import RunMonitor

# trl.experimental warns on import that its APIs may change (TRLExperimentalWarning): the versions this code was
# checked against are ARCHITECTURE.md's, so the notice has nothing to act on; only that category is ignored.
with warnings.catch_warnings():
    from trl.import_utils import TRLExperimentalWarning

    warnings.filterwarnings("ignore", category=TRLExperimentalWarning)
    from trl.experimental.utils import DPODataCollatorWithPadding

# The columns of the `preferences` record kind the trainers read (eval rows carry text columns too).
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def config_kwargs(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> dict[str, Any]:
    """`base_trainer.common_kwargs` less what ORPOConfig and CPOConfig lack: activation offloading (SFTConfig's
    and DPOConfig's), refused in one line when the plan asks for it."""
    kwargs = common_kwargs(cfg, plan, run_dir, compute_dtype)
    if kwargs.pop("activation_offloading", False):
        raise ConfigError(
            f"plan.json: strategy.activation_offloading=true, which TRL's {cfg.objective.spec.trl_trainer} does "
            f"not run; set train.activation_offloading=false for objective={cfg.objective.name}"
        )
    return kwargs


class PairCollator:
    """The data stage's pairs in TRL's legacy pair layout: each side's prompt + answer ids, its attention mask
    and its labels (-100 over the prompt), padded by `DPODataCollatorWithPadding`. The trainers put the chosen
    and the rejected rows through the model as one batch (twice the sequences of SFT)."""

    def __init__(self, pad_token_id: int):
        self.pad = DPODataCollatorWithPadding(pad_token_id=pad_token_id)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return self.pad([legacy_row(f) for f in features])


def legacy_row(row: dict[str, Any]) -> dict[str, list[int]]:
    """One pair as TRL's `tokenize_row` would have made it from text."""
    prompt = list(row["prompt_ids"])
    out = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for side in ("chosen", "rejected"):
        answer = list(row[f"{side}_ids"])
        ids = prompt + answer
        out[f"{side}_input_ids"] = ids
        out[f"{side}_attention_mask"] = [1] * len(ids)
        out[f"{side}_labels"] = [-100] * len(prompt) + answer
    return out


def in_memory(dataset: Any) -> Any:
    """The prepared pairs' columns as an in-memory `Dataset` (None stays None)."""
    if dataset is None:
        return None
    with quiet_datasets():
        return dataset.select_columns(list(PAIR_COLUMNS)).map(keep_in_memory=True)


class ReferenceFreeTrainer(RunTrainerMixin):
    """Mixed in before TRL's ORPOTrainer or CPOTrainer (`class X(ReferenceFreeTrainer, ORPOTrainer)`)."""

    model: Any
    monitor: Optional[RunMonitor]

    def __init__(self, *args: Any, monitor: Optional[RunMonitor] = None, **kwargs: Any):
        kwargs["train_dataset"] = in_memory(kwargs.get("train_dataset"))
        kwargs["eval_dataset"] = in_memory(kwargs.get("eval_dataset"))
        with quiet_datasets():
            super().__init__(*args, **kwargs)
        self._init_run(monitor)
        # PairCollator's batches are DPODataCollatorWithPadding's (TRL warns at every evaluation step otherwise).
        self.use_dpo_data_collator = True

    def tokenize_row(self, feature: dict[str, Any], model: Any = None) -> dict[str, Any]:
        """Tokenized by the data stage (rendered, cleaned, limited): `PairCollator` lays it out."""
        return feature

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and self.monitor is not None:
            tokens = inputs["chosen_attention_mask"].sum() + inputs["rejected_attention_mask"].sum()
            self.monitor.add_tokens(int(tokens))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def summary(log_history: list[dict], keys: dict[str, str]) -> dict[str, Any]:
    """First, last and mean over the logged training steps of each of TRL's `keys` ({name: logged key})."""
    logged = [h for h in log_history if "loss" in h]
    out: dict[str, Any] = {"logged_steps": len(logged)}
    for name, key in keys.items():
        values = [float(h[key]) for h in logged if key in h]
        if values:
            out[name] = {"first": values[0], "last": values[-1], "mean": sum(values) / len(values)}
    return out
