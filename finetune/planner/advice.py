"""What else would run the job: the plan on every other hardware profile (the alternatives, each with how it
would run and what it costs), `hardware=auto`'s choice among them, the short list people read, and, for a
plan that does not fit, the changes that would (another profile, a lighter method, a lower LoRA rank, more
GPUs, a shorter sequence), each with its figure.
"""

from __future__ import annotations

import math
from dataclasses import replace

from finetune.core.config import HardwareConfig
from finetune.core.errors import ConfigError, PlanError
from finetune.core.parallelism import ENGINES, SHARDED_ENGINES
from finetune.planner.contract import Alternative, Plan, Strategy
from finetune.planner.memory import Job
from finetune.planner.search import offload_words, per_device, plan_on, try_plan

# The alternatives the plan's table shows: the best trades, not every profile (plan.json holds them all).
SHORTLIST = 5


def strategy_words(s: Strategy, gpus: int) -> str:
    """How a strategy runs, in a few words: the engine across its GPUs, the optimizer and offload, activation
    checkpointing, the micro-batch."""
    words = []
    if s.engine.shards:
        words.append(f"{s.engine.short} across {gpus} GPUs")
    elif gpus > 1:
        words.append(f"data parallel over {gpus} GPUs")
    words.append(s.optimizer + offload_words(s))
    if s.activation_checkpointing:
        words.append("checkpointing")
    if s.split is not None:
        words.append(f"{s.split.label} over {s.sequence_parallel} GPUs")
    words.append(f"micro-batch {s.micro_batch_size}")
    return ", ".join(words)


def alternative(a: Plan, plan: Plan) -> Alternative:
    """One profile's plan as an alternative to `plan`: its memory, usable memory, price per month and per
    GPU-hour, the run's hours and cost where its length is known, and its strategy where it differs."""
    hw = a.hardware
    mine = strategy_words(a.strategy, hw.total_gpus)
    theirs = strategy_words(plan.strategy, plan.hardware.total_gpus)
    return Alternative(
        a.hardware.name,
        a.fits,
        round(a.gpu_memory.total, 3),
        hw.usd_per_month,
        usable_gb=round(a.usable_gpu_memory_gb, 3),
        strategy=None if mine == theirs else mine,
        usd_per_gpu_hour=None if hw.gpu_hour_usd is None else round(hw.gpu_hour_usd, 4),
        tokens_per_second=a.estimate.tokens_per_second,
        run_hours=a.estimate.run_hours,
        run_usd=a.estimate.usd,
    )


def shortlist(plan: Plan, limit: int = SHORTLIST) -> list[Alternative]:
    """The alternatives worth reading: those that fit and that no other beats on both cost (the run's, else
    the month's) and speed, cheapest first, at most `limit`; when none fits, the nearest to fitting."""
    others = [a for a in plan.alternatives if a.hardware != plan.hardware.name]
    fitting = [a for a in others if a.fits]
    if not fitting:
        return sorted(others, key=lambda a: a.total_gb / (a.usable_gb or math.inf))[: min(limit, 3)]

    def cost(a: Alternative) -> float:
        if a.run_usd is not None:
            return a.run_usd
        return math.inf if a.usd_per_month is None else a.usd_per_month

    def speed(a: Alternative) -> float:
        return a.tokens_per_second or 0.0

    def beaten(a: Alternative) -> bool:
        return any(
            cost(b) <= cost(a) and speed(b) >= speed(a) and (cost(b), speed(b)) != (cost(a), speed(a))
            for b in fitting
        )

    front = [a for a in fitting if not beaten(a)]
    return sorted(front, key=lambda a: (cost(a), -speed(a), a.hardware))[:limit]


def suggestions(plan: Plan, job: Job, alts: list[Plan]) -> list[str]:
    """What would fit instead of a plan that does not: another profile, the lighter method, the other
    engine, a shorter sequence."""
    method, train = job.method, job.train
    out: list[str] = []
    fitting = sorted((a for a in alts if a.fits), key=lambda a: monthly(a.hardware))
    if fitting:
        a = fitting[0]
        usd = a.hardware.usd_per_month
        price = "price unknown" if usd is None else f"{usd * a.hardware.nodes:,.0f} USD/month"
        out.append(f"hardware={a.hardware.name} fits ({a.gpu_memory.total:.1f} GB per GPU, {price})")
    hw = plan.hardware
    lighter = method.spec.fallback
    if lighter is not None:
        settings = dict(method.spec.fallback_settings)
        lo = try_plan(job, method=replace(method, name=lighter, **settings))
        if lo is not None and lo.fits:
            out.append(f"method={lighter} fits on {hw.name} ({lo.gpu_memory.total:.1f} GB{per_device(hw)})")
    out.extend(_rank_suggestions(job))
    out.extend(_sharding_suggestions(plan, job))
    if hw.total_gpus > 1 and method.optimizer is not None and train.engine is not None:
        # a fixed optimizer the chosen sharded engine does not run, that another one does
        for other in SHARDED_ENGINES:
            runs = method.optimizer in ENGINES[other].optimizers
            if other == train.engine or not runs or method.optimizer in ENGINES[train.engine].optimizers:
                continue
            alt = try_plan(job, train=replace(train, engine=other))
            if alt is not None and alt.fits:
                out.append(
                    f"train.engine={other} fits on {hw.name} ({ENGINES[other].short} runs {method.optimizer})"
                )
    out.extend(_split_suggestions(job))
    seq = plan.seq_len // 2
    while seq >= 256:
        shorter = try_plan(job, seq_len=seq)
        if shorter is not None and shorter.fits:
            out.append(
                f"train.seq_len={seq} fits on {hw.name} ({shorter.gpu_memory.total:.1f} GB{per_device(hw)})"
            )
            break
        seq //= 2
    return out


def _rank_suggestions(job: Job) -> list[str]:
    """An adapter method: the largest lower LoRA rank (halving, down to 8) that fits, with its figure."""
    method, hw = job.method, job.hw
    if not method.uses_adapters:
        return []
    rank = method.lora_rank // 2
    while rank >= 8:
        lower = try_plan(
            job,
            method=replace(
                method, lora_rank=rank, lora_alpha=max(1, method.lora_alpha * rank // method.lora_rank)
            ),
        )
        if lower is not None and lower.fits:
            return [
                f"method.lora_rank={rank} fits on {hw.name} ({lower.gpu_memory.total:.1f} GB{per_device(hw)})"
            ]
        rank //= 2
    return []


def _split_suggestions(job: Job) -> list[str]:
    """A job that fits only with a sequence split its packed rows or attention refuse: the settings that let it."""
    if job.hw.total_gpus < 2 or job.train.sequence_parallel == 1:
        return []
    variants = [("train.attention=flash", replace(job, train=replace(job.train, attention="flash")))]
    if job.packing:
        variants.append(("data.packing=false", replace(job, packing=False)))
    for words, variant in variants:
        try:
            plan = plan_on(variant)
        except (PlanError, ConfigError):
            continue
        split = plan.strategy.split
        if plan.fits and split is not None:
            return [
                f"{words} fits: {split.label} over {plan.strategy.sequence_parallel} GPUs, "
                f"{plan.gpu_memory.total:.1f} GB per GPU"
            ]
    return []


def _sharding_suggestions(plan: Plan, job: Job) -> list[str]:
    """A job that does not fit unsharded: sharded across this node's GPUs (sharding left to the search), or, on
    one GPU, across a node of 2, 4 or 8 of them; each with the per-GPU figure."""
    hw, train = job.hw, job.train
    if plan.strategy.engine.shards or hw.nodes > 1:
        return []
    if hw.gpus_per_node > 1:
        if train.sharding is None:
            return []
        sharded = try_plan(job, train=replace(train, sharding=None))
        if sharded is None or not sharded.fits or not sharded.strategy.engine.shards:
            return []
        e = sharded.strategy.engine
        return [
            f"train.sharding={e.key} fits: {e.short} across the {hw.gpus_per_node} GPUs of {hw.name}"
            f"{offload_words(sharded.strategy)}, {sharded.gpu_memory.total:.1f} GB per GPU"
        ]
    for gpus in (2, 4, 8):
        wider = try_plan(job, hw=replace(hw, gpus_per_node=gpus))
        if wider is not None and wider.fits and wider.strategy.engine.shards:
            e = wider.strategy.engine
            return [
                f"hardware.gpus_per_node={gpus} fits: {e.short} across {gpus} x {hw.name}"
                f"{offload_words(wider.strategy)}, {wider.gpu_memory.total:.1f} GB per GPU"
            ]
    return []


def monthly(hw: HardwareConfig) -> float:
    """The price of the whole profile a month (all its nodes); unknown: infinite, so it ranks last."""
    return math.inf if hw.usd_per_month is None else hw.usd_per_month * hw.nodes


def choose(alts: list[Plan]) -> Plan:
    """hardware=auto: the cheapest for the run when every fitting profile has a run cost, else per month."""
    fitting = [a for a in alts if a.fits]
    if not fitting:
        plan = min(alts, key=lambda a: a.gpu_memory.total / (a.hardware.gpu_memory_gb or 1))
        return replace(plan, reasons=("hardware=auto: no profile fits",) + plan.reasons)
    if all(a.estimate.usd is not None for a in fitting):
        ranked = sorted(fitting, key=lambda a: (a.estimate.usd, a.gpu_memory.total))
        best = ranked[0]
        why = (
            f"hardware=auto: {best.hardware.name} costs the least for this run: {best.estimate.usd:,.0f} USD over "
            f"{best.estimate.run_hours:,.1f} h"
        )
        if len(ranked) > 1:
            nxt = ranked[1]
            why += f" (next: {nxt.hardware.name}, {nxt.estimate.usd:,.0f} USD over {nxt.estimate.run_hours:,.1f} h)"
    else:
        best = min(fitting, key=lambda a: (monthly(a.hardware), a.gpu_memory.total))
        per_month = monthly(best.hardware)
        why = (
            f"hardware=auto: {best.hardware.name} is the cheapest profile that fits ({per_month:,.0f} USD/month; "
            "give train.max_steps or train.dataset_tokens to compare the cost of the run)"
        )
    return replace(best, reasons=(why,) + best.reasons)
