"""DPO as an objective: the axis (config group, spec table), preference records through the data stage,
the planner's DPO terms, and DPO training on the CPU (one process) with its preference metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, child_env, run_cli, tiny_cfg

from finetune.core.config.data import DataConfig
from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES, RECORD_KINDS, ObjectiveSpec
from finetune.data import pairs, preferences
from finetune.data.formats import RecordError

# ---------------------------------------------------------------- the axis


def test_objective_group_and_settings_compose():
    cfg = tiny_cfg("objective=dpo", "objective.beta=0.25", "objective.loss_type=ipo")
    assert cfg.objective.spec is OBJECTIVES["dpo"]
    assert (cfg.objective.beta, cfg.objective.loss_type) == (0.25, "ipo")
    assert tiny_cfg().objective.name == "sft"  # the default stays SFT


def test_former_section_keys_still_work_with_a_pointer_on_stderr(capsys):
    cfg = tiny_cfg("objective=dpo", "dpo.beta=0.3", "+dpo.loss_type=ipo")
    assert (cfg.objective.beta, cfg.objective.loss_type) == (0.3, "ipo")
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "finetune: dpo.beta is now objective.beta (objective=dpo); the old key goes in the next release",
        "finetune: dpo.loss_type is now objective.loss_type (objective=dpo); the old key goes in the next release",
    ]


def test_the_section_is_the_chosen_objectives_own_dataclass():
    from finetune.core.config import Config, DPOObjective, SFTObjective

    assert type(tiny_cfg().objective) is SFTObjective
    assert type(tiny_cfg("objective=dpo").objective) is DPOObjective
    # a run directory's config.yaml holds a mapping: its name chooses the class
    assert Config(objective={"name": "dpo", "beta": 0.5}).objective == DPOObjective(beta=0.5)
    with pytest.raises(
        ConfigError, match=r"objective\.bogus: unknown key for objective=dpo; valid keys: beta"
    ):
        Config(objective={"name": "dpo", "bogus": 1})


@pytest.mark.parametrize(
    "override, message",
    [
        ("objective.beta=0.2", "objective.beta: unknown key; valid keys: name"),  # SFT has no beta
        ("objective=ppo", f"objective=ppo: unknown objective; choose from {', '.join(sorted(OBJECTIVES))}"),
        ("objective=dpo objective.loss_type=bogus", "objective.loss_type='bogus' is not one of sigmoid"),
        ("objective=dpo objective.beta=0", "objective.beta=0.0 must be > 0"),
    ],
)
def test_bad_objective_settings_are_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        tiny_cfg(*override.split())
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_objective_names_what_the_stages_read():
    from finetune.core.config.objective import ObjectiveConfig

    for name, spec in OBJECTIVES.items():
        kind = spec.record_module()  # the data stage prepares and saves its records
        assert callable(kind.prepare) and callable(kind.save)
        trainer = spec.trainer_module()  # the training stage builds its config and trainer
        trl_trainer, trl_config = spec.trl_classes()
        assert issubclass(trainer.Trainer, trl_trainer) and trl_config.__module__.startswith("trl.")
        assert callable(trainer.build_config) and callable(trainer.trainer_kwargs)
        settings = spec.settings_class()  # the `objective` section's schema, named after it
        assert issubclass(settings, ObjectiveConfig)
        assert settings.__dataclass_fields__["name"].default == name
        assert (REPO / "configs" / "objective" / f"{name}.yaml").is_file()
    kinds = {s.record_kind for s in OBJECTIVES.values()}
    assert kinds | {RECORD_KINDS[k].with_images for k in kinds} - {None} == set(RECORD_KINDS)
    with pytest.raises(ValueError, match="record_kind"):
        ObjectiveSpec(
            "x", "x", record_kind="images", settings="m:C", trainer="m", trl_trainer="T", trl_config="C"
        )


def test_recipe_tiny_dpo_composes_and_names_its_smoke_sibling():
    from finetune.core.composition import compose

    cfg = compose(["+recipe=tiny_dpo"])
    assert cfg.objective.name == "dpo" and cfg.smoke.sibling == "tiny_dpo"


# ---------------------------------------------------------------- preference records


DC = DataConfig()


def test_pair_shapes_map_to_prompt_chosen_rejected():
    plain = pairs.to_pair({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, DC)
    assert plain.prompt == [{"role": "user", "content": "2+2?"}]
    assert plain.chosen == [{"role": "assistant", "content": "4"}]
    assert plain.rejected == [{"role": "assistant", "content": "5"}]
    user = {"role": "user", "content": "hi"}
    whole = pairs.to_pair(
        {
            "chosen": [user, {"role": "assistant", "content": "hello"}],
            "rejected": [user, {"role": "assistant", "content": "go away"}],
        },
        DC,
    )
    assert whole.prompt == [user]  # the common prefix is the prompt
    assert whole.rejected == [{"role": "assistant", "content": "go away"}]


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "identical_pair"),
        ({"prompt": "q", "chosen": "a"}, "missing_field"),
        (
            {"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", "content": "y"}]},
            "no_shared_prompt",
        ),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, "bad_content"),
    ],
)
def test_bad_pairs_are_refused_with_a_reason(record, reason):
    with pytest.raises(RecordError) as err:
        pairs.to_pair(record, DC)
    assert err.value.reason == reason


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_bad_preference_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    good = {"prompt": "Even or odd: 12", "chosen": "even", "rejected": "odd"}
    data = _write(
        tmp_path / "prefs.jsonl", [good, good | {"prompt": "Even or odd: 13"}, '{"prompt": "x", "chosen": ']
    )
    run = tmp_path / "run"
    proc = run_cli(
        "objective=dpo", "mode=data", f"data.path={data}", f"run_dir={run}", f"data.cache_dir={tmp_path / 'c'}",
        env=child_env(FINETUNE_CACHE=str(tmp_path / "cache")),
    )  # fmt: skip
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "prefs.jsonl line 3" in last and "malformed_json" in last or "line 3" in last
    assert not (run / "data_stats.json").exists() and not (run / "data").exists()


def test_preference_data_stage_splits_by_prompt_and_counts(tmp_path, tiny_tokenizer):
    from finetune.data import sources

    rows = []
    for n in range(60):
        answer = "even" if n % 2 == 0 else "odd"
        other = "odd" if answer == "even" else "even"
        prompt = [{"role": "user", "content": f"Even or odd: {1000 + n * 7919}"}]
        rows.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": other}],
            }
        )
        # a second pair on the same prompt: held out, or trained on, with its prompt
        rows.append({"prompt": prompt, "chosen": answer, "rejected": "maybe"})
    rows.append(rows[0])  # an exact duplicate
    rows.append({"prompt": "Even or odd: 5", "chosen": "x" * 5000, "rejected": "odd"})  # too long
    path = _write(tmp_path / "p.jsonl", rows)
    cfg = tiny_cfg("objective=dpo", "train.seq_len=48", "data.eval_fraction=0.2", "data.near_dedup=false")
    inp, _ = sources.open_input(str(path))
    prepared = preferences.prepare(cfg, tiny_tokenizer, inp, str(path), console=None)
    s = prepared.stats
    assert s["num_input"] == 122
    assert s["dropped"]["duplicate"] == 1
    assert s["dropped"].get("too_long", 0) + s["dropped"].get("too_long_chars", 0) == 1
    assert s["num_train"] + s["num_eval"] == 120
    assert s["num_eval"] == 24  # 12 prompts of 60, both of their pairs

    def prompts(rows):
        return {tuple(r["prompt_ids"]) for r in rows}

    assert not prompts(prepared.train) & prompts(prepared.evals)  # no eval prompt is trained on
    row = prepared.train[0]
    assert row["chosen_ids"] != row["rejected_ids"] and len(row["prompt_ids"]) > 3
    for r in [*prepared.train, *prepared.evals]:
        assert len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) <= 48
    assert set(s["lengths"]["train"]) == {"prompt", "chosen", "rejected"}
    ev = prepared.evals[0]
    assert json.loads(ev["messages"])[-1]["role"] == "assistant"  # prompt + chosen, for generation


def test_bundled_preferences_are_the_right_answer_over_the_wrong_one():
    from finetune.core import tasks
    from finetune.modeling.tiny import bundled_data_path

    lines = bundled_data_path("preferences").read_text().splitlines()
    assert len(lines) == 1200
    for line in lines[:200]:
        r = json.loads(line)
        prompt = r["prompt"][-1]["content"]
        assert tasks.task_of(prompt) in ("parity", "sentiment")
        assert {r["chosen"][0]["content"], r["rejected"][0]["content"]} in (
            {"even", "odd"},
            {"positive", "negative"},
        )
    # regenerating writes the same bytes
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "p.jsonl"
        subprocess.run(
            [sys.executable, str(REPO / "scripts" / "make_bundled_preferences.py"), "--out", str(out)],
            check=True,
            capture_output=True,
        )
        assert out.read_bytes() == bundled_data_path("preferences").read_bytes()


# ---------------------------------------------------------------- the plan


def _plans(*overrides: str, precompute=None):
    from finetune.core.composition import compose, load_profiles
    from finetune.planner import make_plan

    cfg = compose(list(overrides))
    out = {}
    for name in ("sft", "dpo"):
        out[name] = make_plan(
            cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, load_profiles(),
            objective=OBJECTIVES[name], precompute_reference=precompute,
        )  # fmt: skip
    return out


def test_dpo_plan_carries_two_sequences_and_the_reference_forward():
    fixed = ("+recipe=llama8b_lora", "train.micro_batch_size=2", "train.activation_checkpointing=true",
             "train.chunked_loss=false")  # fmt: skip
    p = _plans(*fixed)
    sft, dpo = p["sft"], p["dpo"]
    assert dpo.strategy.micro_batch_size == sft.strategy.micro_batch_size == 2
    # twice the sequences: the saved activations double exactly (the same layers, twice the tokens)
    assert dpo.gpu_memory.activations == pytest.approx(2 * sft.gpu_memory.activations, rel=1e-6)
    assert (
        dpo.gpu_memory.logits > sft.gpu_memory.logits
    )  # the loss over twice the tokens, the reference forward
    assert dpo.gpu_memory.weights == pytest.approx(sft.gpu_memory.weights)  # adapters: no reference copy
    # the time: twice the tokens a step, each with the reference forward on top
    assert dpo.estimate.step_seconds > 2 * sft.estimate.step_seconds
    assert not dpo.strategy.chunked_loss


def test_launch_counts_a_dpo_batch_in_pairs_and_sequences(tmp_path, capsys):
    """train.micro_batch_size counts pairs under DPO: the launch line says so, and the sequences they carry."""
    from finetune.pipeline.cli import main

    run = tmp_path / "run"
    assert main(["+recipe=tiny_dpo", "mode=launch", "launch.dry_run=true", f"run_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 32 x accumulation 1 x 1 data-parallel rank(s) = 32 pairs a step (64 sequences)" in out
    assert "= 32 pairs a step (64 sequences)" in (run / "launch.sh").read_text()


def test_full_fine_tuning_reference_copy_or_precompute():
    base = ("+recipe=llama70b_full", "hardware=h100x8", "train.micro_batch_size=1", "train.sharding=zero3",
            "train.offload_params=false", "train.offload_optimizer=true")  # fmt: skip
    copy = _plans(*base, precompute=False)["dpo"]
    pre = _plans(*base, precompute=True)["dpo"]
    sft = _plans(*base)["sft"]
    assert not copy.strategy.precompute_reference and pre.strategy.precompute_reference
    params = copy.params_total
    # the frozen bf16 copy, sharded over the 8 ranks like the policy under ZeRO-3 / FSDP2
    extra = copy.gpu_memory.weights - pre.gpu_memory.weights
    assert extra == pytest.approx(2 * params / 8 / 1e9, rel=0.02)
    assert pre.gpu_memory.weights == pytest.approx(sft.gpu_memory.weights, rel=1e-6)
    # auto: the lighter of two equally fast ways (one epoch: the same reference forwards, once or per step)
    chosen = _plans(*base)["dpo"]
    assert chosen.strategy.precompute_reference
    assert copy.estimate.step_seconds == pytest.approx(pre.estimate.step_seconds, rel=1e-6)


def test_planner_stays_pure_with_objectives():
    import subprocess
    import sys

    code = "import finetune.core.objectives, finetune.planner, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env())


# ---------------------------------------------------------------- training and evaluation


def test_preference_scores_by_implicit_reward():
    from finetune.evaluation import preference

    ref = [[-5.0, -5.0], [-3.0, -2.0]]
    same = preference.scores(ref, ref, beta=0.1)
    assert same["preference_accuracy"] == 0.0 and same["reward_margin"] == 0.0  # ties: not preferred
    assert same["logprob_accuracy"] == 0.0
    better = preference.scores([[-4.0, -6.0], [-2.0, -4.0]], ref, beta=0.5)
    assert better["preference_accuracy"] == 1.0
    assert better["reward_margin"] == pytest.approx(0.5 * ((1 + 1) + (1 + 2)) / 2)
    assert better["logprob_accuracy"] == 1.0
    # what DPO's description says its evaluation adds is what the scores are
    assert set(better) - {"pairs"} == set(OBJECTIVES["dpo"].eval_metrics)


@pytest.mark.slow
@pytest.mark.extended  # SFT then 150 DPO steps: about 10 minutes on the shared 2 cores
def test_sft_then_dpo_runs_every_stage_on_the_cpu(tmp_path):
    """SFT (short), then `+recipe=tiny_dpo init_from=SFT_RUN` end to end on the CPU: plan, data, train, eval,
    export. The DPO run starts from the SFT adapter, which is also its reference."""
    env = child_env(FINETUNE_CACHE=str(tmp_path / "cache"))
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    common = (f"data.cache_dir={tmp_path / 'c'}", "eval.regression=false", "eval.num_samples=16")
    proc = run_cli("+recipe=tiny", f"run_dir={sft}", "train.max_steps=60", *common, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(
        "+recipe=tiny_dpo", f"run_dir={dpo}", f"init_from={sft}", "train.report_to=[tensorboard]", *common,
        env=env, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((dpo / "metrics.json").read_text())
    assert metrics["train"]["engine"]["world_size"] == 1 and metrics["train"]["engine"]["loss"] == "trl"
    ev = json.loads((dpo / "eval" / "metrics.json").read_text())
    base, trained = ev["base"], ev["trained"]
    assert base["preference_accuracy"] == 0.0  # the reference against itself: every pair a tie
    assert trained["reward_margin"] > 0 and trained["preference_accuracy"] > 0.5
    assert "merged" in ev and "preference_accuracy" in ev["merged"]
    assert list((dpo / "tensorboard").iterdir())
    assert (dpo / "export").is_dir()
