"""GRPO's rollout side of the plan: where generation runs, what it holds on each GPU, how long it takes.

Pure, in bytes. Three modes (TRL's): `transformers` (generation inside the trainer: the CPU, or CUDA
without vLLM; its KV cache is counted on the training side), `colocate` (vLLM inside every training
process: a share of each GPU, `vllm_gpu_memory_utilization`, holds a whole bf16 copy of the weights and
the KV cache of that rank's generations in flight; training gets the rest), `server` (`trl vllm-serve`
on GPUs of its own: tensor parallel until the weights and KV cache fit, the other GPUs train).

The choice on CUDA with vLLM: colocate when both sides fit one GPU (no GPU idles while the other side
works), else the smallest server that holds the model, if the training side fits what remains; else
refused, with what would make it fit.

Generation time: decoding is bound by memory bandwidth once everything fits (each new token reads
the weights and the KV cache written so far), so a decoding step takes (weight bytes per GPU + KV bytes
read) / (HBM bandwidth x `DECODE_BANDWIDTH_EFFICIENCY`). The prefill (compute-bound, one pass over the
prompts) is not counted; a stated simplification.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

from finetune.core.config import ModelConfig
from finetune.core.config.grpo import GRPOObjective
from finetune.planner.params import count_params

# Not measured (no vLLM measurement on a GPU yet): vLLM's own working memory
# beside weights and KV cache (its profiling run's activations, CUDA graphs, the sampler), taken as
# 2 GB per GPU, and decoding reaching 60% of HBM bandwidth. Measure both on a GPU with vLLM.
VLLM_OVERHEAD_BYTES = 2e9
DECODE_BANDWIDTH_EFFICIENCY = 0.6
# `trl vllm-serve --gpu-memory-utilization` default: the share of a server GPU vLLM may take.
SERVER_GPU_MEMORY_UTILIZATION = 0.9
# colocate shares are chosen in steps of 5% of a GPU.
SHARE_STEP = 0.05


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """Keys and values of every layer for one token (bf16 by default)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes


@dataclass(frozen=True)
class RolloutJob:
    """What the rollout generates and with which model."""

    weight_bytes: float
    """The served model's weights (bf16: 2 bytes a parameter; adapters merged in)."""
    kv_bytes_per_token: int
    generation_batch_size: int
    """Completions sampled per generation round, all ranks together (prompts x num_generations)."""
    prompt_tokens: int
    completion_tokens: int
    steps_per_generation: float
    """Optimizer steps trained on one generation round (below 1: rounds a step; over the share of rounds this
    model samples where another samples the rest)."""
    num_kv_heads: int
    """Tensor parallelism splits the KV heads: its degree must divide them."""

    def kv_bytes(self, sequences: float) -> float:
        """KV cache of `sequences` generations at full length (prompt + completion)."""
        return sequences * (self.prompt_tokens + self.completion_tokens) * self.kv_bytes_per_token


@dataclass(frozen=True)
class RolloutPlan:
    mode: str
    """transformers | colocate | server."""
    fits: bool
    train_gpus: int
    server_gpus: int = 0
    tensor_parallel: int = 1
    data_parallel: int = 1
    vllm_bytes_per_gpu: float = 0.0
    """What vLLM needs on each GPU it runs on (weights share + KV cache + its overhead)."""
    vllm_gpu_memory_utilization: Optional[float] = None
    """colocate: the share of each GPU given to vLLM; server: what `trl vllm-serve` is given."""
    train_budget_bytes: float = 0.0
    """What training may use on each training GPU."""
    train_peak_bytes: float = 0.0
    generation_s_per_step: Optional[float] = None
    reason: str = ""
    alternative: str = ""


def rollout_job(
    model: ModelConfig,
    grpo: GRPOObjective,
    generation_batch_size: int,
    prompt_tokens: int,
    steps_per_generation: float,
) -> RolloutJob:
    """The rollout of `model` under `grpo`: bf16 weights and KV cache (what TRL's vLLM paths serve)."""
    return RolloutJob(
        weight_bytes=2.0 * count_params(model).total,
        kv_bytes_per_token=kv_bytes_per_token(model),
        generation_batch_size=generation_batch_size,
        prompt_tokens=prompt_tokens,
        completion_tokens=grpo.max_completion_length,
        steps_per_generation=steps_per_generation,
        num_kv_heads=model.num_kv_heads,
    )


def decode_seconds(
    job: RolloutJob, weight_bytes_per_gpu: float, sequences_per_gpu: float, hbm_bytes_per_s: float
) -> float:
    """Time to decode one generation round: `completion_tokens` steps, each reading the weights on a GPU
    and the KV cache so far (on average the prompt plus half the completion) of its sequences."""
    average_context = job.prompt_tokens + job.completion_tokens / 2
    kv_read = sequences_per_gpu * average_context * job.kv_bytes_per_token
    per_token = (weight_bytes_per_gpu + kv_read) / (hbm_bytes_per_s * DECODE_BANDWIDTH_EFFICIENCY)
    return job.completion_tokens * per_token


def _per_step(job: RolloutJob, round_s: float) -> float:
    return round_s / job.steps_per_generation


def colocate_bytes(job: RolloutJob, gpus: int) -> float:
    """vLLM's need on each GPU in colocate mode: a whole weight copy, the KV cache of that rank's share of
    the round, its overhead."""
    return job.weight_bytes + job.kv_bytes(job.generation_batch_size / gpus) + VLLM_OVERHEAD_BYTES


def colocate_share(job: RolloutJob, gpus: int, gpu_bytes: float) -> float:
    """The share of each GPU given to vLLM (`vllm_gpu_memory_utilization`), rounded up to 5%."""
    return round(math.ceil(colocate_bytes(job, gpus) / gpu_bytes / SHARE_STEP - 1e-9) * SHARE_STEP, 2)


def _colocate(
    job: RolloutJob, gpus: int, gpu_bytes: float, hbm: Optional[float], train_peak: Callable[[int], float]
) -> RolloutPlan:
    sequences = job.generation_batch_size / gpus
    need = colocate_bytes(job, gpus)
    share = colocate_share(job, gpus, gpu_bytes)
    budget = (1 - share) * gpu_bytes
    peak = train_peak(gpus)
    fits = share < 1 and peak <= budget
    gen = _per_step(job, decode_seconds(job, job.weight_bytes, sequences, hbm)) if hbm else None
    reason = (
        f"colocate: vLLM takes {share:.2f} of each GPU ({need / 1e9:.1f} GB: weights "
        f"{job.weight_bytes / 1e9:.1f} GB, KV cache of {sequences:g} generations "
        f"{job.kv_bytes(sequences) / 1e9:.2f} GB, overhead {VLLM_OVERHEAD_BYTES / 1e9:.0f} GB); "
        f"training needs {peak / 1e9:.1f} GB of the {budget / 1e9:.1f} GB left"
    )
    return RolloutPlan(
        "colocate",
        fits,
        train_gpus=gpus,
        vllm_bytes_per_gpu=need,
        vllm_gpu_memory_utilization=round(share, 2),
        train_budget_bytes=budget,
        train_peak_bytes=peak,
        generation_s_per_step=gen,
        reason=reason,
    )


def _server(
    job: RolloutJob,
    gpus: int,
    gpu_bytes: float,
    hbm: Optional[float],
    train_peak: Callable[[int], float],
    batch_size: Optional[int] = None,
) -> RolloutPlan:
    """The smallest tensor-parallel server that holds the weights and the KV cache of a whole round; then
    data-parallel replicas of it until the GPUs left to train divide `batch_size` (TRL's 8 GPUs: 4 + 4), so
    every training rank holds the same share of whole groups and no GPU idles."""
    usable = SERVER_GPU_MEMORY_UTILIZATION * gpu_bytes
    for tp in (1, 2, 4, 8, 16):
        if tp >= gpus:
            break
        if job.num_kv_heads % tp:
            continue
        need = job.weight_bytes / tp + job.kv_bytes(job.generation_batch_size) / tp + VLLM_OVERHEAD_BYTES
        if need > usable:
            continue
        dp = 1
        while batch_size and gpus - tp * (dp + 1) > 0 and batch_size % (gpus - tp * dp):
            dp += 1
        server_gpus = tp * dp
        train_gpus = gpus - server_gpus
        if batch_size and batch_size % train_gpus:
            return RolloutPlan(
                "server",
                False,
                train_gpus=0,
                reason=f"server: no split of {gpus} GPUs into a tensor-parallel-{tp} server and training ranks "
                f"that divide train.batch_size={batch_size}",
            )
        peak = train_peak(train_gpus)
        gen = (
            _per_step(
                job, decode_seconds(job, job.weight_bytes / tp, job.generation_batch_size / server_gpus, hbm)
            )
            if hbm
            else None
        )
        replicas = f" x {dp} data-parallel replicas" if dp > 1 else ""
        reason = (
            f"server: `trl vllm-serve` on {server_gpus} GPU(s) (tensor parallel {tp}{replicas}: weights "
            f"{job.weight_bytes / tp / 1e9:.1f} GB + KV cache {job.kv_bytes(job.generation_batch_size) / tp / 1e9:.2f} GB "
            f"+ overhead a GPU), training on {train_gpus}: {peak / 1e9:.1f} GB of {gpu_bytes / 1e9:.1f} GB"
        )
        return RolloutPlan(
            "server",
            peak <= gpu_bytes,
            train_gpus=train_gpus,
            server_gpus=server_gpus,
            tensor_parallel=tp,
            data_parallel=dp,
            vllm_bytes_per_gpu=need,
            vllm_gpu_memory_utilization=SERVER_GPU_MEMORY_UTILIZATION,
            train_budget_bytes=gpu_bytes,
            train_peak_bytes=peak,
            generation_s_per_step=gen,
            reason=reason,
        )
    return RolloutPlan(
        "server",
        False,
        train_gpus=0,
        reason=f"server: no tensor-parallel size below {gpus} GPUs holds the {job.weight_bytes / 1e9:.1f} GB "
        f"of weights and the KV cache on {usable / 1e9:.1f} GB a GPU",
    )


def plan_rollout(
    job: RolloutJob,
    *,
    device: str,
    gpus: int,
    gpu_bytes: float,
    hbm_bytes_per_s: Optional[float],
    train_peak: Callable[[int], float],
    vllm_available: bool,
    requested: str = "auto",
    batch_size: Optional[int] = None,
    gathered_bytes: float = 0.0,
    vllm_modes: bool = True,
) -> RolloutPlan:
    """Where the rollout runs. `train_peak(n)`: the training side's peak on each GPU when `n` GPUs train
        (the planner's SFT model on `generation_batch_size` x (prompt + completion) tokens, plus the reference
        model when `beta > 0`). `requested`: objective.generation (`auto` lets this choose). `batch_size`: completions
    a step over the training ranks (train.batch_size), which a server split's training GPUs divide.
    `gathered_bytes`: what generating inside the trainer gathers on each rank beyond the training side's weights
    (ZeRO-3 gathers the whole model: `weights.generation_gathered`). `vllm_modes`: the objective can sample with
    vLLM and in groups (GRPO's `generation` and `num_generations`; distillation samples inside its trainer only)."""
    if device != "cuda" or not vllm_available or requested == "transformers":
        asked = "asked for" if vllm_modes else "the objective's trainer samples itself"
        why = "no CUDA" if device != "cuda" else ("vLLM not installed" if not vllm_available else asked)
        peak = train_peak(gpus) + job.kv_bytes(job.generation_batch_size / gpus) + gathered_bytes
        gathered = (
            f"; the engine gathers the whole model on each rank to generate (+{gathered_bytes / 1e9:.1f} GB)"
            if gathered_bytes
            else ""
        )
        gen = (
            _per_step(
                job, decode_seconds(job, job.weight_bytes, job.generation_batch_size / gpus, hbm_bytes_per_s)
            )
            if hbm_bytes_per_s
            else None
        )
        return RolloutPlan(
            "transformers",
            device != "cuda" or peak <= gpu_bytes,
            train_gpus=gpus,
            train_budget_bytes=gpu_bytes,
            train_peak_bytes=peak,
            generation_s_per_step=gen,
            reason=f"transformers' generation inside the trainer ({why}); its KV cache is on the training side"
            + gathered,
            alternative=", ".join(
                ["objective.generation=colocate or server (vLLM)"] * vllm_modes
                + ["train.engine=fsdp (FSDP2 gathers a layer at a time)"] * bool(gathered_bytes)
                + ["or a shorter max_completion_length" + " or fewer num_generations" * vllm_modes]
            ),
        )
    colocate = _colocate(job, gpus, gpu_bytes, hbm_bytes_per_s, train_peak)
    smaller = "QLoRA, a shorter max_completion_length or fewer num_generations"
    if requested != "server" and (colocate.fits or requested == "colocate"):
        if colocate.fits:
            return colocate
        return replace(
            colocate, alternative=f"objective.generation=server on more than one GPU, or {smaller}"
        )
    if gpus == 1:
        if requested == "server":
            return replace(
                colocate,
                mode="server",
                fits=False,
                reason="server: needs GPUs of its own beside training; 1 GPU",
                alternative="objective.generation=colocate",
            )
        return replace(colocate, alternative=f"a server split on more GPUs, or {smaller}")
    server = _server(job, gpus, gpu_bytes, hbm_bytes_per_s, train_peak, batch_size)
    if server.fits:
        if requested == "auto":
            return replace(server, reason=f"{server.reason} (colocate does not fit: {colocate.reason})")
        return server
    return replace(server, alternative=f"neither split fits ({colocate.reason}); try more GPUs, {smaller}")
