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
