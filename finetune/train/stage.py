"""The training stage: load per method, evaluate the base, train, save, evaluate again, write metrics.

    python -m finetune.train RUN_DIR          # one rank (what torchrun runs); reads config.yaml + plan.json

Reads the packed data the data stage wrote (`finetune.data.stage.load_prepared`),
trains with the plan's strategy, saves the adapter (`RUN_DIR/adapter`) or the
model (`RUN_DIR/model`) with the tokenizer and its identity (`finetune.modeling.outputs`: written
whole, then the export and evaluation made from another model moved aside), and writes
`RUN_DIR/metrics.json`: `train` {steps, final_loss, tokens_per_second, peak_memory_gb, planned_memory_gb,
run_id, output_identity, ...,
engine: {world_size, backend, wrapper, zero_stage, offload_optimizer, ranks[...]} (what really ran)}
and `eval` {base: {loss, exact_match, ...}, trained: {...}} on the held-out split.
Several ranks: rank 0 alone logs, evaluates and writes files; under ZeRO-3/FSDP (weights split
across ranks) the in-worker evaluation is skipped and left to the eval stage (mode=eval).

When a run dies: re-running resumes from the newest complete checkpoint (`resume`,
`finetune.rundir.checkpoints`); SIGTERM/SIGINT during training saves one at the next step and
exits 75 (`Preempted`); before and after the training loop (data and model loading, the
base and final evaluations) it stops at once, saves nothing and exits 75 too
(`interrupted_message` says where it stood); disk and RAM are checked first
(`finetune.rundir.preflight`); rank 0 holds the run directory's lock (`rundir.lock`), inherited
from the pipeline that launched it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import transformers

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import INTERRUPTED_EXIT_CODE, ConfigError, FinetuneError, is_disk_full
from finetune.core.secrets import install_log_filter
from finetune.data.stage import load_prepared
from finetune.evaluation import heldout, preference, rewards
from finetune.modeling import models, outputs
from finetune.planner import Plan
from finetune.rundir import checkpoints, preflight
from finetune.train import callbacks as cb
from finetune.train import dpo_trainer, grpo_trainer, sft_trainer, throughput
from finetune.train.base_trainer import engine_record, save_output
from finetune.train.profiling import StepProfiler

log = logging.getLogger(__name__)

# The module that builds each TRL trainer and its config (`ObjectiveSpec.trl_trainer`): `build_config`,
# `build_trainer`. An objective with a new trainer adds its module here.
TRAINERS = {"SFTTrainer": sft_trainer, "DPOTrainer": dpo_trainer, "GRPOTrainer": grpo_trainer}


def trainer_module(cfg: Config) -> Any:
    """The trainer module of `cfg.objective` (finetune/core/objectives.py names its TRL trainer)."""
    return TRAINERS[cfg.objective.spec.trl_trainer]


# What the worker is doing now, for the one line a signal leaves (`interrupted_message`).
phase = "starting"
# A run stopped by SIGTERM/SIGINT after saving its checkpoint exits with this (EX_TEMPFAIL,
# "try again later"); running the same command again resumes.
PREEMPTED_EXIT_CODE = INTERRUPTED_EXIT_CODE


def _final_loss(log_history: list[dict], key: str = "loss") -> Optional[float]:
    for entry in reversed(log_history):
        if key in entry:
            return float(entry[key])
    return None


# Below this many parameters a CPU run uses one thread (see `cpu_threads`).
SMALL_MODEL_PARAMS = 100_000_000


def cpu_threads(total_params: int) -> Optional[int]:
    """One intra-op thread for small models on the CPU, unless OMP_NUM_THREADS says otherwise.

    The tiny model's matmuls are too small to split across cores with profit, and
    on a shared machine a second OpenMP thread spin-waits for a busy core: measured
    on 2 shared cores, a LoRA step of 4 x 256 tokens took 0.16 s on one thread and
    2.5-10 s on two. Returns the thread count set, or None when left alone.
    """
    import torch

    if os.environ.get("OMP_NUM_THREADS") or total_params >= SMALL_MODEL_PARAMS:
        return None
    torch.set_num_threads(1)
    return 1


def release_memory() -> None:
    """Hand what evaluation left behind back before training: Python garbage, the CUDA cache, glibc's free heap.

    Generation allocates and frees many tensors of growing sizes (the KV cache); on the CPU the training
    loop that followed ran about 4% slower a step until glibc's fragmented free memory was trimmed
    (scripts/bench_overhead.py, BENCHMARKS.md). On CUDA the cached blocks would count in the reserved
    memory the plan is checked against.
    """
    import contextlib
    import ctypes
    import ctypes.util
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e9


@dataclass
class _Model:
    """The model as loaded for training, with the trainer's arguments built before it (`_load_model`)."""

    model: Any
    tokenizer: Any
    compute_dtype: Any
    args: Any  # the objective's TRL config (SFTConfig, DPOConfig)
    trainable: int
    total: int
    loaded_partitioned: bool
    # Preference pairs: the held-out log-probabilities of the model training started from (the reference).
    reference_log_probs: Optional[list] = None


@dataclass
class _Session:
    """The trainer, with the callbacks whose state the run reads back."""

    trainer: Any
    monitor: cb.RunMonitor
    early: cb.EarlyStop
    preemption: cb.Preemption
    profiler: Optional[StepProfiler]


@dataclass
class _Trained:
    """What training left for metrics.json: the resume point, the loop's seconds, the output and the engine."""

    resumed_from: Optional[str]
    seconds: float
    out_dir: Path
    engine: dict[str, Any]
    identity: Optional[outputs.Identity]  # of the saved output (rank 0, which writes it)
    run_id: str


def run(
    cfg: Config,
    run_dir: Union[str, Path],
    plan: Plan,
    *,
    datasets: Optional[tuple[Any, Any]] = None,
    max_generate: Optional[int] = 256,
) -> dict:
    """Train per `cfg` and `plan`; save; evaluate base vs trained; write and return metrics.json's content.

    `datasets` (train, eval) replaces the data stage's output (tests); `max_generate`
    caps the held-out prompts answered by generation (None: all).
    """
    run_dir = Path(run_dir)
    rank0 = is_rank_zero()
    run_id = uuid.uuid4().hex[:12]  # names this training process in metrics.json and the output's identity
    mismatch = _lock_and_precheck(cfg, run_dir, plan) if rank0 else None
    transformers.utils.logging.disable_progress_bar()
    throughput.check_runtime(cfg, plan.strategy.sharding)  # a lever this machine cannot run: one line, exit 2
    t0 = time.perf_counter()
    baseline_gb = _rss_gb()
    train_ds, eval_ds = _load_data(run_dir, datasets)
    loaded = _load_model(cfg, plan, run_dir)
    # Rank 0 alone evaluates, and only where it holds the whole model (one process, DDP); under
    # ZeRO-3/FSDP the weights are partitioned across ranks and the eval stage (mode=eval, run by
    # the pipeline after the launcher returns) scores the saved adapter or model instead.
    # sharded weights: no rank can evaluate the model alone
    in_worker_eval = rank0 and not plan.strategy.engine.shards
    # The base is scored after the loop where it is still there then (`_base_after_training`), before it
    # only where training changes it (full fine-tuning, or init_from's adapter trained further).
    base_first = in_worker_eval and not _base_after_training(cfg)
    session = _build_session(cfg, plan, run_dir, loaded, (train_ds, eval_ds), baseline_gb, rank0)
    try:
        resumed_from, complete = _agreed_resume_point(session.trainer, cfg, run_dir, rank0)
        if complete:
            return _already_trained(run_dir, resumed_from, rank0)
        base = _base_evaluation(cfg, loaded, eval_ds, max_generate) if base_first else None
        seconds = _train(session, resumed_from, run_dir)
    finally:
        session.preemption.uninstall()
    out_dir, engine, identity = _save_trained(cfg, run_dir, session.trainer, loaded, run_id, rank0)
    if in_worker_eval and not base_first:
        base = _base_evaluation(cfg, loaded, eval_ds, max_generate, adapter_off=True)
    scores = _final_evaluation(cfg, loaded, eval_ds, max_generate, in_worker_eval)
    trained = _Trained(resumed_from, seconds, out_dir, engine, identity, run_id)
    metrics = {
        "train": _train_metrics(cfg, plan, session, loaded, trained, t0, mismatch),
        "eval": {"base": base, "trained": scores} if in_worker_eval else _eval_skipped(plan, rank0),
    }
    # What an objective's trainer logs beyond the loss (GRPO's rewards and completions), when it says
    objective_metrics = getattr(trainer_module(cfg), "objective_metrics", None)
    if objective_metrics is not None:
        metrics["train"][cfg.objective.name] = objective_metrics(session.trainer.state.log_history)
    _write_metrics(session.trainer, run_dir, metrics)
    return metrics


def _lock_and_precheck(cfg: Config, run_dir: Path, plan: Plan) -> Optional[str]:
    """Rank 0: the run directory's lock, then the pre-checks; what launch.allow_mismatch=true let through."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.lock(run_dir)
    mismatch = _prechecks(cfg, run_dir, plan).mismatch
    if mismatch:
        log.warning("launch.allow_mismatch=true: training although %s", mismatch)
    return mismatch


def _load_data(run_dir: Path, datasets: Optional[tuple[Any, Any]]) -> tuple[Any, Any]:
    global phase
    phase = "loading the data"
    return datasets if datasets is not None else load_prepared(run_dir)


def _load_model(cfg: Config, plan: Plan, run_dir: Path) -> _Model:
    """Tokenizer, seed, the trainer's arguments, then the model per method (partitioned where ZeRO-3 loads it)."""
    global phase
    phase = "loading the model"
    tokenizer = models.load_tokenizer(cfg.model)
    transformers.set_seed(cfg.train.seed)  # the adapters' random init is part of the run's seed
    # The trainer's arguments before the model: under ZeRO-3 their live DeepSpeed config makes
    # from_pretrained load this rank's partition only (zero.Init), not the whole model per rank.
    # The tiny model is built (first use) before that: built under zero.Init it would be saved partitioned.
    models.model_source(cfg.model)
    args = trainer_module(cfg).build_config(cfg, plan, run_dir, models.training_dtype(cfg))
    _ = args.device  # joins the process group now: zero.Init partitions over it while loading
    if args.deepspeed:
        import deepspeed

        # deepspeed.comm over that group (accelerate sets it up itself on GPUs, not on CPU ranks)
        deepspeed.init_distributed(dist_backend="gloo" if cfg.hardware.device == "cpu" else "nccl")
    model, compute_dtype = models.load_for_training(cfg, sharded=plan.strategy.engine.shards)
    loaded_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    trainable, total = models.trainable_parameters(model)
    if cfg.hardware.device == "cpu":
        cpu_threads(total)
    log.info(
        "model: %s %s, %s of %s parameters trainable",
        cfg.method.name,
        cfg.model.name,
        f"{trainable:,}",
        f"{total:,}",
    )
    return _Model(model, tokenizer, compute_dtype, args, trainable, total, loaded_partitioned)


def _build_session(
    cfg: Config,
    plan: Plan,
    run_dir: Path,
    loaded: _Model,
    datasets: tuple[Any, Any],
    baseline_gb: float,
    rank0: bool,
) -> _Session:
    """The trainer with its callbacks: the run monitor, early stop, preemption, progress (and the profiler)."""
    monitor = cb.RunMonitor(cfg.hardware.device, plan.gpu_memory.total, baseline_gb=baseline_gb)
    early = cb.EarlyStop(cfg.train.loss_spike_factor, cfg.train.eval_rise_patience)
    preemption = cb.Preemption()
    trainer = trainer_module(cfg).build_trainer(
        cfg,
        plan,
        run_dir,
        loaded.model,
        loaded.tokenizer,
        *datasets,
        loaded.compute_dtype,
        callbacks=[monitor, early, preemption, cb.RichProgress(monitor)],
        monitor=monitor,
        args=loaded.args,
    )
    trainer.loaded_partitioned = loaded.loaded_partitioned
    profiler = (
        StepProfiler(cfg.hardware.device, run_dir if rank0 else None).attach(trainer)
        if cfg.train.profile
        else None
    )
    return _Session(trainer, monitor, early, preemption, profiler)


def _base_after_training(cfg: Config) -> bool:
    """Whether the base is scored after the loop, with the trained adapter switched off (PEFT's
    `disable_adapter`, as TRL's DPO reference is): adapters leave the base's weights as they were, unless
    the adapter trained is init_from's (the base then wore it). Not before the loop: on the CPU the steps
    that followed an evaluation ran slower than the same steps in a fresh process (a DPO step 10.8% slower
    than plain TRL's, -4.0% without it: scripts/bench_dpo_overhead.py, BENCHMARKS.md)."""
    return models.adapter_on_unchanged_base(cfg)


def _base_evaluation(
    cfg: Config, loaded: _Model, eval_ds: Any, max_generate: Optional[int], adapter_off: bool = False
) -> dict:
    """The base's scores: before the loop (then what evaluation left is handed back before training), or
    after it with the trained adapter switched off (`adapter_off`, `_base_after_training`)."""
    global phase
    # A signal here stops at once (the process's own handler): evaluation saves nothing.
    phase = "the base evaluation"
    if adapter_off:
        with loaded.model.disable_adapter():
            return _evaluate(cfg, loaded, eval_ds, max_generate=max_generate)
    base = _evaluate(cfg, loaded, eval_ds, max_generate=max_generate)
    release_memory()
    return base


def _evaluate(cfg: Config, loaded: _Model, eval_ds: Any, **generation: Any) -> dict:
    """The held-out scores of the model as it is now. Preference pairs add the preference metrics against
    the model training started from (`preference`): its log-probabilities, taken at the base evaluation."""
    if not preference.applies(eval_ds):
        reward_fns = rewards.for_objective(cfg)
        return heldout.evaluate(loaded.model, loaded.tokenizer, eval_ds, reward_fns=reward_fns, **generation)
    result, mine = preference.evaluate(
        loaded.model, loaded.tokenizer, eval_ds, cfg.dpo.beta, loaded.reference_log_probs, **generation
    )
    if loaded.reference_log_probs is None:
        loaded.reference_log_probs = mine
    return result


def _train(session: _Session, resumed_from: Optional[str], run_dir: Path) -> float:
    """The training loop, from `resumed_from` where given; its seconds. Stopped by a signal: `Preempted`."""
    global phase
    t_train = time.perf_counter()
    if resumed_from:
        log.info("resuming from %s", resumed_from)
        session.early.restore(resumed_from)
    # From here a signal finishes the step and saves a checkpoint (`Preemption`).
    phase = "training"
    session.preemption.install()
    trainer = session.trainer
    if cb.finish_from_final_checkpoint(trainer, resumed_from):  # never a step past the schedule's last
        return time.perf_counter() - t_train
    try:
        trainer.train(resume_from_checkpoint=resumed_from)
    except Exception as exc:
        # `checkpoints.verify` opened what the trainer reads; what fails to load before the first step
        # (an engine's shards) is still this checkpoint's fault: one line naming it and what to use instead.
        if (
            not resumed_from
            or session.monitor.steps_begun
            or isinstance(exc, FinetuneError)
            or is_disk_full(exc)
        ):
            raise
        raise unresumable(Path(resumed_from), exc) from None
    if session.preemption.received is not None:
        raise Preempted(
            session.preemption.received,
            trainer.state.global_step,
            getattr(trainer, "last_checkpoint", None),
            run_dir,
            resume_point=Path(resumed_from) if resumed_from else None,
        )
    return time.perf_counter() - t_train


def _save_trained(
    cfg: Config, run_dir: Path, trainer: Any, loaded: _Model, run_id: str, rank0: bool
) -> tuple[Path, dict, Optional[outputs.Identity]]:
    """The adapter or model with the tokenizer and its identity, staged and renamed into place whole (a
    full disk leaves the previous output), and the engine that really ran: (output folder, engine, identity).

    The export and evaluation made from another output are then moved aside (`outputs.retire_stale`).
    """
    global phase
    phase = "saving the trained output"
    out_dir = rundir.trained_dir(run_dir, cfg.method.uses_adapters)
    if rank0:
        rundir.check_folder(out_dir)  # the libraries write into it in place: no link planted since the start
    engine = engine_record(trainer)  # every rank takes part (it gathers)
    identity = None
    with outputs.staged(out_dir, _output_bytes(loaded.model), writer=rank0) as tmp:
        # Every rank: ZeRO-3 and FSDP2 gather the partitioned weights; rank 0 writes.
        save_output(trainer, tmp)
        if rank0:
            loaded.tokenizer.save_pretrained(str(tmp))
            identity = outputs.record(tmp, trainer.state.global_step, run_id, out_dir.name)
    if identity is not None:
        outputs.retire_stale(run_dir, identity)
    return out_dir, engine, identity


def _output_bytes(model: Any) -> int:
    """About what the saved output takes: the trainable tensors (an adapter), or every one (full fine-tuning)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    adapter_only = hasattr(model, "peft_config")
    return sum(
        (getattr(p, "ds_numel", None) or p.numel()) * p.element_size()
        for p in (trainable if adapter_only else params)
    )


def _final_evaluation(
    cfg: Config, loaded: _Model, eval_ds: Any, max_generate: Optional[int], in_worker_eval: bool
) -> Optional[dict]:
    """The trained model's scores, where this rank evaluates (None elsewhere)."""
    global phase
    phase = "the final evaluation"
    if not in_worker_eval:
        return None
    return _evaluate(cfg, loaded, eval_ds, max_generate=max_generate, examples=5)


def _train_metrics(
    cfg: Config,
    plan: Plan,
    session: _Session,
    loaded: _Model,
    trained: _Trained,
    t0: float,
    mismatch: Optional[str],
) -> dict:
    """metrics.json's `train`: steps, loss, speed, memory against the plan, and what really ran."""
    state, monitor = session.trainer.state, session.monitor
    return {
        "steps": state.global_step,
        "final_loss": _final_loss(state.log_history),
        # a mixture of experts: the router's load-balancing loss (unweighted) of the last logged step, which
        # `final_loss` includes weighted by the model's router_aux_loss_coef; None for a dense model
        "final_aux_loss": _final_loss(state.log_history, "aux_loss"),
        "router_aux_loss_coef": getattr(session.trainer, "router_aux_loss_coef", None)
        if getattr(session.trainer, "aux_loss_enabled", False)
        else None,
        "tokens_per_second": round(monitor.tokens_per_second, 2),
        "peak_memory_gb": round(monitor.measured_gb(), 4),
        # what is held against the plan: on the CPU the peak less the RSS before the data and model loaded
        "compared_memory_gb": round(monitor.compared_gb(), 4),
        "planned_memory_gb": round(plan.gpu_memory.total, 4),
        "peak_memory_source": "cuda_max_allocated" if cfg.hardware.device == "cuda" else "process_peak_rss",
        "memory_over_plan": monitor.warned,
        "tokens": monitor.tokens_seen,
        "train_seconds": round(trained.seconds, 2),
        # From the first step's start to the last step's end: no set-up, no end-of-run eval or save.
        "loop_seconds": round(monitor.train_seconds, 2),
        # each step's seconds, so a benchmark can take the median past the first (warm-up) step
        "step_seconds": [round(t, 3) for t in monitor.step_seconds],
        "loop_cpu_seconds": round(monitor.train_cpu_seconds, 2),
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "stopped_early": session.early.reason,
        "resumed_from": str(Path(trained.resumed_from).resolve()) if trained.resumed_from else None,
        "already_complete": False,
        "method": cfg.method.name,
        "precision": "bf16" if str(loaded.compute_dtype).endswith("bfloat16") else "fp32",
        "trainable_parameters": loaded.trainable,
        "total_parameters": loaded.total,
        "strategy": asdict(plan.strategy),
        "output_dir": str(trained.out_dir),
        "run_id": trained.run_id,
        "output_identity": trained.identity.to_dict() if trained.identity else None,
        "engine": trained.engine,
        "machine_mismatch": mismatch,
        "profile": session.profiler.summary() if session.profiler is not None else None,  # train.profile
    }


def _eval_skipped(plan: Plan, rank0: bool) -> dict:
    """metrics.json's `eval` where this rank did not evaluate: why."""
    if not rank0:
        return {"skipped": "rank 0 evaluates"}
    return {
        "skipped": f"sharding={plan.strategy.sharding}: the weights are split across ranks; the eval stage "
        "(mode=eval) scores the saved output"
    }


def _read_metrics(run_dir: Path) -> dict:
    """metrics.json as written, or {} when it is missing or damaged (it is rewritten whole at the end)."""
    path = run_dir / rundir.METRICS_FILE
    try:
        doc = json.loads(rundir.read_own_text(path)) if path.is_file() else {}
    except (OSError, ValueError):
        log.warning("%s is damaged (not JSON); it is written anew at the end of this run", path)
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_metrics(trainer: Any, run_dir: Path, metrics: dict) -> None:
    """Global rank 0 merges them into metrics.json (the eval stage's keys stay)."""
    if trainer.is_world_process_zero():
        rundir.write_json(run_dir / rundir.METRICS_FILE, {**_read_metrics(run_dir), **metrics})


def _prechecks(cfg: Config, run_dir: Path, plan: Plan) -> preflight.MachineCheck:
    """Rank 0: disk, resume, host RAM and this machine against the plan, unless the pipeline that started
    this rank ran them already (`preflight.handoff`): each check runs once per launch."""
    handed = preflight.handed_down(os.environ)
    if handed is not None:
        return handed
    preflight.check(cfg, run_dir, plan)
    return preflight.check_machine(
        cfg,
        plan,
        gpus=plan.layout.nproc_per_node,
        device=plan.hardware.device,
        allow_mismatch=cfg.launch.allow_mismatch,
    )


def is_rank_zero() -> bool:
    """Global rank 0 (torchrun and accelerate set RANK; a single process is rank 0)."""
    return int(os.environ.get("RANK", "0")) == 0


def _agreed_resume_point(trainer: Any, cfg: Config, run_dir: Path, rank0: bool) -> tuple[Optional[str], bool]:
    """Rank 0 tidies the checkpoint folder and picks the resume point; every rank gets the same answer.

    Also whether that checkpoint ends a run already complete (`_complete`): there is nothing to train.
    """
    from accelerate.utils import broadcast_object_list

    answer: list[Any] = [None, None, False]
    if rank0:
        try:
            answer[0] = checkpoints.prepare_resume(cfg.resume, rundir.checkpoint_dir(run_dir))
            answer[2] = answer[0] is not None and _complete(trainer, Path(answer[0]), run_dir)
        except Exception as exc:  # every rank must learn of it, or the others wait forever
            answer[1] = exc
    if trainer.accelerator.num_processes > 1:
        broadcast_object_list(answer, from_process=0)
    if answer[1] is not None:
        raise answer[1]
    return answer[0], bool(answer[2])


def _complete(trainer: Any, checkpoint: Path, run_dir: Path) -> bool:
    """`checkpoint` is the last step of this run's schedule, and the run's output and metrics are written.

    transformers resumed from the final step trains one step beyond the schedule before it checks
    the step count (and rewrites the output): re-running a finished job's command must not.
    """
    state = json.loads((checkpoint / checkpoints.TRAINER_STATE_FILE).read_text())
    args = trainer.args
    if args.max_steps > 0:
        target = args.max_steps
    else:  # epoch-based: the trainer's own count of optimizer steps
        target = trainer.set_initial_training_values(args, trainer.get_train_dataloader())[-1]
    previous = _read_metrics(run_dir).get("train")
    previous = previous if isinstance(previous, dict) else {}
    return (
        state.get("global_step", 0) >= target
        and previous.get("steps") == state.get("global_step")
        and Path(previous.get("output_dir", "")).is_dir()
    )


def _already_trained(run_dir: Path, checkpoint: Optional[str], rank0: bool) -> dict:
    """The metrics of the finished run, marked as such: nothing is trained, saved or evaluated again."""
    path = run_dir / rundir.METRICS_FILE
    metrics = _read_metrics(run_dir)
    log.info("already trained: %s is the schedule's last step; nothing to train", checkpoint)
    resumed = str(Path(checkpoint).resolve()) if checkpoint else None
    metrics["train"] = {**metrics["train"], "resumed_from": resumed, "already_complete": True}
    if rank0:
        rundir.write_json(path, metrics)
    return metrics


class Preempted(FinetuneError):
    """Training stopped on SIGTERM/SIGINT after saving a checkpoint: exit code 75 (EX_TEMPFAIL), not 2.

    A FinetuneError so both entry points print its one line and exit with `exit_code`.
    """

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(
        self,
        signal_name: str,
        step: int,
        checkpoint: Optional[Path],
        run_dir: Path,
        resume_point: Optional[Path] = None,
    ):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        if checkpoint:  # saved by this attempt
            where = f"checkpoint saved: {checkpoint}"
        elif resume_point:
            where = f"nothing new saved; the resume point is still {resume_point}"
        else:
            where = "nothing trained yet, nothing saved"
        super().__init__(
            f"stopped by {signal_name} at step {step}; {where}. To resume, run the same command again "
            f"(or: {rundir.command_line('python', '-m', 'finetune.train', run_dir)}); resume=false starts over"
        )


def unresumable(checkpoint: Path, exc: BaseException) -> ConfigError:
    """The one line for a checkpoint that verified but failed to load before the first step: which one, the
    error, and what to resume from instead (the previous complete checkpoint, or a fresh start)."""
    step = checkpoints.step_of(checkpoint)
    earlier = [
        p
        for p in reversed(checkpoints.listing(checkpoint.parent))
        if step is None or (checkpoints.step_of(p) or 0) < step
    ]
    previous = next((p for p in earlier if checkpoints.verify(p) is None), None)
    instead = (
        f"resume={previous.name} resumes from the previous complete checkpoint"
        if previous
        else "resume=false starts over (no earlier complete checkpoint)"
    )
    text = str(exc).strip().splitlines()
    error = f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__
    return ConfigError(
        f"checkpoint {checkpoint} could not be resumed ({error}), before its first step; {instead}"
    )


def interrupted_message(signal_name: str, run_dir: Union[str, Path]) -> str:
    """The one true line for a worker stopped at once by a signal (outside the training loop's save)."""
    last = checkpoints.newest_by_size(rundir.checkpoint_dir(Path(run_dir)))
    where = (
        f"the newest complete checkpoint is {last}"
        if last
        else "no checkpoint was saved yet, so the next run starts from the beginning"
    )
    return (
        f"stopped by {signal_name} during {phase}, at once (nothing was saved by this stop); {where}. "
        f"To resume, run the same command again (or: {rundir.command_line('python', '-m', 'finetune.train', run_dir)})"
    )


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on `sys.stderr` as it is when each record comes, not when the handler was made: a run
    in-process (a notebook, the tests) may swap stderr, and a handler kept on a closed stream turns every
    later warning into a "--- Logging error ---" traceback."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_rank_logging(rank0: bool) -> None:
    """Rank 0 speaks (our INFO lines, library warnings); other ranks only report errors, which
    would otherwise repeat every line once per rank. DeepSpeed's own calls to deprecated
    torch.distributed functions warn on every collective: silenced, nothing of ours to fix."""
    import warnings

    logger = logging.getLogger("finetune")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank0 else logging.ERROR)
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    if not rank0:
        warnings.simplefilter("ignore")
        transformers.utils.logging.set_verbosity_error()


def run_worker(run_dir: Union[str, Path]) -> dict:
    """One rank: config and plan from the run directory (no command-line parsing here).

    config.yaml was written resolved (a model.config_path read, this machine read for hardware=local or
    cpu): the rank reads it as it is, and never resolves or plans again.
    """
    install_log_filter()
    configure_rank_logging(is_rank_zero())
    if is_rank_zero() and Path(run_dir).is_dir():
        rundir.lock(Path(run_dir))  # before reading: a second writer must not start at all
    plan = rundir.load_plan(Path(run_dir))
    # The plan's profile: under hardware=auto the one chosen (config.yaml keeps `auto`, as asked).
    cfg = replace(rundir.load_config(Path(run_dir)), hardware=plan.hardware, run_dir=str(run_dir))
    # The worker's base-vs-trained comparison answers as many held-out prompts as the eval stage would.
    return run(cfg, Path(run_dir), plan, max_generate=cfg.eval.num_samples)
