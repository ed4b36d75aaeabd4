"""Engine settings from the plan: a DeepSpeed ZeRO-3 JSON or an accelerate FSDP2 config, written into the run dir.

The plan's sharding verdict picks the engine (`zero3` -> DeepSpeed, `fsdp` ->
FSDP2, `ddp` -> plain data parallel, `none` -> one process); `train.engine`
already chose between the two sharded engines when the plan was made. Every
number DeepSpeed needs is filled in (no "auto"), and the same numbers are
returned as `trainer_kwargs` so SFTConfig agrees with the files (HF's DeepSpeed
integration refuses a config whose batch sizes, clipping or learning rate
differ from the TrainingArguments). The settings are the plan's, one for one:
a strategy the engine cannot run (finetune/planner/engines.py's table; the
planner never emits one, a hand-edited plan.json might) is refused, never
replaced by something else.

The launcher writes them, with `engine.json` (the engine, the world size, the files and the
SFTConfig arguments: `EngineFiles.to_dict`); each rank reads engine.json and never writes them again.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import yaml

from finetune import rundir
from finetune.core.architectures import ARCHITECTURES
from finetune.core.config import Config
from finetune.core.config.launch import LaunchConfig
from finetune.core.errors import LaunchError
from finetune.planner import Layout, Plan, Strategy, why_not, why_not_split

# TrainingArguments' AdamW defaults, written into the DeepSpeed optimizer block and returned
# in trainer_kwargs so both sides agree.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPSILON = 1e-8


def launch_of(cfg: Config) -> LaunchConfig:
    """`cfg.launch` (the root Config carries it once mode=launch is wired in; defaults until then)."""
    launch = getattr(cfg, "launch", None)
    return launch if isinstance(launch, LaunchConfig) else LaunchConfig()


def layout(plan: Plan, launch: Optional[LaunchConfig] = None) -> Layout:
    """The plan's process layout (plan.json `layout`); a `launch` given here sets its own process counts
    where it has them (the pipeline passes the same launch settings the plan was made with)."""
    lay = plan.layout
    if launch is None:
        return lay
    return replace(
        lay, nproc_per_node=launch.nproc_per_node or lay.nproc_per_node, nnodes=launch.nnodes or lay.nnodes
    )


def _bf16(cfg: Config, lay: Layout) -> bool:
    return cfg.method.dtype_on(lay.device) == "bf16"


# ---------------------------------------------------------------- DeepSpeed ZeRO-3


def deepspeed_config(cfg: Config, lay: Layout) -> dict[str, Any]:
    """ZeRO stage 3 with the plan's offload, every value concrete, not "auto": DeepSpeed asserts
    train_batch_size == micro_batch x accumulation x world size at start-up (a file for another world size is
    refused), and transformers still compares each value with SFTConfig and refuses a mismatch."""
    s = lay.strategy
    h = cfg.model.hidden_size
    pin = lay.device == "cuda"  # pinned host buffers speed up PCIe copies; meaningless without a GPU
    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        # HF's "auto" values, computed here from the model's hidden size: zero.Init reads this file while the
        # model loads, before the Trainer fills "auto", and would take DeepSpeed's own 5e8 / 5e7 / 1e5 (BENCHMARKS.md).
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
        "sub_group_size": 1_000_000_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        # Save a consolidated bf16 model, not only ZeRO shards (export and eval load it directly).
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if s.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    ds: dict[str, Any] = {
        # Over every rank, a sequence split's too: zero.Init (while the model loads) and the Trainer check it
        # against the world size; accelerate rewrites it for the data-parallel ranks (micro x accumulation x
        # world / sp_size) just before deepspeed.initialize, which then knows the split's groups.
        "train_batch_size": s.micro_batch_size * s.grad_accum_steps * lay.world_size,
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": s.grad_accum_steps,
        "gradient_clipping": cfg.train.max_grad_norm,
        "bf16": {"enabled": _bf16(cfg, lay)},
        "zero_optimization": zero,
        "steps_per_print": max(cfg.train.logging_steps, 1) * 100,
        "wall_clock_breakdown": False,
    }
    if s.offload_optimizer:
        # ZeRO-Offload runs DeepSpeed's CPU Adam (the plan's adamw, fp32 moments on the host); without offload
        # the Trainer's optimizer (torch AdamW or bitsandbytes' 8-bit one) runs inside ZeRO-3.
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": cfg.method.learning_rate,
                "betas": list(ADAM_BETAS),
                "eps": ADAM_EPSILON,
                "weight_decay": cfg.method.weight_decay,
            },
        }
    return ds


# ---------------------------------------------------------------- accelerate / FSDP2


def decoder_layer_class(cfg: Config) -> str:
    try:
        return ARCHITECTURES[cfg.model.architecture].decoder_layer
    except KeyError:
        raise LaunchError(
            f"model.architecture={cfg.model.architecture!r}: no decoder layer class known for FSDP auto-wrap"
        ) from None


def _fsdp_offload(s: Strategy) -> bool:
    """FSDP2 offloads parameters, gradients and optimizer state together (CPUOffloadPolicy): the plan says so
    with both flags (`check_runnable` refuses one without the other)."""
    return s.offload_params


def check_runnable(cfg: Config, lay: Layout) -> None:
    """Refuse a strategy the engine would not run as planned (finetune/planner/engines.py's table)."""
    reason = why_not(lay.strategy, cfg.method.name, lay.world_size if lay.strategy.split else None)
    reason = reason or why_not_split(
        lay.strategy, cfg.model, lay.strategy.attention, cfg.data.packing, lay.device
    )
    if reason is not None:
        raise LaunchError(
            f"plan.json asks for what {lay.engine.runs_as} cannot run: {reason}; re-run mode=plan"
        )


def accelerate_config(
    cfg: Config, lay: Layout, launch: LaunchConfig, deepspeed_file: Optional[Path] = None
) -> dict:
    """An `accelerate launch --config_file` config: FSDP2 for an fsdp plan, DeepSpeed (pointing at the JSON)
    for zero3, multi-GPU/CPU data parallel otherwise. machine_rank is 0 here; other nodes pass --machine_rank."""
    s = lay.strategy
    cpu = lay.device == "cpu"
    distributed_type = lay.engine.accelerate_type
    if distributed_type == "MULTI":
        distributed_type = "MULTI_CPU" if cpu else "MULTI_GPU"
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "mixed_precision": "bf16" if _bf16(cfg, lay) else "no",
        "use_cpu": cpu,
        "debug": False,
        "num_machines": lay.nnodes,
        "machine_rank": 0,
        "num_processes": lay.world_size,
        "main_training_function": "main",
        "enable_cpu_affinity": False,
        "downcast_bf16": False,
    }
    if lay.nnodes > 1:
        out.update(
            main_process_ip=launch.master_addr,
            main_process_port=launch.master_port,
            rdzv_backend=launch.rdzv_backend,
            same_network=True,
        )
    if lay.engine.fsdp2:
        out["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": True,  # full shard
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": decoder_layer_class(cfg),
            "fsdp_activation_checkpointing": s.activation_checkpointing,
            "fsdp_offload_params": _fsdp_offload(s),
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_sync_module_states": True,  # accelerate requires it with cpu_ram_efficient_loading
        }
    elif lay.engine.deepspeed:
        if deepspeed_file is None:
            raise LaunchError("a zero3 plan under accelerate needs the DeepSpeed JSON written first")
        # With a config file, accelerate takes mixed precision from the JSON and refuses its own setting.
        del out["mixed_precision"]
        out["deepspeed_config"] = {"deepspeed_config_file": str(deepspeed_file), "zero3_init_flag": True}
    return out


def fsdp_trainer_config(cfg: Config, lay: Layout) -> dict[str, Any]:
    """The same FSDP2 settings in TrainingArguments' `fsdp_config` spelling (works under torchrun too)."""
    s = lay.strategy
    return {
        "version": 2,
        "reshard_after_forward": True,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": [decoder_layer_class(cfg)],
        "activation_checkpointing": s.activation_checkpointing,
        "cpu_offload": _fsdp_offload(s),
        "state_dict_type": "SHARDED_STATE_DICT",
        "cpu_ram_efficient_loading": True,
    }


def parallelism(lay: Layout, seq_len: int) -> Optional[dict[str, Any]]:
    """accelerate's `ParallelismConfig` for the plan's sequence split, as keyword arguments (engine.json's
    `parallelism`; the rank builds the object, TrainingArguments' `parallelism_config`), or None unsplit.

    Ulysses: `sp_size` with DeepSpeed's backend and its handler (the attention it wraps, the sequence length
    variable per batch since packed rows vary). Ring: `cp_size` with torch's backend, FSDP2 sharding the rest.
    `attention` is the plan's (`train.attention`, or the planner's choice), which the rank maps to transformers' implementation;
    `seq_len` the plan's (train.seq_len, or what the data stage resolved `auto` to).
    """
    s = lay.strategy
    split = s.split
    if split is None:
        return None
    out: dict[str, Any] = {
        split.size_field: s.sequence_parallel,
        split.size_field[:2] + "_backend": split.backend,
    }
    if split.engine_needs == "fsdp2":
        out["dp_shard_size"] = lay.mesh.shard
    return {
        "kwargs": out,
        "split": split.key,
        "attention": s.attention,
        "seq_len": seq_len,
    }


# ---------------------------------------------------------------- what the trainer reads


@dataclass(frozen=True)
class EngineFiles:
    """The engine of a run and the files and SFTConfig arguments that configure it."""

    engine: str  # the engine's `runs_as` (finetune/core/parallelism.py)
    world_size: int
    deepspeed: Optional[Path] = None
    accelerate_config: Optional[Path] = None
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    parallelism: Optional[dict[str, Any]] = None  # the sequence split's ParallelismConfig (`parallelism`)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "world_size": self.world_size,
            "parallelism": self.parallelism,
            "deepspeed": None if self.deepspeed is None else str(self.deepspeed),
            "accelerate_config": None if self.accelerate_config is None else str(self.accelerate_config),
            "trainer_kwargs": dict(self.trainer_kwargs),
            "notes": list(self.notes),
        }


def _write_if_changed(path: Path, text: str) -> None:
    """Every rank may call this with the same text; the atomic rename makes concurrent writers harmless."""
    rundir.check_target(path)  # before reading it: a planted link is neither followed nor kept
    if not path.is_file() or rundir.read_own_text(path) != text:
        rundir.atomic_write_text(path, text)


def write_engine_files(
    cfg: Config, plan: Plan, run_dir: Path, launch: Optional[LaunchConfig] = None
) -> EngineFiles:
    """Write deepspeed.json / accelerate_fsdp.yaml (as the plan needs) and engine.json (what the ranks read)
    into the run dir, and describe them."""
    launch = launch or launch_of(cfg)
    lay = layout(plan, launch)
    check_runnable(cfg, lay)
    run_dir = Path(run_dir).resolve()
    s = lay.strategy
    bf16 = _bf16(cfg, lay)
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": s.micro_batch_size,
        "gradient_accumulation_steps": s.grad_accum_steps,
        "max_grad_norm": cfg.train.max_grad_norm,
        "learning_rate": cfg.method.learning_rate,
        "weight_decay": cfg.method.weight_decay,
        "adam_beta1": ADAM_BETAS[0],
        "adam_beta2": ADAM_BETAS[1],
        "adam_epsilon": ADAM_EPSILON,
        "bf16": bf16,
        "use_cpu": lay.device == "cpu",
        "ddp_timeout": launch.nccl_timeout_s,
        "activation_checkpointing": s.activation_checkpointing,
        # TRL's: the checkpointed layer inputs go to host memory (on the CPU a no-op: they are there already)
        "activation_offloading": s.activation_offloading,
    }
    ds_path: Optional[Path] = None
    acc_path: Optional[Path] = None
    if lay.engine.deepspeed:
        ds_path = run_dir / rundir.DEEPSPEED_FILE
        _write_if_changed(ds_path, json.dumps(deepspeed_config(cfg, lay), indent=2) + "\n")
        kwargs["deepspeed"] = str(ds_path)
    elif lay.engine.fsdp2:
        acc_path = run_dir / rundir.ACCELERATE_FSDP_FILE
        _write_if_changed(acc_path, yaml.safe_dump(accelerate_config(cfg, lay, launch), sort_keys=False))
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = fsdp_trainer_config(cfg, lay)
        # FSDP checkpoints each wrapped layer itself; the Trainer's own checkpointing would add an all-gather.
        kwargs["activation_checkpointing"] = False
    if launch.launcher == "accelerate" and acc_path is None:
        acc_path = run_dir / rundir.ACCELERATE_FILE
        _write_if_changed(
            acc_path, yaml.safe_dump(accelerate_config(cfg, lay, launch, ds_path), sort_keys=False)
        )
    files = EngineFiles(
        engine=lay.engine.runs_as,
        world_size=lay.world_size,
        deepspeed=ds_path,
        accelerate_config=acc_path,
        trainer_kwargs=kwargs,
        parallelism=parallelism(lay, plan.seq_len),
    )
    _write_if_changed(run_dir / rundir.ENGINE_FILE, json.dumps(files.to_dict(), indent=2) + "\n")
    return files


def nccl_env(launch: LaunchConfig, lay: Layout) -> dict[str, str]:
    """Environment every rank gets: NCCL error handling and timeouts, CPU mode, the user's extras."""
    env: dict[str, str] = {}
    if lay.world_size > 1:
        if launch.nccl_async_error_handling:
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        if launch.nccl_debug:
            env["NCCL_DEBUG"] = launch.nccl_debug
        # The trainer passes ddp_timeout; DeepSpeed's own process group reads this (whole minutes).
        if lay.engine.deepspeed:
            env["DEEPSPEED_TIMEOUT"] = str(max(1, math.ceil(launch.nccl_timeout_s / 60)))
        if lay.device == "cpu" and not lay.engine.deepspeed:
            # Without it accelerate looks for CUDA, finds none, and each torchrun rank trains alone.
            # Not for DeepSpeed: accelerate refuses DeepSpeed when this is set and silently runs DDP
            # instead; there SFTConfig(use_cpu=True) alone gives the gloo group DeepSpeed runs on.
            env["ACCELERATE_USE_CPU"] = "true"
        if lay.device == "cpu":
            # DeepSpeed (imported by transformers) skips probing for a GPU and warning on each rank.
            env["DS_ACCELERATOR"] = "cpu"
    env.update({k: str(v) for k, v in launch.env.items()})
    return env
