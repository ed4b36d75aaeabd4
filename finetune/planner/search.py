"""The strategy search: the fastest strategy that fits and that the chosen engine runs (`plan_on`).

Every combination of the settings the user left open (`None` in the config) is
a candidate: activation checkpointing, micro-batch size (halving down to 1,
gradient accumulation keeping the effective batch), data parallel or a
sharded engine (`train.engine`, or every sharded engine when it is unset),
8-bit optimizer states (CUDA), optimizer and parameter offload. Candidates the
engine cannot run are never considered (finetune/planner/engines.py); a
setting the user fixed is never changed, and fixed settings no engine can run
are refused with one line. Among the candidates that fit with `plan.headroom`
to spare, the one with the least estimated time per token wins (ties: no
sharding, the engine listed first in finetune/core/parallelism.py, exact
AdamW, the larger micro-batch). The loss path is `train.chunked_loss`, or
`DEFAULT_CHUNKED_LOSS`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any, Optional

from finetune.core.architectures import ARCHITECTURES
from finetune.core.config import HardwareConfig, MethodConfig, ModelConfig, TrainConfig
from finetune.core.errors import ConfigError, PlanError
from finetune.core.parallelism import ENGINES, REPLICATED, SEQUENCE_SPLITS, SHARDED_ENGINES, SINGLE
from finetune.planner import attention
from finetune.planner.activations import LayerShape, expert_weights
from finetune.planner.contract import GB, Memory, Plan, Strategy
from finetune.planner.engines import why_not, why_not_split
from finetune.planner.memory import Job, load_gpu_bytes, load_host_bytes, memory
from finetune.planner.params import count_params, expert_storage_note, vision_note
from finetune.planner.timing import disk, estimate, executed_flops_per_token

# The loss when train.chunked_loss is unset: the project's chunked loss (True) or TRL's fused LM head (False).
# Measured on an H200 (MEMORY_MODEL.md, GPU reference; 8B shape, 4 layers, 8,192 tokens): ours 40,177 tokens/s
# and 13.55 GB, TRL's 26,063 tokens/s and 13.16 GB. Flip here after scripts/bench_loss.py says otherwise.
DEFAULT_CHUNKED_LOSS = True


class Unrunnable(PlanError):
    """The fixed settings leave no strategy the engine runs on this hardware (`reason` without the profile)."""

    def __init__(self, reason: str, hw: HardwareConfig):
        gpus = f"{hw.total_gpus} GPU{'s' if hw.total_gpus > 1 else ''}"
        super().__init__(f"{reason} (hardware={hw.name}: {gpus})")
        self.reason = reason


def _start_micro_batch(job: Job) -> int:
    t = job.train
    if t.micro_batch_size is not None:
        return t.micro_batch_size
    per_rank = max(1, t.batch_size // job.hw.total_gpus)
    target = max(1, job.cal.default_tokens_per_micro_batch // job.seq_len)
    return max(job.objective.min_micro_batch, min(per_rank, target))


def _micro_batches(job: Job) -> list[int]:
    """Halving from the start down to 1, or to the objective's least micro-batch (KTO's 2)."""
    if job.train.micro_batch_size is not None:
        return [job.train.micro_batch_size]
    least = job.objective.min_micro_batch
    out, mbs = [], _start_micro_batch(job)
    while True:
        out.append(mbs)
        if mbs // 2 < least:
            return out
        mbs //= 2


def _choices(fixed: Optional[bool]) -> list[bool]:
    return [fixed] if fixed is not None else [False, True]


# From this length on the search weighs the long-context levers by itself (a sequence split, activation
# offloading; the "long context": 32k to 128k); below it they run when set. Their time terms (the
# exchanges, the PCIe round trip) are not measured on a GPU yet, so they do not displace the measured
# strategies of shorter jobs.
LONG_CONTEXT = 32768


def _sequence_splits(job: Job) -> list[tuple[int, str]]:
    """(degree, split) pairs to weigh: the user's, or no split and, from LONG_CONTEXT on, every split over
    every degree > 1 that divides the GPUs (the heads are checked with the model, `why_not_split`)."""
    t, gpus = job.train, job.hw.total_gpus
    splits = [t.sequence_split] if t.sequence_split is not None else list(SEQUENCE_SPLITS)
    if t.sequence_parallel is not None:
        return [(t.sequence_parallel, split) for split in splits]
    unsplit = [(1, splits[0])]
    if job.seq_len < LONG_CONTEXT:
        return unsplit
    return unsplit + [(n, split) for n in range(2, gpus + 1) if gpus % n == 0 for split in splits]


def _offloading_choices(job: Job) -> list[bool]:
    """Activation offloading: the user's; else weighed on a GPU from LONG_CONTEXT on (on the CPU it moves
    nothing anywhere)."""
    fixed = job.train.activation_offloading
    if fixed is not None:
        return [fixed]
    return [False, True] if job.hw.device == "cuda" and job.seq_len >= LONG_CONTEXT else [False]


def candidates(job: Job) -> tuple[list[Strategy], Optional[str]]:
    """Every strategy the user's open settings allow and the engine runs; and, when none does, why."""
    t, hw = job.train, job.hw
    multi = hw.total_gpus > 1
    engines = [t.engine] if t.engine is not None else list(SHARDED_ENGINES)
    shardings = [t.sharding] if t.sharding is not None else ([REPLICATED, *engines] if multi else [SINGLE])
    optimizers = (
        [job.method.optimizer]
        if job.method.optimizer is not None
        else (["adamw", "adamw_8bit"] if hw.device == "cuda" else ["adamw"])
    )
    chunked = DEFAULT_CHUNKED_LOSS if t.chunked_loss is None else t.chunked_loss
    # An objective whose loss is not next-token cross-entropy runs TRL's own (DPO's fused log-probs).
    chunked = chunked and job.objective.chunked_loss
    # A vision-language model's batches come from its processor and train with the model's own loss.
    chunked = chunked and not job.model.takes_images
    # A reference copy or precomputed log-probabilities: only full fine-tuning with a per-step reference has the choice.
    has_choice = job.reference_runs and job.method.spec.trains_base_weights
    precompute = _choices(job.precompute_reference) if has_choice else [False]
    out: list[Strategy] = []
    refused: Optional[str] = None
    for sharding, ckpt, mbs, optimizer, off_opt, off_params, pre, (
        degree,
        split,
    ), off_acts in itertools.product(
        shardings,
        _choices(t.activation_checkpointing),
        _micro_batches(job),
        optimizers,
        _choices(t.offload_optimizer),
        _choices(t.offload_params),
        precompute,
        _sequence_splits(job),
        _offloading_choices(job),
    ):
        s = Strategy(
            sharding=sharding,
            offload_optimizer=off_opt,
            offload_params=off_params,
            optimizer=optimizer,
            activation_checkpointing=ckpt,
            chunked_loss=chunked,
            micro_batch_size=mbs,
            precompute_reference=pre,
            sequence_parallel=degree,
            sequence_split=split,
            activation_offloading=off_acts,
        )
        how = s.split
        if how is not None and not getattr(s.engine, how.engine_needs) and t.sharding is None:
            continue  # the split's engine is another one: not a refusal, the search weighs that one too
        long_context, unsplit = job.seq_len >= LONG_CONTEXT, how is None
        path = attention.choose(
            t.attention,
            job.model,
            device=hw.device,
            packing=job.packing,
            split=not unsplit,
            long_context=long_context,
        )
        s = replace(s, attention=path)
        reason = why_not(s, job.method.name, hw.total_gpus) or why_not_split(
            s, job.model, s.attention, job.packing, hw.device
        )
        if reason is None:
            out.append(_with_accumulation(job, s))
        elif refused is None:
            refused = reason
    return out, refused


def _with_accumulation(job: Job, s: Strategy) -> Strategy:
    if job.train.grad_accum_steps is not None:
        return replace(s, grad_accum_steps=job.train.grad_accum_steps)
    ranks = s.mesh(job.hw.total_gpus).data_parallel  # the ranks of a sequence split share their sequences
    return replace(s, grad_accum_steps=max(1, math.ceil(job.train.batch_size / (s.micro_batch_size * ranks))))


def _usable_gb(hw: HardwareConfig, headroom: float) -> float:
    assert hw.gpu_memory_gb is not None
    return hw.gpu_memory_gb * (1.0 - headroom)


def _host_needed_gb(job: Job, s: Strategy, host_offloaded_per_gpu: float) -> float:
    """Host RAM per node at its peak: while training (offloaded state of every local rank) or while
    loading the model (`load_host_bytes`), whichever is larger, plus each rank's process. On a CPU the
    "GPU memory" is that same RAM and already counts the model."""
    per_node = job.hw.gpus_per_node
    held = host_offloaded_per_gpu * per_node
    if job.hw.device == "cuda":
        held = max(held, load_host_bytes(job, s))
    return held / GB + job.cal.host_gb_per_rank * per_node


def _fits(job: Job, s: Strategy, headroom: float) -> tuple[bool, Memory, float]:
    mem, host = memory(job, s)
    host_gb = _host_needed_gb(job, s, host)
    usable = _usable_gb(job.hw, headroom)
    ok = mem.total <= usable and load_gpu_bytes(job, s) / GB <= usable
    if job.hw.host_memory_gb is not None and job.hw.device == "cuda":
        ok = ok and host_gb <= job.hw.host_memory_gb
    return ok, mem, host_gb


def _seconds_per_token(job: Job, s: Strategy, mfu: Optional[float]) -> float:
    """The search's yardstick: the estimate's time per token (without a peak FLOP/s, the FLOPs it executes)."""
    e, _ = estimate(job, s, mfu)
    if e.tokens_per_second:
        return 1.0 / e.tokens_per_second
    return executed_flops_per_token(job, s) * (4.0 if s.offload_optimizer else 1.0)


def _preference(job: Job, s: Strategy, mfu: Optional[float]) -> tuple[Any, ...]:
    return (
        _seconds_per_token(job, s, mfu),
        s.sequence_parallel,  # without a time estimate a split's exchanges are not counted: the smallest wins
        s.activation_offloading,
        s.engine.shards,
        # the estimate does not tell the sharded engines apart: the table's order decides
        list(ENGINES).index(s.sharding),
        s.optimizer != "adamw",
        -s.micro_batch_size,
    )


def _savings_words(s: Strategy) -> str:
    """The strategy's optimizer and offload in a few words (the engine-choice reason)."""
    words = [s.optimizer + offload_words(s)]
    if s.activation_checkpointing:
        words.append("checkpointing")
    words.append(f"micro-batch {s.micro_batch_size}")
    return ", ".join(words)


def _engine_reason(job: Job, chosen: Strategy, fitting: list[tuple[Strategy, Memory]]) -> Optional[str]:
    """Why this sharded engine, when `train.engine` left the choice to the search: the others' best."""
    t, mfu = job.train, job.plan.mfu
    if t.engine is not None or t.sharding is not None or not chosen.engine.shards:
        return None
    mine = _seconds_per_token(job, chosen, mfu)
    parts = []
    for key in SHARDED_ENGINES:
        if key == chosen.sharding:
            continue
        other = ENGINES[key].short
        theirs = [(s, mem) for s, mem in fitting if s.sharding == key]
        if not theirs:
            parts.append(f"{other} has no strategy that fits")
            continue
        best, mem = min(theirs, key=lambda j: _preference(job, j[0], mfu))
        slower = _seconds_per_token(job, best, mfu) / mine
        if slower > 1 + 1e-9:
            parts.append(f"{other}'s fastest that fits is {slower:.2f}x slower ({_savings_words(best)})")
        else:
            parts.append(
                f"{other} fits as fast ({mem.total:,.1f} GB per GPU, {_savings_words(best)}); "
                f"{chosen.engine.short} is listed first"
            )
    return (
        f"engine: {chosen.engine.short} (train.engine unset, {' and '.join(SHARDED_ENGINES)} weighed): "
        + "; ".join(parts)
    )


def _describe(s: Strategy, gpus: int) -> list[tuple[str, Strategy]]:
    """Each memory saving a strategy uses, with the strategy that goes without it."""
    out = []
    if s.activation_checkpointing:
        out.append(("activation checkpointing", replace(s, activation_checkpointing=False)))
    e = s.engine
    if e.shards:
        whole = replace(s, sharding=REPLICATED, offload_optimizer=False, offload_params=False)
        out.append((f"{e.short} full shard across {gpus} GPUs", whole))
    if s.optimizer != "adamw" and not s.offload_optimizer:
        out.append(("8-bit optimizer states", replace(s, optimizer="adamw")))
    if s.offload_optimizer and e.offloads_optimizer_alone:
        out.append(("optimizer offload to CPU", replace(s, offload_optimizer=False, offload_params=False)))
    if s.offload_params:
        alone = e.offloads_optimizer_alone
        what = "parameter offload" if alone else "parameter, gradient and optimizer offload to CPU"
        out.append((what, replace(s, offload_params=False, offload_optimizer=alone)))
    if s.split is not None:
        out.append(
            (
                f"sequence split: {s.split.label} over {s.sequence_parallel} GPUs",
                replace(s, sequence_parallel=1),
            )
        )
    if s.activation_offloading:
        out.append(("activation offloading to host memory", replace(s, activation_offloading=False)))
    return out


def _forcing_term(before: Memory, after: Memory) -> str:
    """The memory term a saving shrank the most, with its two figures."""
    b, a = before.as_dict(), after.as_dict()
    name = max((k for k in b if k != "total"), key=lambda k: b[k] - a[k])
    return f"{name} {b[name]:,.1f} -> {a[name]:,.1f} GB"


def plan_on(job: Job) -> Plan:
    """The fastest strategy for the job on its hardware profile (or, when none fits, the smallest)."""
    hw, method, train, plan_cfg, cal = job.hw, job.method, job.train, job.plan, job.cal
    if hw.gpu_memory_gb is None:
        raise PlanError(
            f"hardware.gpu_memory_gb is unknown for profile {hw.name!r}; set it (hardware.gpu_memory_gb=24; "
            "hardware.peak_bf16_tflops and hardware.usd_per_gpu_hour add the time and the cost)"
        )
    usable = _usable_gb(hw, plan_cfg.headroom)
    runnable, refused = candidates(job)
    if not runnable:
        raise Unrunnable(refused or "no strategy", hw)
    judged = [(s, *_fits(job, s, plan_cfg.headroom)) for s in runnable]
    fitting = [j for j in judged if j[1]]
    reasons: list[str] = []
    if fitting:
        s, _, mem, host_gb = min(fitting, key=lambda j: _preference(job, j[0], plan_cfg.mfu))
        savings = _describe(s, hw.total_gpus)
        start = _start_micro_batch(job)
        if not savings and s.micro_batch_size == start:
            reasons.append(
                f"fits as configured: {mem.total:,.1f} GB of {usable:,.1f} GB usable{per_device(hw)}"
            )
        else:
            n = len(fitting)
            reasons.append(
                f"fastest of {n} strategies that fit with the headroom"
                if n > 1
                else "the one strategy that fits"
            )
        engine_reason = _engine_reason(job, s, [(j[0], j[2]) for j in fitting])
        if engine_reason:
            reasons.append(engine_reason)
        loading = load_gpu_bytes(job, s) / GB
        if loading:
            reasons.append(
                f"loading: each GPU holds the whole 4-bit base for a moment before ZeRO-3 partitions it "
                f"({loading:,.1f} GB of {usable:,.1f} GB usable)"
            )
        for what, without in savings:
            if why_not(without, method.name, hw.total_gpus) is None:
                other, _ = memory(job, _with_accumulation(job, without))
                line = f"{what}: {other.total:,.1f} -> {mem.total:,.1f} GB{per_device(hw)}"
                if (without.sequence_parallel, without.activation_offloading) != (
                    s.sequence_parallel,
                    s.activation_offloading,
                ):
                    fits = "fits" if other.total <= usable else f"does not fit in {usable:,.1f} GB"
                    line += f" (without it {fits}; the term it divides: {_forcing_term(other, mem)})"
                reasons.append(line)
        if s.split is None and job.seq_len >= LONG_CONTEXT:
            reasons.append(
                f"sequence split: none needed, each {job.seq_len:,}-token sequence fits on one GPU "
                f"(activations {mem.activations:,.1f} GB, overhead {mem.overhead:,.1f} GB)"
            )
        if s.micro_batch_size < start:
            bigger, _ = memory(job, _with_accumulation(job, replace(s, micro_batch_size=start)))
            reasons.append(
                f"micro-batch {s.micro_batch_size} with more gradient accumulation: "
                f"{bigger.total:,.1f} -> {mem.total:,.1f} GB{per_device(hw)}"
            )
    else:
        s, _, mem, host_gb = min(judged, key=lambda j: j[2].total)
        loading = load_gpu_bytes(job, s) / GB
        if mem.total > usable:
            reasons.append(_biggest_term(mem, usable, hw))
        if loading > usable:
            reasons.append(
                f"loading: ZeRO-3 quantizes the whole 4-bit base onto each GPU before it partitions it "
                f"({loading:,.1f} GB > {usable:,.1f} GB usable); FSDP2 quantizes on the host (train.engine=fsdp)"
            )
        if hw.host_memory_gb is not None and host_gb > hw.host_memory_gb:
            reasons.append(
                f"host memory: {host_gb:,.0f} GB per node (loading the model, or offload) "
                f"> {hw.host_memory_gb:,.0f} GB on {hw.name}"
            )
    if job.seq_len >= LONG_CONTEXT or train.attention is not None or s.attention != "sdpa":
        reasons.append(attention.describe(s, train.attention is not None))
    reasons.extend(
        note for note in [expert_storage_note(job.model), vision_note(job.model, job.method)] if note
    )
    loss = "the project's chunked loss" if s.chunked_loss else "TRL's fused LM head"
    default = train.chunked_loss is None
    if job.objective.full_logits:
        loss, default = f"TRL's {job.objective.trl_trainer.rpartition(':')[2]} on the whole logits", False
    if job.objective.head == "score":
        loss = "a score head (one value a sequence, no vocabulary logits)"
    reasons.append(f"loss: {loss}" + (" (the default)" if default else ""))
    if hw.host_memory_gb is None and hw.device == "cuda":
        reasons.append(
            f"host RAM of {hw.name} is not published: the {host_gb:,.0f} GB per node this needs "
            "(loading the model, offload) is not checked"
        )
    effective = s.micro_batch_size * s.grad_accum_steps * s.mesh(hw.total_gpus).data_parallel
    if effective != train.batch_size:
        reasons.append(f"effective batch {effective} sequences (train.batch_size={train.batch_size})")
    est, notes = estimate(job, s, plan_cfg.mfu)
    reasons.extend(notes)
    checkpoint_gb, export_gb = disk(job, s)
    counts = job.counts
    merge_host = (2.0 * counts.total) / GB + cal.host_gb_per_rank if method.uses_adapters else 0.0
    if hw.host_memory_gb is not None and merge_host > hw.host_memory_gb:
        reasons.append(
            f"merging the adapter needs the bf16 base in host RAM ({merge_host:.0f} GB > {hw.host_memory_gb:.0f} GB): "
            "merge on a larger host or serve the adapter"
        )
    return Plan(
        fits=bool(fitting),
        hardware=hw,
        params_total=counts.total,
        params_trainable=job.trainable,
        params_active=counts.active,
        strategy=s,
        gpu_memory=mem,
        host_memory_gb=host_gb,
        disk_checkpoint_gb=checkpoint_gb,
        disk_export_gb=export_gb,
        estimate=est,
        seq_len=job.seq_len,
        reasons=tuple(reasons),
        usable_gpu_memory_gb=usable,
        merge_host_memory_gb=merge_host,
    )


def per_device(hw: HardwareConfig) -> str:
    """How a memory figure is counted on this hardware: per GPU, or of the host's RAM on the CPU."""
    return " per GPU" if hw.device == "cuda" else " RAM"


def offload_words(s: Strategy) -> str:
    """What the strategy offloads, as a clause (", everything offloaded"), or nothing."""
    if s.offload_params:
        return ", parameters offloaded" if s.engine.offloads_optimizer_alone else ", everything offloaded"
    return ", optimizer offloaded" if s.offload_optimizer else ""


def _biggest_term(mem: Memory, usable: float, hw: HardwareConfig) -> str:
    terms = {k: v for k, v in mem.as_dict().items() if k != "total"}
    name, value = max(terms.items(), key=lambda kv: kv[1])
    return (
        f"does not fit even with every memory saving: {mem.total:.1f} GB{per_device(hw)} > {usable:.1f} GB usable; "
        f"largest term is {name} ({value:.1f} GB)"
    )


def try_plan(job: Job, **changes: Any) -> Optional[Plan]:
    """The plan of the job with `changes` (Job.but), or None when that variant cannot be planned."""
    try:
        return plan_on(job.but(**changes))
    except (PlanError, ConfigError):
        return None


def resolve_seq_len(model: ModelConfig, train: TrainConfig, seq_len: Optional[int]) -> int:
    value = seq_len if seq_len is not None else train.seq_len
    if value == "auto" or not isinstance(value, int):
        raise PlanError("train.seq_len=auto needs the data stage: run mode=data (or mode=all) first")
    if value > model.max_position_embeddings:
        raise PlanError(
            f"train.seq_len={value} exceeds model.max_position_embeddings={model.max_position_embeddings} of {model.name}"
        )
    return value


def check_model(model: ModelConfig, method: Optional[MethodConfig] = None) -> None:
    """Refuse, with one line, a mixture of experts the memory model does not describe: the sparse layers
    measured are Qwen3-MoE's and Mixtral's under LoRA and full fine-tuning (finetune/planner/activations.py),
    every layer sparse."""
    arch = ARCHITECTURES[model.architecture]
    if not (model.num_experts or arch.mixture_of_experts):
        return
    why = None
    if not arch.expert_parameters:
        why = f"{model.architecture}'s sparse layer was not measured (qwen3_moe's was)"
    elif model.dense_layers:
        why = f"its {model.dense_layers} dense layers among the sparse ones were not measured"
    elif model.shared_expert_intermediate_size:
        why = "a shared expert was not measured"
    elif method is not None and method.spec.quantized_base:
        why = _qlora_split(model, method)
    if why is not None:
        counts = count_params(model)
        raise PlanError(
            f"model {model.name}: a mixture of experts ({model.num_experts} experts, "
            f"{model.num_experts_per_token} routed per token; {counts.total:,} parameters, "
            f"{counts.active:,} active a token) is not planned: {why}"
        )


def _qlora_split(model: ModelConfig, method: MethodConfig) -> str:
    """Why QLoRA of a mixture of experts is refused: transformers' bitsandbytes integration replaces nn.Linear
    layers only (measured on the tiny Qwen3-MoE and Mixtral: attention became 4-bit, the fused 3-D experts and
    the router stayed bf16), so it quantizes attention alone."""
    counts = count_params(model)
    sparse = model.num_layers - model.dense_layers
    experts = expert_weights(LayerShape.of(model)) * sparse
    quantized = counts.linear - experts - sparse * model.num_experts * model.hidden_size
    saved = 1.5 * quantized / (2 * counts.total)  # 2 bytes a weight become about 0.5
    return (
        f"method={method.name}: bitsandbytes quantizes nn.Linear only, so {quantized:,} attention weights would be "
        f"4-bit and the fused experts' {experts:,} ({experts / counts.total:.1%} of all) stay 16-bit, saving "
        f"{saved:.1%} of the weights' memory (use method=lora)"
    )


__all__ = ["DEFAULT_CHUNKED_LOSS", "candidates", "check_model", "plan_on", "resolve_seq_len", "try_plan"]
