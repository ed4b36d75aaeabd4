"""The training stage: load per method, train, save the output, write metrics.json.

    python -m finetune.train RUN_DIR          # one rank (what torchrun runs); reads config.yaml + plan.json

Reads the packed data the data stage wrote (`finetune.data.stage.load_prepared`), trains with the plan's
strategy (TRL's trainer, its held-out `eval_loss` every `train.eval_steps`), saves the adapter
(`RUN_DIR/adapter`) or the model (`RUN_DIR/model`) with the tokenizer and its identity
(`finetune.modeling.outputs`: written whole, then the export and evaluation made from another model moved
aside), and writes `RUN_DIR/metrics.json`'s `train`: steps, final loss, tokens a second, peak memory
against the plan, the engine that really ran. Scoring base, trained and merged models is the eval stage's
(`finetune.evaluation.stage`). Several ranks: every rank trains and saves its part; rank 0 alone logs and
writes files, holding the run directory's lock (`rundir.lock`), inherited from the pipeline that
launched it. Stopping and resuming: `finetune.train.resume`.
"""

from __future__ import annotations

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
from finetune.core.errors import FinetuneError, is_disk_full
from finetune.core.noise import quiet_libraries
from finetune.core.secrets import install_log_filter
from finetune.data.stage import load_prepared
from finetune.modeling import dtypes, loading, models, outputs
from finetune.planner import Plan
from finetune.rundir import preflight
from finetune.train import callbacks as cb
from finetune.train import resume, throughput
from finetune.train.base_trainer import build_trainer, engine_record, save_output
from finetune.train.profiling import StepProfiler

log = logging.getLogger(__name__)


def trainer_module(cfg: Config) -> Any:
    """The trainer module of `cfg.objective` (`ObjectiveSpec.trainer`)."""
    return cfg.objective.spec.trainer_module()


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
    cfg: Config, run_dir: Union[str, Path], plan: Plan, *, datasets: Optional[tuple[Any, Any]] = None
) -> dict:
    """Train per `cfg` and `plan`, save the output, write and return metrics.json's content.

    The held-out split is TRL's eval set during training (`eval_loss` every `train.eval_steps`); scoring
    the base and the trained model is the eval stage's. `datasets` (train, eval) replaces the data stage's
    output (tests). A signal outside the loop stops at once: the exception carries what the worker was
    doing (`during`) for `interrupted_message`.
    """
    run_dir = Path(run_dir)
    # the attention the plan took (train.attention, or the planner's choice with the sequence split)
    cfg = replace(cfg, train=replace(cfg.train, attention=plan.strategy.attention))
    rank0 = is_rank_zero()
    run_id = uuid.uuid4().hex[:12]  # names this training process in metrics.json and the output's identity
    mismatch = _lock_and_precheck(cfg, run_dir, plan) if rank0 else None
    transformers.utils.logging.disable_progress_bar()
    throughput.check_runtime(cfg, plan.strategy.sharding)  # a lever this machine cannot run: one line, exit 2
    t0 = time.perf_counter()
    baseline_gb = _rss_gb()
    doing = "loading the data"
    try:
        data = datasets if datasets is not None else load_prepared(run_dir)
        doing = "loading the model"
        loaded = _load_model(cfg, plan, run_dir)
        session = _build_session(cfg, plan, run_dir, loaded, data, baseline_gb, rank0)
        try:
            resumed_from, complete = resume.agreed_resume_point(session.trainer, cfg, run_dir, rank0)
            if complete:
                return resume.already_trained(run_dir, resumed_from, rank0)
            # From here a signal finishes the step and saves a checkpoint (`Preemption`).
            doing = "training"
            seconds = _train(session, resumed_from, run_dir)
        finally:
            session.preemption.uninstall()
        doing = "saving the trained output"
        out_dir, engine, identity = _save_trained(cfg, run_dir, session.trainer, loaded, run_id, rank0)
    except KeyboardInterrupt as exc:
        exc.during = doing  # type: ignore[attr-defined]
        raise
    trained = _Trained(resumed_from, seconds, out_dir, engine, identity, run_id)
    metrics = {"train": _train_metrics(cfg, plan, session, loaded, trained, t0, mismatch)}
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


def _load_model(cfg: Config, plan: Plan, run_dir: Path) -> _Model:
    """Tokenizer, seed, the trainer's arguments, then the model per method (partitioned where ZeRO-3 loads it)."""
    tokenizer = models.load_tokenizer(cfg.model)
    transformers.set_seed(cfg.train.seed)  # the adapters' random init is part of the run's seed
    # The trainer's arguments before the model: under ZeRO-3 their live DeepSpeed config makes
    # from_pretrained load this rank's partition only (zero.Init), not the whole model per rank.
    # The tiny model is built (first use) before that: built under zero.Init it would be saved partitioned.
    models.model_source(cfg.model)
    args = trainer_module(cfg).build_config(cfg, plan, run_dir, dtypes.training_dtype(cfg))
    _ = args.device  # joins the process group now: zero.Init partitions over it while loading
    if args.deepspeed:
        import deepspeed

        # deepspeed.comm over that group (accelerate sets it up itself on GPUs, not on CPU ranks)
        deepspeed.init_distributed(dist_backend="gloo" if cfg.hardware.device == "cpu" else "nccl")
    model, compute_dtype = loading.load_for_training(cfg, sharded=plan.strategy.engine.shards)
    loaded_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    trainable, total = loading.trainable_parameters(model)
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
    trainer = build_trainer(
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


def _train(session: _Session, resumed_from: Optional[str], run_dir: Path) -> float:
    """The training loop, from `resumed_from` where given; its seconds. Stopped by a signal: `Preempted`."""
    t_train = time.perf_counter()
    if resumed_from:
        log.info("resuming from %s", resumed_from)
        session.early.restore(resumed_from)
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
        raise resume.unresumable(Path(resumed_from), exc) from None
    if session.preemption.received is not None:
        raise resume.Preempted(
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
        "schedule": cfg.train.length(),
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


def _write_metrics(trainer: Any, run_dir: Path, metrics: dict) -> None:
    """Global rank 0 merges them into metrics.json."""
    if trainer.is_world_process_zero():
        # the eval stage's scores were of the previous output: it scores this one
        kept = {k: v for k, v in resume.read_metrics(run_dir).items() if k != "eval"}
        rundir.write_json(run_dir / rundir.METRICS_FILE, {**kept, **metrics})


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
    quiet_libraries(cfg.verbose)
    return run(cfg, Path(run_dir), plan)
