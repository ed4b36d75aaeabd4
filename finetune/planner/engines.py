"""Which engine runs which strategy: the rules the planner searches and the launcher obeys.

The plan's `sharding` names the engine (finetune/core/parallelism.py describes each one:
`none` one process, `ddp` data parallel, `fsdp` FSDP2, `zero3` DeepSpeed ZeRO-3). The
planner only emits strategies `why_not` accepts;
finetune/launch/engines.py writes each engine's settings from the plan and
refuses any strategy this table rejects (a hand-edited plan.json), so an engine
never substitutes one thing for another. tests/test_launch_engines.py walks every
rung on every profile against it.
"""

from __future__ import annotations

from typing import Optional

from finetune.core.config import ModelConfig
from finetune.core.methods import METHODS
from finetune.core.parallelism import ENGINES, SHARDED_ENGINES, Engine
from finetune.planner.contract import Strategy


def engine_for(sharding: str) -> Engine:
    return ENGINES[sharding]


def why_not(s: Strategy, method: str, gpus: Optional[int] = None) -> Optional[str]:
    """Why the strategy's engine cannot run it (one line naming the keys), or None when it can.

    `gpus`: the GPUs the plan is for (None leaves the count unchecked: the launcher's ranks decide it).
    """
    e = s.engine
    if gpus is not None and e.several_ranks and gpus < 2:
        return f"train.sharding={s.sharding} needs several GPUs"
    split = s.split
    if split is not None:
        if not getattr(e, split.engine_needs):
            return f"train.sequence_split={split.key} under train.sharding={s.sharding}: {split.engine_note}"
        if gpus is not None and gpus % s.sequence_parallel:
            return f"train.sequence_parallel={s.sequence_parallel} must divide the {gpus} GPUs"
    if s.activation_offloading and not s.activation_checkpointing:
        return (
            "train.activation_offloading=true offloads the checkpointed layer inputs: it needs "
            "train.activation_checkpointing=true"
        )
    refusal = METHODS[method].shard_refusal
    if e.shards and refusal is not None:
        return f"method={method} does not shard under train.sharding={s.sharding}: {refusal}"
    if (s.offload_optimizer, s.offload_params) not in e.offloads:
        if not e.shards:
            asked = "train.offload_params=true" if s.offload_params else "train.offload_optimizer=true"
            return f"{asked} needs train.sharding={' or '.join(SHARDED_ENGINES)}: {e.note}"
        asked = f"train.offload_optimizer={str(s.offload_optimizer).lower()}"
        return f"{asked} with train.offload_params={str(s.offload_params).lower()}: {e.note}"
    if s.offload_optimizer and s.optimizer != "adamw":
        return (
            f"method.optimizer={s.optimizer} with optimizer offload: ZeRO-3 offloads only its own fp32 CPU Adam "
            "(method.optimizer=adamw)"
        )
    if not s.offload_optimizer and s.optimizer not in e.optimizers:
        why = f" ({e.optimizer_note})" if e.optimizer_note else ""
        others = [k for k in SHARDED_ENGINES if k != e.key and s.optimizer in ENGINES[k].optimizers]
        if e.shards and others:
            return (
                f"method.optimizer={s.optimizer} does not run under train.sharding={s.sharding}{why}: use "
                f"train.engine={others[0]} ({ENGINES[others[0]].short} runs it) or method.optimizer=adamw"
            )
        return f"method.optimizer={s.optimizer} does not run under train.sharding={s.sharding}{why}"
    return None


def why_not_split(
    s: Strategy, model: ModelConfig, attention: str, packing: bool, device: str
) -> Optional[str]:
    """Why the strategy's sequence split cannot run this model and data (one line naming the way out), or None.

    The libraries' own limits (finetune/core/parallelism.py's SEQUENCE_SPLITS): Ulysses divides the heads;
    neither keeps packed rows apart under SDPA; torch's ring does not run on the CPU.
    """
    split = s.split
    if split is None:
        return None
    n = s.sequence_parallel
    if split.divides_heads and (model.num_heads % n or (model.num_kv_heads % n and n % model.num_kv_heads)):
        return (
            f"train.sequence_parallel={n} with train.sequence_split={split.key}: {model.name}'s "
            f"{model.num_heads} query and {model.num_kv_heads} key/value heads do not divide by {n} "
            "(choose a degree that divides them, or train.sequence_split=ring)"
        )
    if packing and attention not in split.packed_attentions:
        way = (
            f"train.attention={' or '.join(split.packed_attentions)} or data.packing=false"
            if split.packed_attentions
            else "data.packing=false"
        )
        return (
            f"train.sequence_split={split.key} with data.packing=true and train.attention={attention}: packed "
            f"samples would attend across their boundaries ({way})"
        )
    if device == "cpu" and not split.runs_on_cpu:
        return f"train.sequence_split={split.key} does not run on the CPU (train.sequence_split=ulysses does)"
    return None
