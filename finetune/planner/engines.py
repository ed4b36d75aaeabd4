"""Which engine runs which strategy: the one table the planner searches and the launcher obeys.

The plan's `sharding` names the engine: `none` one process, `ddp` data parallel
(both through accelerate, bf16 autocast), `fsdp` FSDP2 through accelerate,
`zero3` DeepSpeed ZeRO-3. The planner only emits strategies `why_not` accepts;
finetune/launch/engines.py writes each engine's settings from the plan and
refuses any strategy this table rejects (a hand-edited plan.json), so an engine
never substitutes one thing for another. tests/test_launch_engines.py walks every
rung on every profile against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from finetune.core.methods import METHODS
from finetune.planner.contract import Strategy

EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit")


@dataclass(frozen=True)
class Engine:
    name: str  # single | ddp | fsdp | zero3
    sharding: str  # the plan's word for it
    shards: bool  # divides weights, gradients and optimizer state across the GPUs (a method's `can_shard`)
    optimizers: tuple[str, ...]  # without offload
    # (offload_optimizer, offload_params) pairs it runs
    offloads: tuple[tuple[bool, bool], ...]
    # what each refusal means, one line naming the keys
    note: str


ENGINES: dict[str, Engine] = {
    "none": Engine(
        "single", "none", False, ("adamw", *EIGHT_BIT), ((False, False),),
        "one process holds everything on its GPU: it offloads nothing",
    ),
    "ddp": Engine(
        "ddp", "ddp", False, ("adamw", *EIGHT_BIT), ((False, False),),
        "data parallel replicates the whole state on every GPU: it offloads nothing",
    ),
    # bitsandbytes' optimizers have no DTensor support (measured: "Operator bitsandbytes.optimizer_update_32bit
    # .default does not have a sharding strategy registered"); CPUOffloadPolicy moves parameters, gradients and
    # optimizer state to the host together; accelerate leaves bitsandbytes' 4-bit (uint8) weights unsharded.
    "fsdp": Engine(
        "fsdp", "fsdp", True, ("adamw",), ((False, False), (True, True)),
        "FSDP2 offloads parameters, gradients and optimizer state together (CPUOffloadPolicy)",
    ),
    # ZeRO-3 wraps a bitsandbytes 8-bit optimizer without offload (measured: base optimizer bnb AdamW, optim_bits
    # 8); with optimizer offload it runs only its own fp32 CPU Adam, which the plan calls adamw.
    "zero3": Engine(
        "zero3", "zero3", True, ("adamw", "adamw_8bit"), ((False, False), (True, False), (True, True)),
        "ZeRO-3 offloads the optimizer (its fp32 CPU Adam), and parameters only with it",
    ),
}  # fmt: skip


def engine_for(sharding: str) -> Engine:
    return ENGINES[sharding]


def why_not(s: Strategy, method: str, gpus: Optional[int] = None) -> Optional[str]:
    """Why the strategy's engine cannot run it (one line naming the keys), or None when it can.

    `gpus`: the GPUs the plan is for (None leaves the count unchecked: the launcher's ranks decide it).
    """
    e = ENGINES[s.sharding]
    if gpus is not None and (e.shards or s.sharding == "ddp") and gpus < 2:
        return f"train.sharding={s.sharding} needs several GPUs"
    refusal = METHODS[method].shard_refusal
    if e.shards and refusal is not None:
        return f"method={method} does not shard under train.sharding={s.sharding}: {refusal}"
    if (s.offload_optimizer, s.offload_params) not in e.offloads:
        if not e.shards:
            asked = "train.offload_params=true" if s.offload_params else "train.offload_optimizer=true"
            return f"{asked} needs train.sharding=zero3 or fsdp: {e.note}"
        asked = f"train.offload_optimizer={str(s.offload_optimizer).lower()}"
        return f"{asked} with train.offload_params={str(s.offload_params).lower()}: {e.note}"
    if s.offload_optimizer and s.optimizer != "adamw":
        return (
            f"method.optimizer={s.optimizer} with optimizer offload: ZeRO-3 offloads only its own fp32 CPU Adam "
            "(method.optimizer=adamw)"
        )
    if not s.offload_optimizer and s.optimizer not in e.optimizers:
        if s.sharding == "fsdp":
            return (
                f"method.optimizer={s.optimizer} does not run under train.sharding=fsdp (bitsandbytes' 8-bit "
                "optimizers have no DTensor support): use train.engine=deepspeed (ZeRO-3 runs it) or "
                "method.optimizer=adamw"
            )
        return f"method.optimizer={s.optimizer} does not run under train.sharding={s.sharding}"
    return None
