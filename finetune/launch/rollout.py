"""Where an objective that generates (GRPO) samples its completions: rollout.json, and the training plan beside it.

The pipeline calls `plan_generation` for every objective whose description says `generates`; this module
reads that objective's own settings (the `objective` section: the rollout's shape,
`num_generations`, `max_completion_length`, `steps_per_generation`, `generation`), so the pipeline never
names one objective's settings. The pure arithmetic is `finetune/planner/rollout.py`; here are the run
directory's facts (the data stage's prompt lengths) and the re-planned training side:

- colocate: training planned on what vLLM leaves of each GPU;
- server: training planned on the GPUs the server leaves (one node), so its batch and accumulation are
  those of the ranks that train; the launcher starts `trl vllm-serve` on the others (`vllm_server.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.config import Config, HardwareConfig
from finetune.core.errors import PlanError
from finetune.modeling import companions
from finetune.planner import Plan, make_job, rollout, runtime
from finetune.planner.contract import GB
from finetune.planner.weights import generation_gathered

# The training side planned on other hardware (fewer GPUs, or what vLLM leaves of each).
Replan = Callable[[HardwareConfig], Plan]


def settings(cfg: Config) -> Any:
    """The generating objective's settings (the `objective` section: GRPO's rollout fields)."""
    if not cfg.objective.generates:
        raise PlanError(f"objective={cfg.objective.name} does not generate here: it has no rollout")
    return cfg.objective


def _prompt_lengths(run_dir: Optional[Path]) -> dict[str, Any]:
    """The data stage's rendered prompt lengths of the train split (p95, max), when it ran."""
    stats = run_dir / rundir.DATA_STATS_FILE if run_dir is not None else None
    if stats is None or not stats.is_file():
        return {}
    return dict(json.loads(rundir.read_own_text(stats)).get("splits", {}).get("train", {}))


def training_rows(cfg: Config, run_dir: Optional[Path], seq_len: int) -> tuple[int, Optional[str]]:
    """The tokens of one training row, and why where it is not `seq_len`. TRL's GRPOTrainer pads each batch's
    prompts to the longest of them and its completions to the longest sampled, and the policy's forward runs
    over those rows only: at most the longest prompt the data stage kept plus `max_completion_length`
    (train.seq_len bounds them; before the data stage ran it is all that is known)."""
    longest = _prompt_lengths(run_dir).get("max")
    if not longest:
        return seq_len, None
    rows = settings(cfg).rollout_rows(seq_len, int(longest) + settings(cfg).max_completion_length)
    if rows >= seq_len:
        return seq_len, None
    why = (
        f"{cfg.objective.name.upper()} rows: the longest prompt ({int(longest)} tokens) + max_completion_length "
        f"({settings(cfg).max_completion_length}) = {rows} tokens, planned instead of train.seq_len={seq_len}"
    )
    return rows, why


def rollout_jobs(cfg: Config, run_dir: Optional[Path], plan: Plan) -> list[rollout.RolloutJob]:
    """One job for each model that samples (the settings' `samplers`: the policy, or a companion such as a
    distillation teacher with its own weights and KV cache), its time per step weighted by its share of rounds."""
    s, layout = plan.strategy, plan.layout
    gen = settings(cfg)
    steps_per_generation = gen.steps_per_generation or s.grad_accum_steps
    # the data stage's prompts (p95 of their rendered lengths) when it ran, else the rest of seq_len
    prompt_tokens = _prompt_lengths(run_dir).get("p95")
    if not prompt_tokens:
        prompt_tokens = max(1, plan.seq_len - gen.max_completion_length)
    models = {"policy": cfg.model, **{c.role: c.model for c in companions.shapes(cfg)}}
    return [
        rollout.rollout_job(
            models[who],
            gen,
            generation_batch_size=s.micro_batch_size * layout.world_size * steps_per_generation,
            prompt_tokens=int(prompt_tokens),
            # below 1 where a step takes several rounds (distillation samples each micro-batch)
            steps_per_generation=steps_per_generation / s.grad_accum_steps / share,
        )
        for who, share in gen.samplers()
    ]


def rollout_job(cfg: Config, run_dir: Optional[Path], plan: Plan) -> rollout.RolloutJob:
    """The rollout of the largest model that samples (GRPO's: the policy, the only one)."""
    return max(rollout_jobs(cfg, run_dir, plan), key=lambda job: job.weight_bytes)


def _colocated(cfg: Config, plan: Plan, replan: Replan) -> Plan:
    """Colocated with vLLM on CUDA: the training side re-planned on what vLLM leaves of each GPU, so the
    planner's micro-batch and checkpointing fit beside it. Unchanged when colocate is not asked, off CUDA,
    or when no colocated plan fits (the rollout plan then weighs a server split)."""
    hw = cfg.hardware
    if hw.device != "cuda" or settings(cfg).generation in ("transformers", "server") or not hw.gpu_memory_gb:
        return plan
    job = rollout_job(cfg, None, plan)
    share = rollout.colocate_share(job, plan.layout.world_size, hw.gpu_memory_gb * GB)
    if share >= 1:
        return plan
    budget = replace(hw, gpu_memory_gb=hw.gpu_memory_gb * (1 - share))
    beside = replan(budget)
    if not beside.fits:
        return plan
    why = f"GRPO colocate: training planned on {budget.gpu_memory_gb:.1f} GB a GPU, vLLM takes {share:.2f} of it"
    return replace(beside, hardware=hw, reasons=(why, *beside.reasons))


def _beside_server(cfg: Config, plan: Plan, result: rollout.RolloutPlan, replan: Replan) -> Plan:
    """A server split: the training side on the GPUs the server leaves, the hardware profile kept whole
    (the machine holds both sides). One node: the server and the trainer share its GPUs."""
    hw = cfg.hardware
    if hw.nodes > 1:
        raise PlanError(
            f"objective.generation=server on {hw.nodes} nodes: the launcher splits one node's GPUs between "
            "`trl vllm-serve` and the trainer; use one node, or objective.generation=colocate"
        )
    beside = replan(replace(hw, gpus_per_node=result.train_gpus))
    why = (
        f"GRPO server split: training on {result.train_gpus} of {hw.gpus_per_node} GPUs, "
        f"`trl vllm-serve` on {result.server_gpus}"
    )
    return replace(beside, hardware=hw, reasons=(why, *beside.reasons)).with_processes(result.train_gpus, 1)


def _rollout_plan(cfg: Config, run_dir: Path, plan: Plan) -> rollout.RolloutPlan:
    """The training side is the plan's per-GPU peak (micro-batches of completions at train.seq_len), taken as
    the same on fewer GPUs: exact for one process and DDP, an underestimate for a sharded engine. The policy's
    own generation adds what the engine gathers for it (ZeRO-3: the whole model on each rank), and so does a
    companion's."""
    hw = cfg.hardware
    peak = plan.gpu_memory.total * GB
    policy = make_job(
        cfg.model, cfg.method, plan.hardware, cfg.train, plan.seq_len, objective=cfg.objective.spec
    )
    rt = runtime(policy, plan.strategy)
    results = [
        rollout.plan_rollout(
            job,
            device=hw.device,
            gpus=plan.layout.world_size,
            gpu_bytes=(hw.gpu_memory_gb or 0) * GB,
            hbm_bytes_per_s=hw.hbm_tb_per_s * 1e12 if hw.hbm_tb_per_s else None,
            train_peak=lambda n: peak,
            # the target machine's vLLM cannot be seen from here: on CUDA the plan assumes it is installed
            vllm_available=hw.device == "cuda",
            requested=settings(cfg).generation,
            batch_size=cfg.train.batch_size,
            gathered_bytes=generation_gathered(
                policy, plan.strategy, rt, companion_bytes=None if who == "policy" else job.weight_bytes
            ),
            vllm_modes=settings(cfg).samples_with_vllm,
        )
        for job, (who, _) in zip(rollout_jobs(cfg, run_dir, plan), settings(cfg).samplers())
    ]
    if len(results) == 1:
        return results[0]
    # several models sample in turn (inside the trainer): the larger KV cache at a time, their times added
    worst = max(results, key=lambda r: r.train_peak_bytes)
    times = [r.generation_s_per_step for r in results]
    return replace(
        worst,
        fits=all(r.fits for r in results),
        generation_s_per_step=None if None in times else sum(t for t in times if t is not None),
    )


def training_plan(cfg: Config, plan: Plan, replan: Replan) -> Plan:
    """Before the layout is set: the training side colocated beside vLLM where that is asked or chosen."""
    return _colocated(cfg, plan, replan)


def plan_generation(
    cfg: Config, run_dir: Path, plan: Plan, replan: Replan
) -> tuple[Plan, rollout.RolloutPlan]:
    """Where the rollout runs and what it holds, into rollout.json; the plan with the training ranks a
    server split leaves (unchanged otherwise)."""
    result = _rollout_plan(cfg, run_dir, plan)
    if result.mode == "server" and result.fits:
        plan = _beside_server(cfg, plan, result, replan)
    elif not result.fits:
        # the rollout is part of the job: a plan whose generation cannot fit does not fit (launch refuses it)
        plan = replace(
            plan,
            fits=False,
            reasons=(f"rollout does not fit: {result.reason}", *plan.reasons),
            suggestions=(result.alternative, *plan.suggestions) if result.alternative else plan.suggestions,
        )
    rundir.write_json(run_dir / rundir.ROLLOUT_FILE, asdict(result))
    return plan, result


def describe(result: rollout.RolloutPlan) -> str:
    return f"rollout: {result.reason}" + ("" if result.fits else f"; does not fit: {result.alternative}")
