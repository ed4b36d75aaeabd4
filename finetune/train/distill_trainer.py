"""Knowledge distillation: TRL's `GKDTrainer` (generalized knowledge distillation, an `SFTTrainer`) with a
`GKDConfig` built from the typed config and the plan, and the teacher the settings name beside the student.

The conversations arrive tokenized and packed from the data stage (the `conversations` record kind), batched by
the project's `PackedCollator` (position ids restarting at every sample, no attention mask: packed samples never
attend to each other). The student and the teacher each run a forward over the same rows; TRL's
`generalized_jsd_loss` compares their next-token distributions at the assistant tokens (`objective.beta`: 0
forward KL, 1 reverse KL, between them the JSD; `objective.temperature` softens both).

Which answers: with `lmbda=0` and no `seq_kd` the data's own (off-policy), nothing generated in the step. Otherwise
GKDTrainer's own `training_step` samples, for a share `lmbda` of the micro-batches, the student's answers to the
batch's prompts (on-policy), and for the others the teacher's (`seq_kd`) or the data's: `PromptCollator` adds
each conversation's prompt (its tokens up to the first assistant token, left-padded) as TRL's `prompts` and
`prompt_attention_mask`. The generated rows carry an attention mask instead of position ids; their loss is
divided by the labelled tokens the Trainer counted in the data's batch before sampling, as in TRL's GKD.

The teacher is loaded frozen in the run's dtype (finetune/modeling/companions.py) and divided over the ranks
like the student where the engine shards: TRL's `prepare_deepspeed` under DeepSpeed (partitioned under
ZeRO-3); under FSDP2 `base_trainer.shard_frozen` (GKDTrainer's own `accelerator.prepare_model(..., evaluation_mode=True)`
leaves it whole on every rank); unsharded engines keep it whole.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from finetune.core.config import Config
from finetune.modeling import companions
from finetune.modeling.collator import IGNORE_INDEX, NUM_TOKENS_KEY, PackedCollator
from finetune.modeling.dtypes import training_dtype
from finetune.planner import Plan
from finetune.train.base_trainer import RunTrainerMixin, common_kwargs, held_share, shard_frozen
from finetune.train.callbacks import RunMonitor
from finetune.train.sft_trainer import split_row_width

with warnings.catch_warnings():
    # GKD lives in trl.experimental, which warns on import; the API used is the one checked (ARCHITECTURE.md)
    warnings.filterwarnings("ignore", message=r".*trl\.experimental.*")
    from trl.experimental.gkd import GKDConfig, GKDTrainer


def build_config(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> GKDConfig:
    """Every knob of the run in one place: the shared arguments plus the divergence (`objective.*`)."""
    kwargs = common_kwargs(cfg, plan, run_dir, compute_dtype)
    d = cfg.objective
    kwargs.update(
        # Data: pre-tokenized, packed, in the data stage's order.
        dataset_kwargs={"skip_prepare_dataset": True},
        packing=False,
        padding_free=False,
        max_length=None,
        # The loss is the tokens' mean over the whole accumulated batch.
        average_tokens_across_devices=True,
        temperature=d.temperature,
        beta=d.beta,
        lmbda=d.lmbda,
        seq_kd=d.seq_kd,
        max_new_tokens=d.max_completion_length,
        disable_dropout=True,
    )
    return GKDConfig(**kwargs)


class FinetuneGKDTrainer(RunTrainerMixin, GKDTrainer):
    """GKDTrainer on the data stage's packed rows, counting tokens for throughput."""

    def __init__(self, *args: Any, monitor: Optional[RunMonitor] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._init_run(monitor)
        if self.is_fsdp_enabled:
            self.teacher_model = shard_frozen(self.teacher_model, self.accelerator)
        self.teacher_share = held_share(self.teacher_model)
        # Sequences sampled on this rank so far, by whom: the student (on-policy) and the teacher (seq_kd).
        self.generated = {"student": 0, "teacher": 0}

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        # this rank's share of the teacher's parameters, as prepared: 1 whole, 1 / ranks where the engine shards
        logs.setdefault("teacher_share", self.teacher_share)
        if self.lmbda > 0 or self.seq_kd:
            logs.setdefault("generated_by_student", self.generated["student"])
            logs.setdefault("generated_by_teacher", self.generated["teacher"])
        super().log(logs, *args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.lmbda == 0 and not self.seq_kd:
            # GKDTrainer's step draws whether to generate (`random() <= lmbda`, true for a draw of exactly 0.0);
            # with nothing to generate the step is the SFT trainer's.
            return super(GKDTrainer, self).training_step(model, inputs, num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)

    def generate_on_policy_outputs(self, model, inputs, generation_config):
        """TRL's sampling of the batch's prompts, counted by who sampled (the teacher under seq_kd)."""
        by = "teacher" if model is self.accelerator.unwrap_model(self.teacher_model) else "student"
        self.generated[by] += int(inputs["prompts"].shape[0])
        return GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        num_tokens = inputs.pop(NUM_TOKENS_KEY, None)
        if "attention_mask" in inputs:
            # sampled rows (left-padded prompt + completion): their real tokens
            num_tokens = int(inputs["attention_mask"].sum())
            rows = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        else:
            rows = dict(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"])
        if self.model.training and self.monitor is not None and num_tokens is not None:
            self.monitor.add_tokens(int(num_tokens))
        rows["use_cache"] = False
        student = model(**rows)
        self.teacher_model.eval()
        with torch.no_grad():
            teacher = self.teacher_model(**rows)
        # Position i predicts token i + 1; labels are -100 outside the assistant turns (and at a sample's start).
        loss = self.generalized_jsd_loss(
            student_logits=student.logits[:, :-1, :],
            teacher_logits=teacher.logits[:, :-1, :],
            labels=inputs["labels"][:, 1:],
            beta=self.beta,
            temperature=self.temperature,
            num_items_in_batch=num_items_in_batch,
        )
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # As `Trainer.compute_loss`: `num_items_in_batch` counts every rank's tokens and DDP averages gradients.
            loss = loss * self.accelerator.num_processes
        return (loss, student) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with torch.no_grad():
            loss = self.compute_loss(model, dict(inputs))
        return loss.detach(), None, None


Trainer = FinetuneGKDTrainer


def objective_metrics(log_history: list[dict]) -> dict[str, Any]:
    """What metrics.json keeps under `train.distill`: rank 0's share of the teacher as it trained beside it, and
    where the step samples, the sequences rank 0 sampled by the student and by the teacher."""
    last = {key: entry[key] for entry in log_history for key in entry}
    kept = {"teacher_share": last.get("teacher_share")}
    for key in ("generated_by_student", "generated_by_teacher"):
        if key in last:
            kept[key] = int(last[key])
    return kept


@dataclass
class PromptCollator(PackedCollator):
    """The packed batch plus each conversation's prompt for TRL's sampling: `prompts` (left-padded, as `generate`
    extends them) and `prompt_attention_mask`. A conversation's prompt is its tokens up to its first labelled
    (assistant) token: the chat template's prompt with the assistant's header. A packed row gives one prompt for
    each conversation it holds (with `data.packing=false`, one a row)."""

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().__call__(rows)
        prompts = [p for row in rows for p in conversation_prompts(row)]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(p)
            mask[i, width - len(p) :] = 1
        batch.update(prompts=ids, prompt_attention_mask=mask)
        return batch


def conversation_prompts(row: dict[str, Any]) -> list[list[int]]:
    """Each conversation's tokens before its first labelled token, of a row (packed: position ids restart at every
    conversation). A conversation with no labelled token gives none."""
    ids, labels = [int(x) for x in row["input_ids"]], [int(x) for x in row["labels"]]
    positions = row.get("position_ids")
    starts = [i for i, p in enumerate(positions) if int(p) == 0] if positions is not None else [0]
    prompts = []
    for start, end in zip(starts, [*starts[1:], len(ids)]):
        first = next((i for i in range(start + 1, end) if labels[i] != IGNORE_INDEX), None)
        if first is not None:
            prompts.append(ids[start:first])
    return prompts


def load_teacher(cfg: Config) -> Any:
    """The settings' teacher, frozen, in the run's dtype."""
    (teacher,) = companions.resolve_all(cfg)
    return companions.load_frozen(cfg, teacher, training_dtype(cfg))


def trainer_kwargs(cfg: Config, plan: Plan, tokenizer: Any, eval_dataset: Any) -> dict[str, Any]:
    """Distillation's own arguments of the trainer: the teacher, the packed collator, the held-out rows."""
    collator = PromptCollator if cfg.objective.generates else PackedCollator
    return dict(
        teacher_model=load_teacher(cfg),
        data_collator=collator(
            pad_token_id=tokenizer.pad_token_id,
            pad_to_multiple_of=split_row_width(plan),
            flatten=cfg.train.attention == "flash",
        ),
        eval_dataset=eval_dataset,
    )
