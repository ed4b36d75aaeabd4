"""What the tests share (the fixtures live in conftest.py): the tiny model's short-run config, plans,
training in this process, run directories as the pipeline leaves them, and the command line run in a
child process.

Imported as `from helpers import ...`: pytest puts tests/ on sys.path (the folder is not a package).
No test module imports another one; tests/test_architecture.py checks it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import pytest

from finetune.core.config import Config
from finetune.core.config.evaluation import EvalConfig
from finetune.planner import Plan
from finetune.rundir import checkpoints

REPO = Path(__file__).resolve().parent.parent


def script_module(name: str) -> ModuleType:
    """scripts/NAME.py imported as module NAME (scripts/ is not a package); registered in sys.modules so its
    dataclasses resolve their own module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The tiny data's sequence length: what the session's `tiny_data` fixture prepares.
SEQ_LEN = "train.seq_len=128"
# A short training run on the tiny data: a loss logged every step, no evaluation during training (the
# runs are far shorter than 1000 steps) and no tensorboard.
SHORT_RUN = (SEQ_LEN, "train.logging_steps=1", "train.eval_steps=1000", "train.report_to=[]")
# The worker-process runs of the resume and preemption tests: 40 steps, mid-epoch (about 290 packed rows
# of 2 per step in an epoch), a checkpoint every 5, dropout on so the RNG state matters.
WORKER_RUN = (
    *SHORT_RUN,
    "train.batch_size=2",
    "train.max_steps=40",
    "train.save_steps=5",
    "method.lora_dropout=0.1",
    "data.eval_fraction=0.01",
)

# Tiny mixtures of experts in transformers' own classes (fused 3-D experts): a Qwen3-MoE (4 experts of width 48,
# 2 routed a token) and a Mixtral of the same shape (its experts' width is intermediate_size; it renormalizes).
TINY_MOE = (
    "model.architecture=qwen3_moe",
    "model.num_experts=4",
    "model.num_experts_per_token=2",
    "model.moe_intermediate_size=48",
)
TINY_MIXTRAL = (
    "model.architecture=mixtral",
    "model.num_experts=4",
    "model.num_experts_per_token=2",
    "model.intermediate_size=48",
    "model.norm_topk_prob=true",
)
# LoRA on attention and on the experts (PEFT's target_parameters take no dropout)
EXPERT_LORA = ("method=lora", "method.lora_dropout=0", "method.lora_experts=true")


# ---------------------------------------------------------------- configs and plans


def tiny_model(architecture: str, **fields: Any) -> Any:
    """The tiny ModelConfig in another family's class (hidden = heads x head_dim, as Phi requires), `fields`
    replaced (num_experts=4, ... for a mixture of experts)."""
    from finetune.core.config import ModelConfig

    return replace(
        ModelConfig(), architecture=architecture, hidden_size=64, num_heads=4, head_dim=16, **fields
    )


def tiny_cfg(*overrides: str, run_dir: Optional[Path] = None) -> Config:
    """The embedded default (the tiny model on the CPU) composed with SHORT_RUN, then `overrides` (command-line
    style, so a later one wins), in `run_dir` when given."""
    from finetune.pipeline.cli import compose

    where = [f"run_dir={run_dir}"] if run_dir is not None else []
    return compose([*SHORT_RUN, *where, *overrides])


def plan_for(cfg: Config, **strategy: Any) -> Plan:
    """The planner's plan for `cfg` on this machine (hardware=cpu resolved as the pipeline does),
    with strategy fields overridden."""
    from finetune.pipeline.stages import config_plan, resolve

    cfg = resolve(cfg)
    plan = config_plan(cfg)
    return replace(plan, strategy=replace(plan.strategy, **strategy)) if strategy else plan


def planned(*overrides: str) -> tuple[Config, Plan]:
    """The composed and resolved config for `overrides`, and its plan (as the pipeline plans it)."""
    from finetune.core.composition import compose
    from finetune.pipeline.stages import config_plan, resolve

    cfg = resolve(compose(list(overrides)))
    return cfg, config_plan(cfg)


def fast_eval(**overrides: Any) -> EvalConfig:
    """Few prompts, few tokens, no progress bars: seconds on two CPU cores."""
    settings: dict[str, Any] = dict(num_samples=6, max_new_tokens=6, batch_size=8, progress=False)
    settings.update(overrides)
    return EvalConfig(**settings)


# ---------------------------------------------------------------- run directories


def write_engine(cfg: Config, plan: Plan, run_dir: Path) -> None:
    """What the launcher writes before the ranks start (engine.json and the engine's files): the in-process
    runs skip the launcher, and the worker reads them."""
    from finetune.launch.engines import write_engine_files

    write_engine_files(cfg, plan, Path(run_dir))


def prepare_run(cfg: Config) -> Path:
    """A run directory as `python -m finetune mode=train` leaves it for the worker: config.yaml, the data,
    plan.json and the launcher's engine files (the ranks are not started)."""
    from finetune import rundir
    from finetune.data import stage as data_stage
    from finetune.pipeline.stages import plan_stage, resolve

    cfg = resolve(cfg)
    run = rundir.prepare(cfg)
    rundir.save_config(cfg, run)
    data_stage.run(cfg, run)
    write_engine(cfg, plan_stage(cfg, run, quiet=True), run)
    return run


def prepare_worker_run(run: Path, cache: Path, *overrides: str) -> Path:
    """`prepare_run` for a WORKER_RUN (then `overrides`) in `run`, its data cached in `cache`."""
    return prepare_run(tiny_cfg(f"data.cache_dir={cache}", *WORKER_RUN, *overrides, run_dir=run))


def planned_run_dir(tmp_path: Path, *overrides: str) -> tuple[Config, Plan, Path]:
    """tmp_path/run holding config.yaml and plan.json for `overrides` (what the launcher reads), no data."""
    from finetune import rundir

    cfg, plan = planned(*overrides)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rundir.save_config(cfg, run_dir)
    rundir.write_json(run_dir / rundir.PLAN_FILE, plan.to_dict())
    return cfg, plan, run_dir.resolve()


def write_log_history(run_dir: Path, steps: int = 20) -> None:
    """A checkpoint's trainer_state.json with a falling loss and eval loss, as the training stage leaves it."""
    history = [{"step": s, "loss": 3.0 / s**0.3} for s in range(1, steps + 1)]
    history += [{"step": s, "eval_loss": 3.2 / s**0.25} for s in (5, 10, 15, 20)]
    ckpt = run_dir / "checkpoints" / f"checkpoint-{steps}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": steps, "log_history": history}))


def make_adapter_run(run_dir: Path, model_cfg: Any, method: Any, seed: int = 0, b_std: float = 0.05) -> Path:
    """What the training stage leaves behind, without training: RUN_DIR/adapter from the tiny model + PEFT
    (random A and B, B non-zero so a merge changes the weights) and a checkpoint's log history."""
    import torch
    from peft import get_peft_model

    from finetune.modeling import tiny
    from finetune.modeling.loading import lora_config

    torch.manual_seed(seed)
    model = tiny.load_model(model_cfg)
    peft_model = get_peft_model(model, lora_config(method, model_cfg))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    out = run_dir / "adapter"
    peft_model.save_pretrained(str(out))
    tiny.load_tokenizer(model_cfg).save_pretrained(str(out))
    write_log_history(run_dir)
    return out


# ---------------------------------------------------------------- training in this process, and what it leaves


def train_run(
    cfg: Config,
    tiny_data: Any,
    *,
    n_eval: int,
    max_generate: int,
    n_train: Optional[int] = None,
    **strategy: Any,
) -> dict:
    """`finetune.train.stage.run` in this process on the tiny data (the first `n_train` training rows and
    `n_eval` eval rows), planned for this machine with `strategy` fixed (the batch shape), then the eval stage
    on the same eval rows (`evaluate`): the training metrics with the eval stage's scores as `eval`."""
    from finetune.pipeline.stages import resolve
    from finetune.train import stage

    cfg = resolve(cfg)
    train, evals = tiny_data
    if n_train:
        train = train.select(range(n_train))
    datasets = (train, evals.select(range(n_eval)))
    plan = plan_for(cfg, **strategy)
    write_engine(cfg, plan, Path(cfg.run_dir))
    metrics = stage.run(cfg, Path(cfg.run_dir), plan, datasets=datasets)
    return {**metrics, "eval": evaluate(cfg, Path(cfg.run_dir), datasets[1], max_generate)}


def evaluate(cfg: Config, run_dir: Path, eval_ds: Any, num_samples: Optional[int], **settings: Any) -> dict:
    """The eval stage on `eval_ds` (its first `num_samples` prompts answered, at most 8 new tokens each, no
    regression set unless `settings` say so): {base: scores, trained: scores}."""
    from finetune.evaluation import stage as evaluation

    fields: dict[str, Any] = dict(num_samples=num_samples, max_new_tokens=8, regression=False, progress=False)
    fields.update(settings)
    scores = evaluation.run(replace(cfg, eval=replace(cfg.eval, **fields)), run_dir, eval_dataset=eval_ds)
    return {v: scores[v] for v in ("base", "trained") if v in scores}


FOUR_STEPS = ("train.max_steps=4", "train.save_steps=1000", "train.warmup_ratio=0.0")


def four_steps_learn(tmp_path: Path, tiny_data: Any, *overrides: str, learning_rate: str = "3e-3") -> dict:
    """Four steps of the tiny model with `overrides` in this process (micro-batch 2, no accumulation, 8
    training and 8 held-out rows): each step logged a finite loss and the held-out loss fell by more than
    0.1 nats against the base. Its metrics, for the engine and method checks a test adds."""
    cfg = tiny_cfg(*overrides, f"method.learning_rate={learning_rate}", *FOUR_STEPS, run_dir=tmp_path / "run")
    metrics = train_run(
        cfg, tiny_data, n_train=8, n_eval=8, max_generate=2, micro_batch_size=2, grad_accum_steps=1
    )
    steps = last_losses(Path(metrics["train"]["output_dir"]).parent)
    assert len(steps) == 4 and all(math.isfinite(x) for x in steps), steps
    base, trained = metrics["eval"]["base"]["loss"], metrics["eval"]["trained"]["loss"]
    assert trained < base - 0.1, (base, trained)
    return metrics


def losses(ckpt: Path) -> list[float]:
    """The per-step training losses in a checkpoint's trainer state."""
    history = json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in history if "loss" in e]


def last_losses(run_dir: Path) -> list[float]:
    """The per-step training losses in the run's last checkpoint."""
    from transformers.trainer_utils import get_last_checkpoint

    return losses(Path(get_last_checkpoint(str(run_dir / "checkpoints"))))


def adapter_weights(run_dir: Path) -> dict:
    """The trained adapter's tensors, by name."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


# ---------------------------------------------------------------- child processes


def child_env(**extra: str) -> dict[str, str]:
    """This environment with PYTHONPATH set to this tree (a child imports it, not an installed copy) and
    one thread per child (the cores are shared)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def run_cli(
    *args: str,
    module: str = "finetune",
    env: Optional[dict[str, str]] = None,
    cwd: Path = REPO,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """`python -m finetune ARGS` (`module="finetune.train"`: the worker) run to its end, output captured.
    `env` None: this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_modes(
    args: list[str], log: Path, timeout: float = 600, modes: tuple[str, ...] = ("data", "train")
) -> str:
    """`python -m finetune mode=M ARGS` for each mode in turn, as a user drives a run; each mode's output in
    LOG-M.log. Fails naming the mode, with the ranks' tracebacks first; returns the last mode's output."""
    for mode in modes:
        proc = run_cli(f"mode={mode}", *args, timeout=timeout)
        out = proc.stdout + proc.stderr
        (log.parent / f"{log.name}-{mode}.log").write_text(out)
        ranks = "\n".join(line for line in out.splitlines() if line.startswith("[rank"))
        assert proc.returncode == 0, f"mode={mode} {log.name} failed:\n{ranks[-6000:]}\n{out[-3000:]}"
    return out


def worker(run: Path, **popen: Any) -> subprocess.Popen:
    """`python -m finetune.train RUN` started in the background (one thread), stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "finetune.train", str(run)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    """Wait for a `worker`: its exit code and stderr."""
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def wait_for_checkpoint(run: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until `proc` has written checkpoint-STEP; fails if it ends first or takes longer than `timeout`."""
    path = run / "checkpoints" / f"checkpoint-{step}"
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        if proc.poll() is not None:
            raise AssertionError(
                f"worker ended ({proc.returncode}) before {path.name}: {proc.stderr.read()[-2000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {path.name} after {timeout} s")
        time.sleep(0.01)


def sigkill_then_resume(run: Path, checkpoint_step: int, steps: int) -> tuple[Path, dict]:
    """A worker on `run` killed with SIGKILL at a random step after checkpoint-CHECKPOINT_STEP, then the same
    command again: the checkpoint it resumed from and the resumed run's metrics.json (asserted to finish all
    `steps` from there)."""
    proc = worker(run)
    wait_for_checkpoint(run, checkpoint_step, proc)
    time.sleep(random.uniform(0.0, 0.8))  # a random step after the first checkpoint
    proc.send_signal(signal.SIGKILL)
    code, _ = finish(proc)
    assert code == -signal.SIGKILL
    assert not (run / "metrics.json").exists(), "the worker finished before the kill; nothing was tested"
    last = checkpoints.last_complete(run / "checkpoints")
    assert last is not None and checkpoints.step_of(last) < steps

    code, err = finish(worker(run))  # the same command again: resume=true is the default
    assert code == 0, err[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["train"]["resumed_from"] == str(last.resolve()) and metrics["train"]["steps"] == steps
    return last, metrics


# ---------------------------------------------------------------- engines on CPU ranks

# A short offline run of an objective on the bundled data as the engine tests drive it: 8 examples a step, a loss
# logged each step, no dropout (so one process and two ranks see the same arithmetic), no evaluation in training.
ENGINE_RUN = (
    "hardware=cpu",
    "train.seq_len=64",
    "train.batch_size=8",
    "train.logging_steps=1",
    "train.warmup_ratio=0.0",
    "method.lora_dropout=0.0",
    "train.eval_steps=1000",
    "train.report_to=[]",
)
# One process taking a step's 8 examples as the two ranks take them between them.
ONE_PROCESS = ("train.micro_batch_size=4", "train.grad_accum_steps=2")
# How each engine is asked for on the command line, and the wrapper its record must name.
ENGINES = {
    "one-process": ("hardware.gpus_per_node=1",),
    "ddp": ("hardware.gpus_per_node=2",),
    "zero3": ("hardware.gpus_per_node=2", "train.sharding=zero3", "train.engine=zero3"),
    "fsdp2": ("hardware.gpus_per_node=2", "train.sharding=fsdp", "train.engine=fsdp"),
}
WRAPPERS = {"ddp": "DistributedDataParallel", "zero3": "DeepSpeedEngine", "fsdp2": "FSDP"}
# ZeRO-3 and FSDP2 on two ranks: each holds about half of every parameter.
HALF = 0.5


@dataclass(frozen=True)
class EngineRun:
    """What a run on an engine left: its directory and arguments, metrics.json, the per-step losses, and what
    each rank reported (metrics.json `train.engine`)."""

    dir: Path
    args: list[str]
    metrics: dict
    losses: list[float]

    @property
    def engine(self) -> dict:
        return dict(self.metrics["train"]["engine"])

    @property
    def shares(self) -> list[float]:
        """Each rank's share of the parameters it trains beside: 1 whole, 1/2 partitioned over two."""
        return [r["parameters_held"] / r["parameters"] for r in self.engine["ranks"]]


def run_on_engine(
    root: Path, name: str, engine: str, *args: str, steps: int, timeout: float = 900
) -> EngineRun:
    """`args` driven as a user drives a run (`mode=data`, then `mode=train` through the launcher) in ROOT/NAME on
    `engine` (a key of ENGINES), `steps` steps with a checkpoint at the last, the data cached in ROOT. Asserted:
    the engine really ran (world size, gloo, one pid a rank, the wrapper, each rank's share of the parameters:
    whole where the engine replicates, half where it shards) and a loss was logged every step."""
    run_dir = root / name
    argv = [
        *args,
        *ENGINES[engine],
        f"train.max_steps={steps}",
        f"train.save_steps={steps}",
        f"run_dir={run_dir}",
        f"data.cache_dir={root / 'data-cache'}",
    ]
    run_modes(argv, run_dir, timeout=timeout)
    run = EngineRun(
        dir=run_dir,
        args=argv,
        metrics=json.loads((run_dir / "metrics.json").read_text()),
        losses=losses(run_dir / "checkpoints" / f"checkpoint-{steps}"),
    )
    assert len(run.losses) == steps, run.losses
    assert_engine_ran(run, engine)
    return run


def assert_engine_ran(run: EngineRun, engine: str) -> None:
    """The record shows `engine` ran: its world size, one process a rank, its wrapper, each rank's share."""
    record = run.engine
    ranks = 1 if engine == "one-process" else 2
    assert record["world_size"] == ranks, record
    assert [r["rank"] for r in record["ranks"]] == list(range(ranks))
    assert len({r["pid"] for r in record["ranks"]}) == ranks
    if engine == "one-process":
        assert run.shares == [1.0]
        return
    assert record["backend"] == "gloo"
    assert record["wrapper"].startswith(WRAPPERS[engine]), record["wrapper"]
    assert record["zero_stage"] == (3 if engine == "zero3" else None)
    if engine == "ddp":  # replicated: each rank holds every parameter
        assert run.shares == [1.0, 1.0]
    else:  # partitioned: each rank holds its half, and the two halves the whole
        assert run.shares == pytest.approx([HALF, HALF], abs=0.025)
        assert sum(r["parameters_held"] for r in record["ranks"]) >= record["ranks"][0]["parameters"]


def assert_trains_like(run: EngineRun, reference: EngineRun, rtol: float) -> None:
    """Step for step, `run`'s losses within `rtol` (relative) of `reference`'s."""
    assert len(run.losses) == len(reference.losses)
    worst = max(abs(a - b) / abs(b) for a, b in zip(run.losses, reference.losses))
    assert worst <= rtol, f"losses {run.losses} vs {reference.losses}"


class Capture:
    """A process runner (the launcher's `runner`) that records what would run."""

    def __init__(self, code: int = 0) -> None:
        self.calls: list[tuple[list[str], dict[str, str], str]] = []
        self.code = code

    def __call__(self, argv, env, cwd) -> int:
        self.calls.append((list(argv), dict(env), cwd))
        return self.code


# ---------------------------------------------------------------- GRPO

COMPLETIONS_LOG_ENV = "FINETUNE_TEST_COMPLETIONS"


def record_completions(prompts: list[str], completions: list[str], references: list[str]) -> list[float]:
    """A GRPO reward (`objective.rewards=[...,helpers.record_completions]`) that appends every completion it is
    given to the file named by $FINETUNE_TEST_COMPLETIONS, one JSON string a line, and scores 0."""
    import json

    with open(os.environ[COMPLETIONS_LOG_ENV], "a") as f:
        f.writelines(json.dumps(c) + "\n" for c in completions)
    return [0.0] * len(completions)


def reward_model_folder(root: Path, model_cfg: Any, extra_token: bool = False) -> Path:
    """The tiny base saved as a one-label sequence classifier (an untrained reward model: what
    `objective.reward_model` names), with its tokenizer (`extra_token`: one token more than the policy's)."""
    from finetune.modeling import tiny
    from finetune.modeling.loading import load_pretrained

    out = root / ("rm-other-vocab" if extra_token else "rm")
    model = load_pretrained(model_cfg, str(tiny.model_dir(model_cfg)), head="score", seed=3)
    model.save_pretrained(str(out))
    tokenizer = tiny.load_tokenizer(model_cfg)
    if extra_token:
        tokenizer.add_tokens(["<not-the-policy's>"])
    tokenizer.save_pretrained(str(out))
    return out


def command_line_plan(tmp: Path, *overrides: str) -> dict:
    """plan.json as `python -m finetune OVERRIDES mode=plan` writes it (the entry point, in this process)."""
    from finetune.pipeline.cli import main

    run = tmp / "cli-run"
    assert main([*overrides, "mode=plan", f"run_dir={run}"]) == 0
    return json.loads((run / "plan.json").read_text())


# What a fake run's answers and names hold: markup that must show as text.
HOSTILE = '<script>window.__injected = 1</script><img src=x onerror="window.__injected = 2">'


def fake_run_dir(root: Path, name: str, plan: dict, steps: int = 6) -> Path:
    """A run directory as training and evaluation leave it, written from files alone (no training): config.yaml,
    plan.json, metrics.json, train_log.jsonl (a loss a step, an eval loss at the end), eval/metrics.json and
    eval/samples.jsonl, whose answers hold `HOSTILE`."""
    import yaml

    run = root / name
    (run / "eval").mkdir(parents=True)
    (run / ".finetune-run").write_text("")
    (run / "config.yaml").write_text(
        yaml.safe_dump({"name": name, "model": {"name": "tiny"}, "method": {"name": "lora"}})
    )
    (run / "plan.json").write_text(json.dumps(plan))
    train = {
        "steps": steps,
        "final_loss": 1.25,
        "peak_memory_gb": 0.4321,
        "compared_memory_gb": 0.2109,
        "planned_memory_gb": plan["gpu_memory_gb"]["total"],
        "peak_memory_source": "process_peak_rss",
    }
    scores = {"base": {"loss": 3.5, "exact_match": 0.1}, "trained": {"loss": 1.5, "exact_match": 0.75}}
    (run / "metrics.json").write_text(json.dumps({"train": train, "eval": scores}))
    log = [{"step": s, "loss": 4.0 - 0.5 * s} for s in range(1, steps + 1)] + [
        {"step": steps, "eval_loss": 1.4}
    ]
    (run / "train_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    (run / "eval" / "metrics.json").write_text(
        json.dumps({**scores, "merged": {"loss": 1.5, "exact_match": 0.75}, "settings": {"seed": 0}})
    )
    samples = [
        {
            "id": "t0",
            "set": "task",
            "prompt": [{"role": "user", "content": "2+2?"}],
            "reference": "4",
            "base": "5",
            "trained": HOSTILE,
            "merged": "4",
        },
        {
            "id": "r0",
            "set": "regression",
            "prompt": "Say hi",
            "reference": None,
            "base": "hi",
            "trained": "hi",
        },
    ]
    (run / "eval" / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run
