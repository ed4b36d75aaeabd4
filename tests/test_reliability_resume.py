"""A run directory has one identity: the objective, `init_from` (by what it starts from) and every setting
that changes what training computes are part of the resume check; `mode=plan` is never refused for what a run
directory holds; `init_from` naming the run's own directory is refused; and an adapter is checked (files,
identity.json, base, shapes, finite weights) before training from it or evaluating it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import make_adapter_run, tiny_cfg

from finetune import rundir
from finetune.core.errors import ConfigError, LaunchError
from finetune.modeling import outputs, variants


def _run_with_checkpoints(tmp_path: Path, *overrides: str) -> Path:
    run = tmp_path / "run"
    cfg = tiny_cfg(f"run_dir={run}", *overrides)
    rundir.prepare(cfg)
    rundir.save_config(cfg, run)
    (run / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    return run


@pytest.mark.parametrize(
    "change,key",
    [
        (("objective=dpo",), "objective='sft', not 'dpo'"),
        (("method.learning_rate=1e-3",), "method.learning_rate=0.003, not 0.001"),
        (("train.lr_scheduler=linear",), "train.lr_scheduler='cosine', not 'linear'"),
        (("train.warmup_ratio=0.2",), "train.warmup_ratio=0.05, not 0.2"),
        (("data.train_on=all",), "data.train_on='assistant', not 'all'"),
    ],
)
def test_settings_that_change_what_training_computes_are_refused(tmp_path, change, key):
    run = _run_with_checkpoints(tmp_path)
    with pytest.raises(ConfigError) as err:
        rundir.check_resumable(tiny_cfg(f"run_dir={run}", *change), run)
    assert str(err.value) == (
        f"run_dir={run} has checkpoints trained with {key}: to keep both, give this experiment its own run "
        "directory (name=NEW_NAME or run_dir=PATH); resume=false here starts this one over (its checkpoints are "
        "discarded)"
    )


def test_an_objectives_own_settings_count_and_where_it_runs_does_not(tmp_path):
    run = _run_with_checkpoints(tmp_path, "objective=dpo")
    with pytest.raises(ConfigError, match=r"trained with objective.beta=0.1, not 0.5"):
        rundir.check_resumable(tiny_cfg(f"run_dir={run}", "objective=dpo", "objective.beta=0.5"), run)
    # where generation runs, and how long a reward may take, are not what the run trains
    g = _run_with_checkpoints(tmp_path / "g", "objective=grpo", "objective.num_generations=4")
    same = ("objective=grpo", "objective.num_generations=4")
    rundir.check_resumable(tiny_cfg(f"run_dir={g}", *same, "objective.reward_timeout_s=5"), g)
    with pytest.raises(ConfigError, match=r"trained with objective.max_completion_length=64, not 32"):
        rundir.check_resumable(tiny_cfg(f"run_dir={g}", *same, "objective.max_completion_length=32"), g)


def test_init_from_counts_by_what_it_starts_from(tmp_path, tiny_cache, tiny_model_cfg):
    first = tmp_path / "sft"
    cfg = tiny_cfg(f"run_dir={first}")
    adapter = make_adapter_run(first, tiny_model_cfg, cfg.method)
    outputs.record(adapter, 4, "r1", "adapter")
    run = _run_with_checkpoints(tmp_path)  # trained from the base
    with pytest.raises(
        ConfigError, match=r"checkpoints trained with init_from starting from the base, not sha256:"
    ):
        rundir.check_resumable(tiny_cfg(f"run_dir={run}", f"init_from={first}"), run)
    started = _run_with_checkpoints(tmp_path / "b", f"init_from={first}")
    rundir.check_resumable(tiny_cfg(f"run_dir={started}", f"init_from={first}"), started)
    # the run init_from names trained again: another start
    make_adapter_run(first, tiny_model_cfg, cfg.method, seed=1)
    outputs.record(adapter, 8, "r2", "adapter")
    with pytest.raises(ConfigError, match=r"trained with init_from starting from sha256:\w+, not sha256:"):
        rundir.check_resumable(tiny_cfg(f"run_dir={started}", f"init_from={first}"), started)


def test_init_from_the_run_itself_is_refused_in_every_mode(tmp_path):
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    for extra in ((), ("resume=false",), ("mode=plan",)):
        with pytest.raises(ConfigError) as err:
            rundir.check_resumable(tiny_cfg(f"run_dir={run}", f"init_from={run}", *extra), run)
        assert str(err.value) == (
            f"init_from={run} is this run's own directory: start from an earlier run, and give this one its own "
            "(name=NEW_NAME or run_dir=PATH)"
        )


def test_plan_is_never_refused_and_leaves_the_checkpoints_facts(tmp_path):
    run = _run_with_checkpoints(tmp_path)
    facts = (run / rundir.RESUME_FILE).read_text()
    planned = tiny_cfg(f"run_dir={run}", "train.seq_len=64", "mode=plan")
    rundir.check_resumable(planned, run)
    rundir.save_config(planned, run)
    assert "seq_len: 64" in (run / "config.yaml").read_text()
    assert (run / rundir.RESUME_FILE).read_text() == facts
    # training under the planned settings is still refused, also where ranks check for themselves
    trained = tiny_cfg(f"run_dir={run}", "train.seq_len=64", "mode=train")
    with pytest.raises(ConfigError, match="train.seq_len=128, not 64: to keep both"):
        rundir.check_resumable(trained, run)
    with pytest.raises(ConfigError, match="train.seq_len=128, not 64"):
        rundir.state.check_resume_facts(replace(trained, mode="plan"), run)


def test_a_run_directory_from_before_resume_json_is_checked_from_its_config(tmp_path):
    run = _run_with_checkpoints(tmp_path)
    (run / rundir.RESUME_FILE).unlink()
    with pytest.raises(ConfigError, match="method.lora_rank=32, not 8"):
        rundir.check_resumable(tiny_cfg(f"run_dir={run}", "method.lora_rank=8"), run)
    rundir.check_resumable(tiny_cfg(f"run_dir={run}", "train.max_steps=900"), run)  # a longer run: fine


# ---------------------------------------------------------------- adapters checked before they are loaded


@pytest.fixture
def adapter_run(tmp_path, tiny_cache, tiny_model_cfg):
    run = tmp_path / "run"
    cfg = tiny_cfg(f"run_dir={run}")
    folder = make_adapter_run(run, tiny_model_cfg, cfg.method)
    outputs.record(folder, 4, "r1", "adapter")
    return cfg, run, folder


def _trained(cfg, run):
    return variants.load_variant(cfg, run, "trained")


def test_an_intact_adapter_loads(adapter_run):
    cfg, run, _ = adapter_run
    assert type(_trained(cfg, run)).__name__ == "PeftModelForCausalLM"


def test_missing_or_truncated_weights_are_one_line(adapter_run):
    cfg, run, folder = adapter_run
    weights = folder / "adapter_model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(
        LaunchError, match=r"adapter_model.safetensors: does not match the SHA-256 its identity"
    ):
        _trained(cfg, run)
    (folder / "identity.json").unlink()  # no record to compare with: the file itself is found short
    with pytest.raises(
        LaunchError, match=r"adapter_model.safetensors: cannot be read \(.*\): truncated or damaged"
    ):
        _trained(cfg, run)
    weights.unlink()
    with pytest.raises(
        LaunchError, match=r"adapter_model.safetensors: missing, so .* is not a complete adapter"
    ):
        _trained(cfg, run)


def test_nan_weights_are_refused(adapter_run):
    import torch
    from safetensors.torch import load_file, save_file

    cfg, run, folder = adapter_run
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    first = sorted(tensors)[0]
    tensors[first][0, 0] = torch.nan
    save_file(tensors, str(weights))
    (folder / "identity.json").unlink()
    with pytest.raises(LaunchError, match=rf"tensor {first} holds NaN or inf values"):
        _trained(cfg, run)


def test_an_adapter_of_another_base_or_shape_is_refused(adapter_run, tiny_model_cfg):
    cfg, run, folder = adapter_run
    config = folder / "adapter_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({**settings, "base_model_name_or_path": "someone/another-model"}))
    with pytest.raises(LaunchError, match=r"does not match the SHA-256"):  # identity.json saw the change
        _trained(cfg, run)
    (folder / "identity.json").unlink()
    with pytest.raises(
        LaunchError, match=r"an adapter of someone/another-model, not of .*, the base it would"
    ):
        _trained(cfg, run)
    # an adapter of a wider model
    wide = replace(tiny_model_cfg, hidden_size=2 * tiny_model_cfg.hidden_size)
    other = make_adapter_run(run.parent / "wide", wide, cfg.method)
    config.write_text(json.dumps(settings))
    for name in ("adapter_model.safetensors",):
        (folder / name).write_bytes((other / name).read_bytes())
    with pytest.raises(LaunchError, match=r"does not fit this model \(RuntimeError: size mismatch for"):
        _trained(cfg, run)


# ---------------------------------------------------------------- the last step is the last step

LAST_STEP = (
    "train.max_steps=4",
    "train.save_steps=2",
    "train.save_total_limit=4",
    "train.batch_size=2",
    "data.eval_fraction=0.05",
)
OBJECTIVES = {
    "sft": (),
    "dpo": ("objective=dpo",),
    "grpo": (
        "objective=grpo",
        "train.batch_size=4",
        "objective.num_generations=4",
        "objective.max_completion_length=6",
        "method.precision=bf16",
    ),
}


@pytest.mark.slow  # two short runs a case, in this process
@pytest.mark.parametrize("objective", ["sft", "dpo", pytest.param("grpo", marks=pytest.mark.extended)])
def test_a_run_stopped_after_its_final_checkpoint_trains_no_step_more(tmp_path, tiny_cache, objective):
    """Stopped once checkpoint-4 of a 4-step run exists, before the output was saved (what SIGTERM during the
    last step leaves): the same command again trains nothing and saves the uninterrupted run's adapter."""
    from helpers import prepare_run

    from finetune.pipeline.stages import plan_stage, resolve
    from finetune.train import stage

    cfg = resolve(tiny_cfg(*LAST_STEP, *OBJECTIVES[objective], f"data.cache_dir={tmp_path / 'cache'}",
                           run_dir=tmp_path / "run"))  # fmt: skip
    run = prepare_run(cfg)
    plan = plan_stage(cfg, run, quiet=True)
    first = stage.run(cfg, run, plan)
    assert first["train"]["steps"] == 4
    weights = (run / "adapter" / "adapter_model.safetensors").read_bytes()
    # what a stop after checkpoint-4 was saved leaves: no output, no metrics
    import shutil

    shutil.rmtree(run / "adapter")
    (run / "metrics.json").unlink()
    again = stage.run(cfg, run, plan)
    assert again["train"]["steps"] == 4 and again["train"]["step_seconds"] == []  # no step trained
    assert again["train"]["resumed_from"] == str((run / "checkpoints" / "checkpoint-4").resolve())
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]


def test_export_refuses_a_damaged_adapter_before_copying_it(adapter_run):
    from finetune.export import stage as export_stage

    cfg, run, folder = adapter_run
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (folder / "identity.json").unlink()
    out = run / "export" / "adapter"
    with pytest.raises(
        LaunchError, match=r"adapter_model.safetensors: cannot be read .* truncated or damaged"
    ):
        export_stage.copy_adapter(cfg, run, out)
    assert not out.exists()
    weights.unlink()
    with pytest.raises(LaunchError, match=r"adapter_model.safetensors: missing"):
        export_stage.copy_adapter(cfg, run, out)
