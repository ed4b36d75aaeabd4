"""User code (rewards, metrics, the modules holding them) runs fenced: whatever it raises, `SystemExit` and
`KeyboardInterrupt` included, or its not returning in time, is one line naming the function (exit 2); what
it returns is checked (numpy and torch scalars accepted); and a run that trained nothing never exits 0."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, child_env, tiny_cfg

from finetune.core import metrics, rewards
from finetune.core.errors import ConfigError, LaunchError, RewardError

PROMPTS, COMPLETIONS, REFERENCES = ["p1", "p2"], ["a", "b"], ["a", "c"]

USER_CODE = """
import sys, time
import numpy as np
import torch

def exits(prompts, completions, references):
    sys.exit(0)

def interrupts(prompts, completions, references):
    raise KeyboardInterrupt

def base_exception(prompts, completions, references):
    raise BaseException("odd")

def hangs(prompts, completions, references):
    time.sleep(60)

def spins(prompts, completions, references):
    while True:
        pass

def numpy_scalars(prompts, completions, references):
    return [np.float32(0.5), np.int64(1)]

def numpy_array(prompts, completions, references):
    return np.array([0.25, 1.0])

def torch_scalars(prompts, completions, references):
    return [torch.tensor(0.75), np.bool_(True)]

def generator(prompts, completions, references):
    for c in completions:
        yield 1.0 if c == "a" else sys.exit(3)

def huge(prompts, completions, references):
    return [1e300, 1e300]

def strings(prompts, completions, references):
    return ["1.0", "0"]

def metric_string(prompts, predictions, references):
    return "0.9"

def metric_raises(prompts, predictions, references):
    return {"acc": 1 / 0}

def metric_nan(prompts, predictions, references):
    return {"acc": float("nan")}

def metric_numpy(prompts, predictions, references):
    return {"acc": np.float32(0.5), "n": np.int64(2)}
"""


_MODULES = itertools.count()


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A module of user functions under a name unique to the test (nothing cached between tests)."""
    name = f"user_code_{next(_MODULES)}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def score(name: str, timeout_s: float = 5.0, weight: float = 1.0) -> list[float]:
    (reward,) = rewards.resolve([name], [weight], timeout_s=timeout_s)
    return reward.score(PROMPTS, COMPLETIONS, REFERENCES)


@pytest.mark.parametrize(
    "fn,message",
    [
        ("exits", "called sys.exit(0); user code must return a value, not end the run"),
        ("interrupts", "raised KeyboardInterrupt"),
        ("base_exception", "raised BaseException: odd"),
        (
            "generator",
            "called sys.exit(3); user code must return a value, not end the run",
        ),  # a lazy result is consumed inside the fence
        ("strings", "returned '1.0' for completion 0, not a finite number"),
    ],
)
def test_a_reward_that_ends_the_run_or_misbehaves_is_one_line(user, fn, message):
    with pytest.raises(RewardError) as err:
        score(f"{user}.{fn}")
    assert str(err.value) == f"reward '{user}.{fn}' {message}"


@pytest.mark.parametrize("fn", ["hangs", "spins"])
def test_a_reward_that_never_returns_times_out(user, fn):
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        score(f"{user}.{fn}", timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert str(err.value) == (
        f"reward '{user}.{fn}' did not return within 0.5 s (objective.reward_timeout_s); fix it, or raise "
        "objective.reward_timeout_s if it is only slow"
    )


def test_numpy_and_torch_numbers_are_rewards(user):
    assert score(f"{user}.numpy_scalars") == [0.5, 1.0]
    assert score(f"{user}.numpy_array") == [0.25, 1.0]
    assert score(f"{user}.torch_scalars") == [0.75, 1.0]
    assert all(type(v) is float for v in score(f"{user}.numpy_scalars"))
    assert metrics.as_number(np.float16(2)) == 2.0 and metrics.as_number(torch.tensor([1.0, 2.0])) is None
    assert (
        metrics.as_number("1") is None and metrics.as_number(None) is None and metrics.as_number(1j) is None
    )


def test_weighted_rewards_that_would_overflow_are_refused(user):
    with pytest.raises(RewardError, match=r"returned 1e\+300 for completion 0, x weight 1 beyond \+-1e\+06"):
        score(f"{user}.huge")
    # the built-in rewards are 0 or 1: a weight at the limit is fine, past it or infinite is refused up front
    (reward,) = rewards.resolve(["exact_match"], [1e6])
    assert reward.score(PROMPTS, COMPLETIONS, REFERENCES) == [1.0, 0.0]
    summed, _ = rewards.total([reward], PROMPTS, COMPLETIONS, REFERENCES)
    assert summed == [1e6, 0.0]
    for weight in (1e7, float("inf")):
        with pytest.raises(ConfigError, match="the weight of 'exact_match' is .*; weights lie within"):
            rewards.resolve(["exact_match"], [weight])


def test_the_reward_timeout_is_a_grpo_setting():
    cfg = tiny_cfg("objective=grpo", "objective.num_generations=4", "objective.reward_timeout_s=7.5")
    (reward,) = rewards.for_objective(cfg) or []
    assert reward.timeout_s == 7.5
    assert tiny_cfg("objective=grpo", "objective.num_generations=4").objective.reward_timeout_s == 60.0
    with pytest.raises(ConfigError, match=r"objective.reward_timeout_s=0.0 must be > 0"):
        tiny_cfg("objective=grpo", "objective.num_generations=4", "objective.reward_timeout_s=0")


@pytest.mark.parametrize(
    "fn,message",
    [
        ("exits", "called sys.exit(0); user code must return a value, not end the run"),
        ("interrupts", "raised KeyboardInterrupt"),
        ("metric_string", "returned 'metric_string': '0.9', not a finite number"),
        ("metric_raises", "raised ZeroDivisionError: division by zero"),
        ("metric_nan", "returned 'acc': nan, not a finite number"),
    ],
)
def test_a_user_metric_that_misbehaves_is_one_line(user, fn, message):
    (metric,) = metrics.resolve([f"{user}.{fn}"])
    with pytest.raises(ConfigError) as err:
        metrics.score([metric], PROMPTS, COMPLETIONS, REFERENCES)
    assert str(err.value) == f"metric '{user}.{fn}' {message}"


def test_user_metrics_time_out_and_take_numpy_numbers(user):
    (metric,) = metrics.resolve([f"{user}.metric_numpy"])
    assert metrics.score([metric], PROMPTS, COMPLETIONS, REFERENCES) == {"acc": 0.5, "n": 2.0}
    (metric,) = metrics.resolve([f"{user}.hangs"], timeout_s=0.3)
    with pytest.raises(
        ConfigError,
        match=r"did not return within 0.3 s \(eval.metric_timeout_s\); fix it, or raise eval.metric_timeout_s if it is only slow$",
    ):
        metric(PROMPTS, COMPLETIONS, REFERENCES)


def test_a_module_that_exits_or_fails_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "fails_on_import.py").write_text("import not_installed_xyz\n")
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('no GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        rewards.resolve(["exits_on_import.fn"])
    assert str(err.value) == (
        "importing 'exits_on_import' (objective.rewards) called sys.exit(0); user code must return a value, not "
        "end the run"
    )
    with pytest.raises(ConfigError) as err:
        metrics.resolve(["fails_on_import.fn"])
    assert (
        str(err.value)
        == "eval.metrics: cannot import 'fails_on_import.fn' (No module named 'not_installed_xyz')"
    )
    with pytest.raises(ConfigError) as err:
        metrics.resolve(["raises_on_import.fn"])
    assert str(err.value) == "importing 'raises_on_import' (eval.metrics) raised RuntimeError: no GPU"


# ---------------------------------------------------------------- a run that trained nothing


def test_the_worker_never_turns_sys_exit_into_success(tmp_path):
    """sys.exit(0) from anywhere inside training (a library, unfenced user code): exit 2, one line."""
    code = textwrap.dedent(
        """
        import sys
        import finetune.train.stage as stage
        stage.run_worker = lambda run_dir: sys.exit(0)
        from finetune.train.__main__ import main
        sys.exit(main([sys.argv[1]]))
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=child_env(), cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    # (bitsandbytes may say first that it found no CPU kernels package)
    assert r.stderr.strip().splitlines()[-1] == (
        "finetune.train: training was ended by sys.exit(0) from inside it, before it finished; nothing after "
        "the last checkpoint was saved"
    )


def test_the_pipeline_does_not_call_a_run_without_output_a_success(tmp_path, monkeypatch):
    from helpers import plan_for

    from finetune.pipeline import stages

    cfg = tiny_cfg(f"run_dir={tmp_path / 'run'}")
    monkeypatch.setattr(stages, "launch_ranks", lambda *a, **k: 0)
    with pytest.raises(LaunchError, match=r"training exited with code 0 but saved no adapter/"):
        stages.train_stage(cfg, Path(tmp_path / "run"), plan_for(cfg))
    # started elsewhere (a dry run, detached, SLURM): nothing to find yet
    dry = tiny_cfg(f"run_dir={tmp_path / 'run'}", "launch.dry_run=true")
    assert stages.train_stage(dry, Path(tmp_path / "run"), plan_for(dry)) == 0
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    assert stages.train_stage(cfg, Path(tmp_path / "run"), plan_for(cfg)) == 0


# ---------------------------------------------------------------- inside TRL's GRPO step


def _grpo_trainer(tiny_model_cfg, out: Path, reward: rewards.Reward):
    from datasets import Dataset
    from peft import LoraConfig

    from finetune.core import tasks
    from finetune.core.config.grpo import GRPOObjective
    from finetune.modeling import tiny
    from finetune.train.grpo_trainer import build_grpo_config, build_grpo_trainer, prompt_rows

    torch.manual_seed(0)
    tokenizer = tiny.load_tokenizer(tiny_model_cfg)
    model = tiny.load_model(tiny_model_cfg, dtype=torch.bfloat16)
    dataset = Dataset.from_list(prompt_rows(tasks.generate(8, 0)))
    grpo = GRPOObjective(rewards=["exact_match"], num_generations=4, max_completion_length=4)
    args = build_grpo_config(
        grpo, [reward], out, generation="transformers", per_device_train_batch_size=4,
        gradient_accumulation_steps=1, max_steps=1, logging_steps=1, report_to=[], bf16=True, use_cpu=True,
        save_strategy="no", seed=0,
    )  # fmt: skip
    lora = LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    return build_grpo_trainer(model, tokenizer, dataset, [reward], args, lora)


@pytest.mark.slow  # TRL's GRPO trainer built three times on the tiny model (about 40 s in all)
@pytest.mark.parametrize("case", ["exits", "interrupts", "hangs"])
def test_a_reward_inside_a_grpo_step_is_fenced(tiny_cache, tiny_model_cfg, tmp_path, case):
    def exits(prompts, completions, references):
        sys.exit(0)

    def interrupts(prompts, completions, references):
        raise KeyboardInterrupt

    def hangs(prompts, completions, references):
        time.sleep(60)

    fn = {"exits": exits, "interrupts": interrupts, "hangs": hangs}[case]
    trainer = _grpo_trainer(tiny_model_cfg, tmp_path / "out", rewards.Reward(f"my.{case}", 1.0, fn, 1.0))
    with pytest.raises(RewardError) as err:
        trainer.train()
    assert (
        str(err.value)
        == {
            "exits": "reward 'my.exits' called sys.exit(0); user code must return a value, not end the run",
            "interrupts": "reward 'my.interrupts' raised KeyboardInterrupt",
            "hangs": "reward 'my.hangs' did not return within 1 s (objective.reward_timeout_s); fix it, or raise "
            "objective.reward_timeout_s if it is only slow",
        }[case]
    )
