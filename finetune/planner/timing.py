"""Step time, run length and cost; disk sizes.

Time: the FLOPs a step executes over the device's dense bf16 peak times a
utilisation fitted per method to GPU measurements (calibration.json's
`cuda.utilisation`; `plan.mfu` overrides it). Executed FLOPs count every
matmul a token runs (2 a weight forward, 2 for the input gradient, 2 more for
a trained weight's gradient), causal attention, the forward again of every
layer under recomputation, and TRL's fused head's extra time (its backward
recomputes each tile; fitted as h x V FLOPs). Offload adds the CPU optimizer
and PCIe traffic. A sequence split adds its exchanges (Ulysses' all-to-alls, the ring's key/value passes)
over the GPUs' link, counted as not overlapped with compute; activation offloading adds the layer inputs'
PCIe round trip, counted likewise.
"""

from __future__ import annotations

from typing import Optional

from finetune.core.config import ModelConfig
from finetune.core.config.hardware import HOURS_PER_MONTH
from finetune.core.methods import METHODS
from finetune.planner.companions import flops_per_token as companion_flops_per_token
from finetune.planner.contract import GB, Estimate, Strategy
from finetune.planner.job import Job, rank_tokens, runtime
from finetune.planner.params import count_params
from finetune.planner.step import offloaded_activation_bytes

# Bandwidth a GPU's exchange with its peers gets, GB/s each way. Not measured here (no GPU): NVLink 4's
# 450 GB/s a direction on an H100/H200 at the about one third all-to-alls reach in nccl-tests' alltoall_perf
# on 8 GPUs; PCIe Gen5 x16's 64 GB/s at a half. A setting a GPU check should replace with a measurement.
LINK_GB_PER_S = {"nvlink": 150.0, "pcie": 32.0}


def exchange_seconds(job: Job, s: Strategy) -> float:
    """A micro-batch's sequence-split exchanges on one rank: every layer's attention tensors in the forward,
    the backward (their gradients) and, under checkpointing, the recomputed forward."""
    split = s.split
    if split is None:
        return 0.0
    m = job.model
    passes = 3 if s.activation_checkpointing else 2
    per_token = split.exchanged_per_token(
        m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, s.sequence_parallel
    )
    values = per_token * rank_tokens(job, s) * m.num_layers * passes
    link = LINK_GB_PER_S.get(job.hw.interconnect or "pcie", LINK_GB_PER_S["pcie"])
    return runtime(job, s).compute * values / (link * GB)


def model_flops_per_token(model: ModelConfig, method: str, seq_len: int) -> float:
    """FLOPs a token needs (MFU's numerator): matmuls and causal attention, no recomputation.

    A weight costs the method's `flops_per_weight`: 6 when it trains (forward, input and weight gradients),
    4 when frozen (LoRA, QLoRA; the adapters' own are negligible); every layer's linear weights and the LM head (the input
    embedding is a lookup). Attention: 4 x seq x H x d a layer forward, causal halves it, x3 with backward.
    """
    c = count_params(model)
    per_weight = METHODS[method].flops_per_weight
    if model.num_experts:  # only the routed experts run: attention, router and k of the experts
        routed = c.linear_per_layer - (model.num_experts - model.num_experts_per_token) * _expert(model)
        matmul = routed * model.num_layers + c.head
    else:
        matmul = c.linear + c.head
    attention = 6.0 * model.num_layers * seq_len * model.num_heads * model.head_dim
    return per_weight * matmul + attention


def _expert(model: ModelConfig) -> int:
    i = model.expert_intermediate_size
    return 3 * model.hidden_size * i


def executed_flops_per_token(job: Job, s: Strategy) -> float:
    """What the GPU executes a token: the model FLOPs, the recomputed forward of each layer under
    checkpointing, and TRL's fused head's extra (`trl_loss_extra_hv_flops` x h x V)."""
    m = job.model
    flops = model_flops_per_token(m, job.method.name, job.seq_len)
    if s.activation_checkpointing:
        flops += 2.0 * job.counts.linear + 2.0 * m.num_layers * job.seq_len * m.num_heads * m.head_dim
    if job.objective.head == "score":  # a score head runs h x 1, not the LM head's V x h
        per_weight = METHODS[job.method.name].flops_per_weight
        flops -= per_weight * (count_params(m).head - job.counts.head)
    elif not s.chunked_loss:
        flops += job.device.trl_loss_extra_hv_flops * m.hidden_size * m.vocab_size
    companions = sum(companion_flops_per_token(c, job.seq_len) for c in job.companions)
    return flops + reference_flops_per_token(job, s) + companions


def reference_flops_per_token(job: Job, s: Strategy) -> float:
    """The forwards under no_grad a trained token: the reference model's (DPO: one, KTO: two,
    `reference_forwards`), 2 FLOPs a weight plus attention each, every step, or with precomputed
    log-probabilities once over the data before training, spread over the run's tokens (once per epoch of
    them: 1 / epochs), or a `when_kl` reference's one in the rollout; and the policy's own beside the trained
    one (KTO's KL estimate, `policy_extra_forwards`), every step."""
    m = job.model
    forward = 2.0 * job.counts.linear + 2.0 * m.num_layers * job.seq_len * m.num_heads * m.head_dim
    policy = job.objective.policy_extra_forwards * forward
    if job.kl_reference:  # the rollout's reference log-probabilities of every trained completion
        return policy + forward
    if not job.reference_runs:
        return policy
    reference = job.objective.reference_forwards * forward
    if not s.precompute_reference:
        return policy + reference
    return policy + reference / max(1.0, float(job.train.epochs))


def utilisation(job: Job, override: Optional[float]) -> Optional[float]:
    """The fraction of peak the estimate assumes: `plan.mfu` when set, else the figure fitted for the method."""
    if override is not None:
        return override
    return job.device.utilisation.get(job.method.name)


def estimate(job: Job, s: Strategy, override: Optional[float] = None) -> tuple[Estimate, list[str]]:
    notes: list[str] = []
    hw = job.hw
    util = utilisation(job, override)
    if hw.peak_bf16_tflops is None or util is None:
        why = "no peak FLOP/s" if hw.peak_bf16_tflops is None else f"no fitted utilisation for {hw.device}"
        return Estimate(None, None, None, None), [f"no time estimate: profile {hw.name} has {why}"]
    tokens_per_second = util * hw.peak_bf16_tflops * 1e12 * hw.total_gpus / executed_flops_per_token(job, s)
    # Every example's sequences (DPO: chosen and rejected) go through the model; the ranks of a sequence
    # split share each sequence, data-parallel ranks each take their own.
    step_tokens = (
        s.micro_batch_size
        * job.sequences
        * s.grad_accum_steps
        * s.mesh(hw.total_gpus).data_parallel
        * job.seq_len
    )
    step_seconds = step_tokens / tokens_per_second
    shards = s.mesh(hw.total_gpus).state_shards
    if s.offload_optimizer:
        local = job.trainable / shards
        # The optimizer runs on the CPU and gradients/weights cross PCIe every step.
        step_seconds += local / job.cal.cpu_adam_params_per_s + 4.0 * local / (
            job.cal.offload_pcie_gb_per_s * GB
        )
        notes.append(
            "optimizer offload: the optimizer step runs on the CPU (the estimate includes it and PCIe)"
        )
    if s.offload_params:
        step_seconds += 3 * 2.0 * job.counts.total / shards / (job.cal.offload_pcie_gb_per_s * GB)
    micro_batches = s.grad_accum_steps
    if s.split is not None:
        step_seconds += micro_batches * exchange_seconds(job, s)
        notes.append(
            f"time: the sequence split's exchanges ({s.split.exchange.replace('_', '-')}) are counted as not "
            "overlapped with compute"
        )
    offloaded = offloaded_activation_bytes(job, s, runtime(job, s))
    if offloaded:
        step_seconds += micro_batches * 2.0 * offloaded / (job.cal.offload_pcie_gb_per_s * GB)
        notes.append(
            "time: activation offloading's PCIe round trip of the layer inputs is counted as not overlapped"
        )
    tokens_per_second = step_tokens / step_seconds
    t = job.train
    run_tokens: Optional[float] = None
    if t.max_steps > 0:
        run_tokens = float(t.max_steps * step_tokens)
    elif t.dataset_tokens is not None:
        run_tokens = t.epochs * t.dataset_tokens
    else:
        notes.append(
            "no run-length estimate: set train.max_steps or train.dataset_tokens, or run mode=data first"
        )
    if run_tokens is None:
        return Estimate(tokens_per_second, step_seconds, None, None), notes
    hours = run_tokens / tokens_per_second / 3600.0
    usd = None if hw.usd_per_month is None else hours * hw.usd_per_month * hw.nodes / HOURS_PER_MONTH
    return Estimate(tokens_per_second, step_seconds, hours, usd), notes


def disk(job: Job, s: Strategy) -> tuple[float, float]:
    """(one resumable checkpoint, the export) in GB: the trained weights as stored, a master copy where the
    engine keeps one (ZeRO-3), and the optimizer's moments."""
    rt = runtime(job, s)
    if rt.engine.deepspeed and rt.compute == 2:
        per = 2.0 + 4.0 + (2.0 if s.optimizer != "adamw" else 8.0)
    else:
        param = rt.full_weights if job.method.spec.trains_base_weights else rt.adapter_storage
        per = param + (2.0 if s.optimizer != "adamw" else 2.0 * param)
    checkpoint = per * job.trainable
    n = job.counts.total
    # the merged bf16 model, and the adapter
    export = 2.0 * n + 2.0 * job.adapter if job.method.uses_adapters else 2.0 * n
    return checkpoint / GB, export / GB
