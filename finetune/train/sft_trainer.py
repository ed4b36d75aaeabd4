"""Supervised fine-tuning: TRL's `SFTTrainer` with an `SFTConfig` built from the typed config and the plan.

The data arrive pre-tokenized and packed from the data stage (the `conversations` record kind), so TRL's own
preparation is skipped and `PackedCollator` batches them. What every objective shares (arguments, engine,
FSDP2 on CPU ranks, atomic checkpoints) is `base_trainer`'s.

With `strategy.chunked_loss`, `compute_loss` asks the model for the project's
chunked loss, computed inside its forward (`add_chunked_loss_head`: no logits,
the head gathered under ZeRO-3/FSDP2), honouring `num_items_in_batch` so
gradient accumulation weighs every token the same as one large batch. Without
it, TRL's own loss runs (`SFTTrainer.compute_loss`: a fused LM head that never
builds the full logits either).

Under a Ulysses sequence split (accelerate's `sp_size`), deepspeed's loader hands each rank a contiguous
shard of every sequence with its labels pre-shifted (`shift_labels`). The chunked loss then sums its shard's
token losses over the whole accumulated batch's token count (every rank's shards: `_get_num_items_in_batch`),
so the shards' losses add up to the whole sequences' and gradient accumulation weighs every token alike, as
without the split. TRL's loss goes through transformers' `deepspeed_sp_compute_loss` (each micro-batch's
mean, token-weighted over the split's ranks).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from trl import SFTConfig, SFTTrainer

from finetune.core.config import Config
from finetune.modeling.chunked_loss import add_chunked_loss_head
from finetune.modeling.collator import IGNORE_INDEX, NUM_TOKENS_KEY, PackedCollator
from finetune.modeling.vision import VisionCollator
from finetune.planner import Plan
from finetune.train import throughput
from finetune.train.base_trainer import RunTrainerMixin, common_kwargs, sequence_degree
from finetune.train.callbacks import RunMonitor


def build_config(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> SFTConfig:
    """Every knob of the run in one place: the shared arguments plus SFT's data and loss settings."""
    kwargs = common_kwargs(cfg, plan, run_dir, compute_dtype)
    kwargs.update(
        # Data: pre-tokenized, packed, in the data stage's order (longest sample first).
        dataset_kwargs={"skip_prepare_dataset": True},
        packing=False,
        padding_free=False,
        max_length=None,
        # The loss is the tokens' mean over the whole accumulated batch.
        average_tokens_across_devices=True,
    )
    kwargs.update(throughput.sft_kwargs(cfg))  # Liger's kernels through TRL's switch
    return SFTConfig(**kwargs)


class FinetuneTrainer(RunTrainerMixin, SFTTrainer):
    """SFTTrainer plus token counting for throughput and, when planned, the exact chunked loss."""

    def __init__(
        self,
        *args: Any,
        chunked_loss: bool = False,
        loss_chunk_size: int = 1024,
        monitor: Optional[RunMonitor] = None,
        **kwargs: Any,
    ):
        # the checked TRL deprecates use_liger_kernel for Hub kernels: see sft_kwargs
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"`use_liger_kernel=True` is deprecated", category=FutureWarning
            )
            super().__init__(*args, **kwargs)
        self.chunked_loss = chunked_loss
        self._init_run(monitor)
        # After TRL's fused LM head (SFTTrainer.__init__): ours wraps it, and runs only when asked.
        add_chunked_loss_head(self.model, loss_chunk_size, use_liger=self.args.use_liger_kernel)
        self.split_degree = sequence_degree(self.accelerator)
        if chunked_loss and self.split_degree > 1:
            # transformers turns loss kwargs off under the split and would divide by the accumulation steps;
            # the chunked loss is already over the whole accumulated batch (`_get_num_items_in_batch`). TRL's
            # base trainer declares the switch as a bare None.
            self.loss_is_scaled_for_ga = True  # type: ignore[assignment]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs["use_cache"] = False  # a cache would also turn off the packed (block-diagonal) attention mask
        # the Trainer's Liger hint for evaluation: both loss paths make no logits
        inputs.pop("skip_logits", None)
        num_tokens = inputs.pop(NUM_TOKENS_KEY, None)
        split = self.split_degree > 1 and self.model.training
        if self.model.training and self.monitor is not None and num_tokens is not None:
            # under a split every shard carries its whole micro-batch's count: this rank's share
            self.monitor.add_tokens(int(num_tokens) // (self.split_degree if split else 1))
        if split:
            self.split_tokens += inputs["input_ids"].numel()
            self.split_widths.add(int(inputs["input_ids"].shape[1]))
        if not self.chunked_loss:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # Through the wrapped model (DDP, DeepSpeed, FSDP2, accelerate's autocast): the loss is computed
        # inside the model's forward, where every engine has the head whole.
        outputs = model(**inputs, chunked_loss=True, num_items_in_batch=num_items_in_batch)
        loss = outputs.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # As `Trainer.compute_loss`: `num_items_in_batch` counts every rank's tokens and DDP averages gradients.
            # Under a split too: ZeRO-3's reduce-scatter averages over every rank, the split's included (its
            # default path; measured: without this factor the gradient norm was half one rank's), and the
            # logged mean of the ranks' values is the whole batch's loss.
            loss = loss * self.accelerator.num_processes
        if self.aux_loss_enabled:
            # TRL's MoE load-balancing term (SFTTrainer.compute_loss): a per-micro-batch mean, weighted by the
            # model's router_aux_loss_coef, averaged over the accumulation steps, logged as `aux_loss`
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps
            mode = "train" if self.model.training else "eval"
            aux = self.accelerator.gather_for_metrics(outputs.aux_loss.detach()).mean().item()
            self._metrics[mode]["aux_loss"].append(aux)
        return (loss, outputs) if return_outputs else loss

    def _get_num_items_in_batch(self, batch_samples, device):
        """The labelled tokens of the whole accumulated batch. Under a split the loader replaced `labels` by each
        shard's `shift_labels`, for which transformers counts nothing; each token lies in one rank's shard, so
        the sum over all ranks counts each once (transformers' count divides by the split instead)."""
        if not (
            self.chunked_loss
            and self.split_degree > 1
            and batch_samples
            and "shift_labels" in batch_samples[0]
        ):
            return super()._get_num_items_in_batch(batch_samples, device)
        local = sum(int((b["shift_labels"] != IGNORE_INDEX).sum()) for b in batch_samples)
        return self.accelerator.gather(torch.tensor([local], device=device)).sum()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs.pop(NUM_TOKENS_KEY, None)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)


def split_row_width(plan: Plan) -> int:
    """What a row's width must be a multiple of: 1 without a split. Under one, train.seq_len rounded up to a
    multiple of the degree, so a row (at most seq_len tokens) is cut into equal shards and every rank's row has
    the same width: deepspeed's loader all-gathers the ranks' rows, and gloo refuses rows of different widths
    (measured: "ProcessGroupGloo::allgather: invalid tensor size"). Packed rows are about that long anyway."""
    degree = plan.strategy.sequence_parallel
    return 1 if degree == 1 else -(-plan.seq_len // degree) * degree


Trainer = FinetuneTrainer


def trainer_kwargs(cfg: Config, plan: Plan, tokenizer: Any, eval_dataset: Any) -> dict[str, Any]:
    """SFT's own arguments of the trainer: the packed collator, the held-out rows, the chunked loss. A model
    that takes images: one conversation a row through its processor (`tokenizer` is the processor), TRL's loss."""
    if cfg.model.takes_images:
        return dict(data_collator=VisionCollator(tokenizer), eval_dataset=eval_dataset, chunked_loss=False)
    return dict(
        # flash-attn's variable-length kernel takes one row only (train/throughput.py)
        data_collator=PackedCollator(
            pad_token_id=tokenizer.pad_token_id,
            pad_to_multiple_of=split_row_width(plan),
            flatten=cfg.train.attention == "flash",
        ),
        eval_dataset=eval_dataset,
        chunked_loss=plan.strategy.chunked_loss,
        loss_chunk_size=cfg.train.loss_chunk_size,
    )
