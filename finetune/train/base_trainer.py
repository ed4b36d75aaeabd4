"""What every objective's trainer shares (TRL pairs each trainer with its config over a shared base):
the arguments built from the typed config and the plan, the engine's arguments, FSDP2 on CPU ranks, atomic
checkpoints, the record of what really ran, and saving the trained output.

The plan decides micro-batch size, gradient accumulation, activation checkpointing (non-reentrant) and the
optimizer; the config gives learning rate, schedule, warm-up, intervals, logging and seed. Each objective's
trainer module (`ObjectiveSpec.trainer`: sft_trainer.py, dpo_trainer.py, grpo_trainer.py) gives its TRL
config (`build_config`: these arguments plus its own), its trainer class (`Trainer`, built as
`class X(RunTrainerMixin, TRLTrainer)`) and that trainer's own arguments (`trainer_kwargs`: collator,
rewards); `build_trainer` here puts them together the same way for every objective.

Checkpoints are atomic (`_save_checkpoint`, see `finetune.rundir.checkpoints`): staged,
checksummed, renamed into place; a crash mid-save leaves the previous one intact.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from transformers.trainer_utils import IntervalStrategy

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import LaunchError
from finetune.modeling.loading import ATTN_IMPLEMENTATIONS
from finetune.planner import Plan
from finetune.rundir import checkpoints
from finetune.train import quantized, throughput, tracking
from finetune.train.callbacks import RunMonitor, past_the_schedule

log = logging.getLogger(__name__)


# The plan's optimizer names -> transformers' `optim` names.
_OPTIMIZERS = {"adamw": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit", "paged_adamw_8bit": "paged_adamw_8bit"}


def optimizer_name(optimizer: str, device: str, fused: Optional[bool] = None) -> str:
    """transformers' `optim`; `fused` is `train.fused_optimizer` (None: the fused AdamW step on CUDA only)."""
    if optimizer == "adamw" and (device == "cuda" if fused is None else fused):
        return "adamw_torch_fused"
    return _OPTIMIZERS[optimizer]


def common_kwargs(cfg: Config, plan: Plan, run_dir: Path, compute_dtype: torch.dtype) -> dict[str, Any]:
    """The TrainingArguments fields every objective's config takes: the plan's batch shape and optimizer,
    the precision, the optimisation, intervals and logging, and the engine the launcher wrote for the plan."""
    s, t = plan.strategy, cfg.train
    by_steps = t.max_steps > 0
    # TensorBoard is added as a callback (its folder): `run_callbacks`
    report_to = [r for r in t.report_to if r != "tensorboard"]
    kwargs: dict[str, Any] = dict(
        output_dir=str(rundir.checkpoint_dir(run_dir)),
        # Batch shape (the plan's).
        per_device_train_batch_size=s.micro_batch_size,
        per_device_eval_batch_size=s.micro_batch_size,
        gradient_accumulation_steps=s.grad_accum_steps,
        activation_checkpointing=s.activation_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if s.activation_checkpointing else None,
        optim=optimizer_name(s.optimizer, cfg.hardware.device, t.fused_optimizer),
        # Precision: bf16 autocast where native; fp32 otherwise.
        bf16=compute_dtype == torch.bfloat16,
        fp16=False,
        use_cpu=cfg.hardware.device == "cpu",
        # Optimisation.
        learning_rate=cfg.method.learning_rate,
        weight_decay=cfg.method.weight_decay,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_ratio,  # a value below 1 is a fraction of the total steps
        max_grad_norm=t.max_grad_norm,
        max_steps=t.max_steps if by_steps else -1,
        num_train_epochs=t.epochs,
        seed=t.seed,
        data_seed=t.seed,
        # Intervals and logging.
        logging_steps=t.logging_steps,
        logging_first_step=True,
        eval_strategy="steps",
        eval_steps=t.eval_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        report_to=report_to or "none",
        disable_tqdm=True,
        # Data: pre-tokenized by the data stage, in its order.
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        # Every trainable parameter takes part in each forward; the search for unused ones is pure cost.
        ddp_find_unused_parameters=False,
    )
    # The engine (DeepSpeed JSON or FSDP2 settings, use_cpu, collective timeout), as the launcher wrote it
    # for the plan's layout: DeepSpeed asserts its batch = micro x accumulation x world size.
    kwargs.update(engine_trainer_kwargs(run_dir))
    split = s.split
    if "parallelism_config" in kwargs and split is not None and not split.trains:
        # The ring has no CPU kernel here, so its training path (the Trainer's context-parallel buffers, the
        # loss over them) was never run: planned and launched only.
        raise LaunchError(
            f"plan.json: strategy.sequence_split={s.sequence_split} ({split.label}) over {s.sequence_parallel} "
            "ranks is planned and its engine files written, but training with it is not built "
            "(train.sequence_split=ulysses trains with a split)"
        )
    return kwargs


def engine_trainer_kwargs(run_dir: Path) -> dict[str, Any]:
    """The SFTConfig arguments of the engine the launcher set up (RUN_DIR/engine.json), for the world size
    it was written for; a process group of another size is refused (one line) before anything loads."""
    engine = rundir.load_engine(run_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != engine["world_size"]:
        raise LaunchError(
            f"{Path(run_dir) / rundir.ENGINE_FILE}: the engine ({engine['engine']}) is set up for "
            f"{engine['world_size']} process(es), this rank's group has {world} (WORLD_SIZE): start the ranks "
            f"with {rundir.command_line('bash', Path(run_dir) / rundir.LAUNCH_SCRIPT)} (written by mode=launch), or plan for {world} "
            "(launch.nproc_per_node, launch.nnodes) and launch again"
        )
    kwargs = dict(engine["trainer_kwargs"])
    split = engine.get("parallelism")
    if split:
        kwargs["parallelism_config"] = parallelism_config(split)
    if kwargs.get("deepspeed") and os.environ.pop("ACCELERATE_USE_CPU", None) is not None:
        # accelerate would quietly replace DeepSpeed by DDP; use_cpu=True already selects gloo on the CPU.
        log.warning("ACCELERATE_USE_CPU unset for this DeepSpeed run (accelerate drops DeepSpeed under it)")
    return kwargs


def parallelism_config(split: dict[str, Any]) -> ParallelismConfig:
    """accelerate's ParallelismConfig from engine.json's `parallelism` (finetune/launch/engines.py): the size
    and backend, and for Ulysses the handler naming the attention it wraps."""
    kwargs = dict(split["kwargs"])
    if kwargs.get("sp_size", 1) > 1:
        kwargs["sp_handler"] = DeepSpeedSequenceParallelConfig(
            sp_seq_length=split.get("seq_len"),
            sp_seq_length_is_variable=True,
            sp_attn_implementation=ATTN_IMPLEMENTATIONS[split["attention"]],
        )
    return ParallelismConfig(**kwargs)


def sequence_degree(accelerator: Any) -> int:
    """Ranks each sequence is split over by accelerate's Ulysses (`sp_size`; deepspeed's loader hands each rank a
    contiguous shard of every sequence, its labels pre-shifted); 1 without a split."""
    pc = getattr(accelerator, "parallelism_config", None)
    return int(pc.sp_size) if pc is not None and pc.sp_enabled else 1


class RunTrainerMixin:
    """What every objective's trainer shares, mixed in before TRL's trainer class (`class X(RunTrainerMixin,
    SFTTrainer)`): FSDP2 on CPU ranks, atomic checkpoints, and the run's state the stage reads back."""

    accelerator: Any
    args: Any
    state: Any
    model: Any
    is_fsdp_enabled: bool
    _get_output_dir: Any

    def _init_run(self, monitor: Optional[RunMonitor]) -> None:
        self.monitor = monitor
        self.last_checkpoint: Optional[Path] = None
        self.loaded_partitioned = False  # set by the stage: the model came from zero.Init
        # Under a sequence split: the tokens this rank ran its training forwards on, and its shards' widths.
        self.split_tokens = 0
        self.split_widths: set[int] = set()

    def create_accelerator_and_postprocess(self) -> None:
        """FSDP2 on CPU ranks too: accelerate enables its FSDP plugin only for accelerator devices and
        silently runs DDP over gloo instead, so a planned FSDP run on CPU processes (the tests' stand-in
        for GPUs) would prove nothing. The plugin is installed as accelerate would on GPUs."""
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        from accelerate import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if self.args.fsdp_plugin_args is None or state.distributed_type != DistributedType.MULTI_CPU:
            return
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        if type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy":
            from torch.distributed.fsdp import CPUOffloadPolicy

            plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)  # pinned memory needs an accelerator
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.distributed_type = DistributedType.FSDP
        # as accelerate does for FSDP on GPUs: an AcceleratorState() built later (accelerate's helpers build them)
        # copies PartialState's fields over its own, which would turn this run back into DDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        state.fsdp_plugin = plugin
        self.is_fsdp_enabled = True
        log.info("FSDP2 on %d CPU ranks (gloo)", state.num_processes)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """No batch for a step past the schedule (`past_the_schedule`): the loop then ends untrained."""
        if past_the_schedule(self):
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]

    def _save_checkpoint(self, model, trial):
        """Atomic: the trainer writes into checkpoints/.staging/checkpoint-N, rank 0 seals and renames it.

        Every rank writes its share (optimizer shards under FSDP/ZeRO) into the staging
        folder; after a barrier, rank 0 records sizes and checksums (`finetune.rundir.checkpoints`),
        renames the folder into place and keeps the newest `save_total_limit` complete ones.
        """
        folder = Path(self._get_output_dir(trial))
        name = f"checkpoint-{self.state.global_step}"
        staging_root = folder / checkpoints.STAGING_DIR
        if self.args.should_save:
            # Made empty here, so nothing the trainer writes into it can follow a link planted there.
            rundir.make_fresh_folder(staging_root / name)
        self.accelerator.wait_for_everyone()
        output_dir, limit = self.args.output_dir, self.args.save_total_limit
        self.args.output_dir, self.args.save_total_limit = str(staging_root), None  # rotation is ours
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.output_dir, self.args.save_total_limit = output_dir, limit
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            final = checkpoints.finalize(staging_root / name, folder / name)
            # What else the trainer wrote there (a model card).
            shutil.rmtree(staging_root, ignore_errors=True)
            checkpoints.rotate(folder, limit or 1, protect=final)
            self.last_checkpoint = final
        self.accelerator.wait_for_everyone()


def optimizer_kind(optimizer: Any) -> str:
    """The optimizer that really updates the weights, in the plan's words: adamw, adamw_8bit,
    paged_adamw_8bit, or cpu_adamw (DeepSpeed's fp32 Adam on the host, under optimizer offload)."""
    cls = type(optimizer)
    if cls.__module__.startswith("bitsandbytes"):
        bits = getattr(getattr(optimizer, "args", None), "optim_bits", 32)
        paged = "paged_" if getattr(optimizer, "is_paged", False) else ""
        return f"{paged}adamw_8bit" if bits == 8 else f"{paged}adamw_32bit_bnb"
    if cls.__name__ == "DeepSpeedCPUAdam":
        return "cpu_adamw"
    if cls.__name__ == "AdamW" and cls.__module__.startswith("torch"):
        return "adamw"
    return f"{cls.__module__}.{cls.__name__}"


def _checkpointing_on(trainer: Any) -> bool:
    """Activation checkpointing really on: the model's own (transformers) or FSDP's (accelerate's plugin)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return bool(getattr(base, "is_activation_checkpointing", False)) or bool(
        plugin is not None and plugin.activation_checkpointing
    )


def _offload_device(block: Any) -> Optional[str]:
    device = getattr(block, "device", None)
    return None if device is None else str(getattr(device, "value", device))


def engine_record(trainer: Any) -> dict[str, Any]:
    """What really ran, after `train()`: world size, backend, the wrapper around the model, ZeRO stage, offload.

    Every rank must call it (it gathers each rank's pid and share of the parameters);
    metrics.json keeps it as `train.engine`, the proof that the planned engine ran.
    """
    import torch.distributed as dist
    from accelerate.utils import gather_object

    wrapped = trainer.model_wrapped
    record: dict[str, Any] = {
        "world_size": trainer.accelerator.num_processes,
        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
        "device": str(trainer.args.device),
        "wrapper": type(wrapped).__name__,
        "zero_stage": None,
        "offload_optimizer": None,
        "offload_params": None,
        "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
        # What the dtypes really were: autocast (accelerate's mixed precision) and the parameters' storage.
        "mixed_precision": str(trainer.accelerator.mixed_precision),
        "parameter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in trainer.model.parameters()}),
        "loss": "chunked" if getattr(trainer, "chunked_loss", False) else "trl",
        "activation_checkpointing": _checkpointing_on(trainer),
        "micro_batch_size": trainer.args.per_device_train_batch_size,
        "grad_accum_steps": trainer.args.gradient_accumulation_steps,
        **throughput.record(trainer),  # the levers that really ran: attention, compile, Liger
    }
    params = list(trainer.model.parameters())
    local = full = sum(p.numel() for p in params)
    if trainer.is_fsdp_enabled:  # FSDP2: DTensor parameters, this rank's shard is the local tensor
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
        policy = trainer.accelerator.state.fsdp_plugin.cpu_offload
        if type(policy).__name__ == "CPUOffloadPolicy":  # parameters, gradients and optimizer state together
            record.update(offload_optimizer="cpu", offload_params="cpu")
    if trainer.is_deepspeed_enabled:
        engine = trainer.deepspeed
        record.update(
            zero_stage=engine.zero_optimization_stage(),
            offload_optimizer=_offload_device(engine.zero_offload_optimizer()),
            offload_params=_offload_device(engine.zero_offload_param()),
            optimizer=type(engine.optimizer).__name__,
            base_optimizer=type(getattr(engine, "basic_optimizer", None) or engine.optimizer).__name__,
        )
        if engine.zero_optimization_stage() == 3:  # partitioned: ds_tensor is this rank's slice
            local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
            full = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        basic = getattr(engine, "basic_optimizer", None) or engine.optimizer
    else:
        basic = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    record["optimizer_kind"] = optimizer_kind(basic)
    record["fused_optimizer"] = bool(getattr(basic, "defaults", {}).get("fused"))
    record["loaded_partitioned"] = bool(getattr(trainer, "loaded_partitioned", False))  # zero.Init
    rank = int(os.environ.get("RANK", "0"))
    mine = {"rank": rank, "pid": os.getpid(), "parameters_held": local, "parameters": full}
    # QLoRA: this rank's share of the 4-bit base, and the digest of its weights as the engine gathers them
    mine["quantized_base"] = quantized.record(trainer)
    if sequence_degree(trainer.accelerator) > 1:  # this rank's share of the sequences it trained on
        mine["sequence_share"] = {
            "tokens": int(getattr(trainer, "split_tokens", 0)),
            "shard_widths": sorted(getattr(trainer, "split_widths", ())),
        }
    # the frozen companions beside the policy (a learned reward model): this rank's share and its forwards
    companions = getattr(trainer, "companions", {})
    if companions:
        mine["companions"] = {role: watched.record() for role, watched in companions.items()}
    record["ranks"] = gather_object([mine])
    return record


def held_share(model: Any) -> float:
    """The fraction of `model`'s parameters this rank holds: a ZeRO-3 partition (`ds_tensor`), an FSDP2 shard (a
    DTensor's local tensor), or the whole."""
    held = total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            held, total = held + p.ds_tensor.numel(), total + p.ds_numel
        else:
            held += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
            total += p.numel()
    return held / total if total else 1.0


def shard_frozen(model: Any, accelerator: Any) -> Any:
    """A frozen companion divided over the ranks under FSDP2 as the policy is: each decoder layer its own unit
    (gathered one at a time in the forward), then the rest with TRL's `prepare_fsdp`. TRL prepares companions
    with `accelerator.prepare_model(..., evaluation_mode=True)`, which under FSDP wraps nothing: every rank would
    hold the whole model where the plan counts its share."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from trl.models import prepare_fsdp

    plugin = accelerator.state.fsdp_plugin
    layers = set(plugin.transformer_cls_names_to_wrap or ())
    settings = dict(
        reshard_after_forward=plugin.reshard_after_forward,
        offload_policy=plugin.cpu_offload,
        mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy(),
    )
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module, **settings)
    return prepare_fsdp(model, accelerator)


class WatchedCompanion:
    """A frozen companion model as this rank runs it: its forwards counted, for the engine record."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.forwards = 0
        model.register_forward_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.forwards += 1

    def record(self) -> dict[str, Any]:
        return {"share": held_share(self.model), "forwards": self.forwards}


# torch.distributed's CheckpointWrapper (accelerate applies it for FSDP's activation checkpointing).
_CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."


def save_output(trainer: Any, out_dir: Path) -> None:
    """The trained adapter or model, whole, into `out_dir` (every rank calls it; rank 0 writes).

    Under FSDP2 the Trainer's `save_model` writes nothing with a sharded state dict (what the
    resumable checkpoints use), so the output is gathered here: an adapter's trainable tensors
    alone (not the frozen base: 140 GB for a 70B), or the full state dict of a fully trained model.
    ZeRO-3 gathers through `stage3_gather_16bit_weights_on_model_save` in `save_model`.
    """
    if not trainer.is_fsdp_enabled:
        trainer.save_model(str(out_dir))
        return
    model = trainer.model
    if not hasattr(model, "get_base_model"):
        # One tensor gathered at a time (rank 0 keeps them on the host); accelerate's get_state_dict
        # (torch's get_model_state_dict) handed back invalid storages for CPU-offloaded shards.
        keep = trainer.args.should_save
        state_dict = {}
        for name, tensor in model.state_dict().items():
            whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if keep:
                state_dict[name] = whole.detach().to("cpu", copy=True)
        trainer._save(str(out_dir), state_dict=state_dict)
        return
    import copy

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    gathered = {  # a collective: every rank gathers each trainable DTensor whole
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    # PEFT picks the adapter's tensors by the modules' names, which FSDP's activation checkpointing
    # wraps (`_checkpoint_wrapped_module`); the file must carry the model's own names to load again.
    adapter = {
        key.replace(_CHECKPOINT_WRAPPER, ""): tensor.contiguous()
        for key, tensor in get_peft_model_state_dict(model, state_dict=gathered).items()
    }
    if trainer.args.should_save:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(adapter, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.deepcopy(model.peft_config["default"])
        config.inference_mode = True
        config.save_pretrained(str(out_dir))


def run_callbacks(cfg: Config, run_dir: Path, args: Any, callbacks: list[Any]) -> list[Any]:
    """The stage's callbacks plus TensorBoard's (one writer: rank 0's events file in RUN_DIR/tensorboard)."""
    from transformers.integrations import TensorBoardCallback

    callbacks = list(callbacks)
    # MLflow, W&B and Trackio log through transformers' own callbacks (report_to): where they write
    tracking.prepare(cfg, run_dir, main_process=args.process_index == 0)
    if "tensorboard" in cfg.train.report_to and args.process_index == 0:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(run_dir) / rundir.TENSORBOARD_DIR
        rundir.check_folder(log_dir)  # SummaryWriter creates and appends in place
        callbacks.append(TensorBoardCallback(SummaryWriter(log_dir=str(log_dir))))
    return callbacks


def finish_trainer(trainer: Any, cfg: Config) -> Any:
    """After any trainer's construction: our progress bar for transformers' printed dicts and tqdm bars,
    the adapters in the planned dtype, the decoder layers compiled when asked."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    if cfg.method.uses_adapters:
        keep_adapter_dtype(trainer.model, cfg.method.adapter_dtype)
    if cfg.train.compile:
        throughput.compile_decoder_layers(trainer.model)
    return trainer


def keep_adapter_dtype(model: Any, adapter_dtype: str) -> int:
    """The adapters in `method.adapter_dtype`, as planned: SFTTrainer casts a quantized model's trainable
    parameters to bf16 whatever was asked (the QLoRA paper's choice, also our QLoRA default). Returns
    how many tensors were cast back."""
    dtype = torch.bfloat16 if adapter_dtype == "bf16" else torch.float32
    cast = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)
            cast += 1
    return cast


def build_trainer(
    cfg: Config,
    plan: Plan,
    run_dir: Path,
    model: Any,
    tokenizer: Any,
    train_dataset: Any,
    eval_dataset: Any,
    compute_dtype: torch.dtype,
    callbacks: list[Any],
    monitor: Optional[RunMonitor] = None,
    args: Optional[Any] = None,
) -> Any:
    """The objective's trainer for `model` (its trainer module: `ObjectiveSpec.trainer`); `args` when built
    before loading the model (ZeRO-3: see load_for_training)."""
    module = cfg.objective.spec.trainer_module()
    args = args or module.build_config(cfg, plan, run_dir, compute_dtype)
    own = module.trainer_kwargs(cfg, plan, tokenizer, eval_dataset)
    if (
        own.get("eval_dataset") is None
    ):  # data.eval_fraction=0, or no row left to hold out: no evaluation in training
        args.eval_strategy = IntervalStrategy.NO
    trainer = module.Trainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=run_callbacks(cfg, run_dir, args, callbacks),
        monitor=monitor,
        **own,
    )
    return finish_trainer(trainer, cfg)
